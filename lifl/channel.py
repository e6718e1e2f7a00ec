"""The key transport: how object keys travel between a node's aggregators.

Aggregators never pass model bytes, only fixed 64-byte ``KeyMessage`` records that name an
object in shared memory (the record is defined once, in C, in ``bpf/keymsg.h``; ``_RECORD``
packs the same layout, pinned by a test). The destination id comes first, so an in-kernel
transport (SK_MSG + sockhash) routes on it; the tenant is the sender's, and a transport
delivers a message only to an instance of the same tenant.

The seam is SPRIGHT's transport behind four calls (init / exit / rx / tx): a ``KeyTransport``
is the agent's side (``provision`` an endpoint for each instance before it starts, ``retire``
it, a ``sender`` per tenant for the agent's own keys); an instance ``attach``-es to its
endpoint from the descriptor and the spec it was given, and sends and receives through the
``KeyEndpoint`` it gets. Which transport runs is one flag (``lifl up --channel``).

``UnixTransport``: unix datagram sockets, one per instance, named by instance id in a
per-tenant directory that only the tenant's group may write to (so the kernel keeps tenants
apart, and a message's tenant field is checked on receipt).
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client.registry import Collector

from lifl.store import Tenant

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


class KeyEndpoint(Protocol):
    """One endpoint: tx routes by ``message.dest``; rx takes what was sent to this one."""

    def send(self, message: KeyMessage) -> None:
        """tx. Blocks while the destination's queue is full; raises ConnectionRefusedError if
        the destination does not exist."""

    def try_send(self, message: KeyMessage) -> bool:
        """tx without blocking: False if the destination's queue is full."""

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        """rx: the next message, or None after ``timeout`` seconds."""

    def fileno(self) -> int:
        """For select(); readable when a message is waiting."""

    def close(self) -> None:
        """exit."""


class KeyTransport(Protocol):
    """A node's key transport, the agent's side."""

    name: str

    def provision(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        """The endpoint of a new instance, made before it starts so that keys sent to a
        cold-starting instance wait for it: its socket (handed to the instance, which attaches
        to it) and the spec ``attach`` takes with it."""

    def retire(self, tenant: Tenant, instance: int) -> None:
        """The instance is gone: its endpoint goes too."""

    def sender(self, tenant: Tenant) -> KeyEndpoint:
        """The agent's endpoint for sending keys to ``tenant``'s instances."""

    def close(self) -> None:
        """Shutdown: everything the transport set up goes."""

    def collector(self) -> Collector | None:
        """Its own metrics, read when Prometheus scrapes (None: it has none)."""


class UnixEndpoint:
    """A unix datagram socket; sends go to ``directory/<dest>``. Messages are stamped with the
    endpoint's tenant, and messages of another tenant are refused on receipt."""

    def __init__(self, sock: socket.socket, directory: Path, tenant: int) -> None:
        self._sock = sock
        self._dir = directory
        self.tenant = tenant

    def send(self, message: KeyMessage) -> None:
        self._sock.sendto(stamped(message, self.tenant), str(self._dir / str(message.dest)))

    def try_send(self, message: KeyMessage) -> bool:
        try:
            self._sock.sendto(stamped(message, self.tenant), socket.MSG_DONTWAIT, str(self._dir / str(message.dest)))
            return True
        except BlockingIOError:
            return False

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        if timeout is not None:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                return None
        message = KeyMessage.unpack(self._sock.recv(MESSAGE_BYTES + 1))
        if message.tenant != self.tenant:
            raise ValueError(f"a key message of tenant {message.tenant} reached an endpoint of tenant {self.tenant}")
        return message

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()


class UnixTransport:
    """Endpoints in ``directory/<tenant>/<instance id>``: the tenant's directory is 0750 and its
    group the tenant's, so only the agent and the tenant's functions reach its sockets."""

    name = "unix"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._senders: dict[str, UnixEndpoint] = {}

    def _tenant_dir(self, tenant: Tenant) -> Path:
        directory = self.directory / tenant.name
        if not directory.exists():
            directory.mkdir(exist_ok=True)
            os.chmod(directory, 0o750)
            if tenant.gid is not None:
                os.chown(directory, -1, tenant.gid)
        return directory

    def provision(self, tenant: Tenant, instance: int) -> tuple[socket.socket, str]:
        directory = self._tenant_dir(tenant)
        path = directory / str(instance)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o660)
        if tenant.gid is not None:
            os.chown(path, -1, tenant.gid)
        return sock, f"{self.name}:{tenant.id}:{directory}"

    def retire(self, tenant: Tenant, instance: int) -> None:
        (self.directory / tenant.name / str(instance)).unlink(missing_ok=True)

    def sender(self, tenant: Tenant) -> UnixEndpoint:
        endpoint = self._senders.get(tenant.name)
        if endpoint is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            endpoint = self._senders.setdefault(tenant.name, UnixEndpoint(sock, self._tenant_dir(tenant), tenant.id))
        return endpoint

    def close(self) -> None:
        for endpoint in self._senders.values():
            endpoint.close()
        self._senders.clear()

    def collector(self) -> None:
        return None  # the kernel counts nothing of unix datagrams for us


CHANNELS = ("auto", "ebpf", "unix")  # what ``lifl up --channel`` takes


def transport(name: str, node: str, directory: Path) -> tuple[KeyTransport, str]:
    """The transport ``lifl up --channel NAME`` runs (endpoints under ``directory``), and why it
    is that one, for the node's log: ``auto`` takes eBPF when the kernel, the build and the
    privileges allow, unix sockets otherwise."""
    if name == UnixTransport.name:
        return UnixTransport(directory), "asked for (--channel unix)"
    if name not in CHANNELS:
        raise ValueError(f"unknown key transport {name!r}: one of {', '.join(CHANNELS)}")
    from lifl import ebpf  # loads only where eBPF may be used

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
        from lifl.ebpf import EbpfEndpoint

        return EbpfEndpoint(sock, int(rest))
    raise ValueError(f"unknown key transport {name!r} in endpoint spec {spec!r}")
