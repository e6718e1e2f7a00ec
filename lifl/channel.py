"""The key channel: how object keys travel between a node's aggregators.

Aggregators never pass model bytes, only fixed 64-byte ``KeyMessage`` records that name an
object in shared memory. The channel is an interface in the manner of SPRIGHT's transport
(init / exit / rx / tx): the agent *provisions* an endpoint for each instance it starts,
the instance *attaches* to it, and then sends and receives messages. The destination id is
the first 4 bytes of every message, so an in-kernel implementation (SK_MSG + sockmap) can
route on it without parsing the rest.

``UnixKeyChannel`` implements it with unix datagram sockets, one per instance, named by
instance id in a per-tenant directory that only the tenant's group may write to.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

KIND_KEY = 1  # an object to aggregate
KIND_CLOSE = 2  # no more inputs: finish with what arrived (count = the new fan-in)

FLAG_PARTIAL = 1  # the object holds a partial sum, not a client update

_MESSAGE = struct.Struct("<IIHHIQQQ16s8x")  # dest, src, kind, flags, count, task, samples, sent_ns, key
MESSAGE_BYTES = _MESSAGE.size
assert MESSAGE_BYTES == 64

AGENT_ID = 0  # the agent's own endpoint id (it only sends)


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

    def pack(self) -> bytes:
        return _MESSAGE.pack(
            self.dest, self.src, self.kind, FLAG_PARTIAL if self.partial else 0, self.count,
            self.task, self.samples, self.sent_ns, self.key,
        )

    @classmethod
    def unpack(cls, data: bytes) -> KeyMessage:
        if len(data) != MESSAGE_BYTES:
            raise ValueError(f"key message must be {MESSAGE_BYTES} bytes, got {len(data)}")
        dest, src, kind, flags, count, task, samples, sent_ns, key = _MESSAGE.unpack(data)
        if kind not in (KIND_KEY, KIND_CLOSE):
            raise ValueError(f"unknown key message kind {kind}")
        return cls(dest, task, kind, key, samples, count, bool(flags & FLAG_PARTIAL), src, sent_ns)


def now_ns() -> int:
    return time.monotonic_ns()


class KeyChannel(Protocol):
    """One endpoint (init = construction). tx routes by ``message.dest``."""

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


class UnixKeyChannel:
    def __init__(self, sock: socket.socket, directory: Path) -> None:
        self._sock = sock
        self._dir = directory

    # -- the agent's side: endpoints (routes) -------------------------------------------------
    @staticmethod
    def provision(directory: Path, instance_id: int, gid: int | None) -> socket.socket:
        """Create and bind the endpoint of a new instance before it starts, so keys sent to a
        cold-starting instance wait in its queue. Its fd is handed to the instance."""
        path = directory / str(instance_id)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o660)
        if gid is not None:
            os.chown(path, -1, gid)
        return sock

    @staticmethod
    def retire(directory: Path, instance_id: int) -> None:
        (directory / str(instance_id)).unlink(missing_ok=True)

    @classmethod
    def sender(cls, directory: Path) -> UnixKeyChannel:
        """An unbound endpoint that only sends (the agent's)."""
        return cls(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), directory)

    # -- KeyChannel ---------------------------------------------------------------------------
    def send(self, message: KeyMessage) -> None:
        self._sock.sendto(message.pack(), str(self._dir / str(message.dest)))

    def try_send(self, message: KeyMessage) -> bool:
        try:
            self._sock.sendto(message.pack(), socket.MSG_DONTWAIT, str(self._dir / str(message.dest)))
            return True
        except BlockingIOError:
            return False

    def recv(self, timeout: float | None = None) -> KeyMessage | None:
        if timeout is not None:
            ready, _, _ = select.select([self._sock], [], [], timeout)
            if not ready:
                return None
        data = self._sock.recv(MESSAGE_BYTES + 1)
        return KeyMessage.unpack(data)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()
