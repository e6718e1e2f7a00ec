"""The key record: the fixed 64-byte message that names an object in shared memory.

The record is defined once, in C, in ``bpf/keymsg.h``; ``_RECORD`` packs the same layout,
pinned by a test. The destination id comes first, so an in-kernel transport (SK_MSG +
sockhash) routes on it; the tenant is the sender's, and a transport delivers a message only to
an instance of the same tenant.
"""

from __future__ import annotations

import dataclasses
import struct
import time
from dataclasses import dataclass

KIND_KEY = 1  # an object to aggregate
KIND_CLOSE = 2  # no more inputs: finish with what arrived (count = the new fan-in)
KIND_ACK = 3  # the sender read ``count`` messages: the credits of the eBPF transport's flow control
KIND_PREPARE = 4  # a hint: a KIND_KEY naming this object follows once it is written; map it meanwhile
KINDS = (KIND_KEY, KIND_CLOSE, KIND_ACK, KIND_PREPARE)

FLAG_PARTIAL = 1  # the object holds a partial sum, not a client update

# bpf/keymsg.h's struct keymsg: dest, src, kind, flags, count, task, samples, sent_ns, key, tenant, agg_us
_RECORD = struct.Struct("<IIHHIQQQ16sII")
RECORD_FIELDS = ("dest", "src", "kind", "flags", "count", "task", "samples", "sent_ns", "key", "tenant", "agg_us")
MESSAGE_BYTES = _RECORD.size
assert MESSAGE_BYTES == 64

AGENT_ID = 0  # the agent's own endpoint id (it only sends)
MAX_ID = (1 << 32) - 1  # instance and tenant ids are 32-bit in the record
MAX_AGG_US = (1 << 32) - 1


@dataclass(frozen=True)
class KeyMessage:
    dest: int  # destination instance id
    task: int  # the destination task the message is for
    kind: int = KIND_KEY
    key: bytes = bytes(16)
    samples: int = 0  # total client samples the object stands for
    count: int = 0  # client updates it stands for (KIND_CLOSE: the new fan-in)
    partial: bool = False
    src: int = 0
    sent_ns: int = 0  # CLOCK_MONOTONIC at send, to measure hand-off latency
    tenant: int = 0  # the sender's tenant id
    agg_us: int = 0  # aggregation time the sender reports (the transport's metrics)

    def pack(self) -> bytes:
        return _RECORD.pack(
            self.dest, self.src, self.kind, FLAG_PARTIAL if self.partial else 0, self.count,
            self.task, self.samples, self.sent_ns, self.key, self.tenant, min(self.agg_us, MAX_AGG_US),
        )

    @classmethod
    def unpack(cls, data: bytes) -> KeyMessage:
        if len(data) != MESSAGE_BYTES:
            raise ValueError(f"key message must be {MESSAGE_BYTES} bytes, got {len(data)}")
        dest, src, kind, flags, count, task, samples, sent_ns, key, tenant, agg_us = _RECORD.unpack(data)
        if kind not in KINDS:
            raise ValueError(f"unknown key message kind {kind}")
        return cls(dest, task, kind, key, samples, count, bool(flags & FLAG_PARTIAL), src, sent_ns, tenant, agg_us)


def stamped(message: KeyMessage, tenant: int) -> bytes:
    """The record as an endpoint of ``tenant`` sends it: an instance speaks for its own tenant only."""
    if message.tenant not in (0, tenant):
        raise ValueError(f"a message of tenant {message.tenant} cannot be sent from tenant {tenant}'s endpoint")
    return dataclasses.replace(message, tenant=tenant).pack()


def now_ns() -> int:
    return time.monotonic_ns()
