"""Which key transport a node runs (one flag: ``lifl up --channel``), and an instance's endpoint
from the spec its transport provisioned.
"""

from __future__ import annotations

import socket
from pathlib import Path

from lifl.keys.transport import KeyEndpoint, KeyTransport
from lifl.keys.unix import UnixEndpoint, UnixTransport


CHANNELS = ("auto", "ebpf", "unix")  # what ``lifl up --channel`` takes


def transport(name: str, node: str, directory: Path) -> tuple[KeyTransport, str]:
    """The transport ``lifl up --channel NAME`` runs (endpoints under ``directory``), and why it
    is that one, for the node's log: ``auto`` takes eBPF when the kernel, the build and the
    privileges allow, unix sockets otherwise."""
    if name == UnixTransport.name:
        return UnixTransport(directory), "asked for (--channel unix)"
    if name not in CHANNELS:
        raise ValueError(f"unknown key transport {name!r}: one of {', '.join(CHANNELS)}")
    from lifl.keys import ebpf  # loads only where eBPF may be used

    why_not = ebpf.available()
    if name == ebpf.EbpfTransport.name:
        if why_not is not None:
            raise RuntimeError(f"--channel ebpf: {why_not}")
        return ebpf.EbpfTransport(node, directory), "asked for (--channel ebpf)"
    if why_not is None:
        try:
            return ebpf.EbpfTransport(node, directory), "the kernel, the build and the privileges allow it"
        except ebpf.EbpfError as e:
            why_not = str(e)
    return UnixTransport(directory), f"eBPF is not available: {why_not}"


def attach(spec: str, sock: socket.socket) -> KeyEndpoint:
    """An instance's endpoint from the socket and the spec ``provision`` gave it."""
    name, _, rest = spec.partition(":")
    if name == UnixTransport.name:
        tenant, _, directory = rest.partition(":")
        if not tenant.isdecimal() or not directory:
            raise ValueError(f"bad unix endpoint spec {spec!r}: expected unix:TENANT:DIRECTORY")
        return UnixEndpoint(sock, Path(directory), int(tenant))
    if name == "ebpf":
        if not rest.isdecimal():
            raise ValueError(f"bad ebpf endpoint spec {spec!r}: expected ebpf:TENANT")
        from lifl.keys.ebpf import EbpfEndpoint

        return EbpfEndpoint(sock, int(rest))
    raise ValueError(f"unknown key transport {name!r} in endpoint spec {spec!r}")
