"""The key channel: how object keys travel between a node's aggregators.

Aggregators never pass model bytes, only fixed 64-byte key records that name an object in
shared memory (``record``). The seam is SPRIGHT's transport behind four calls (init / exit /
rx / tx), the interface of ``transport``; ``unix`` and ``ebpf`` implement it, and ``factory``
picks one (``lifl up --channel``) and attaches an instance to its endpoint. The interface
imports neither implementation.
"""
