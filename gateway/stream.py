"""Socket plumbing shared by the gateway's front ends: a listener with a thread per connection,
a read side on which small reads go through a buffer while bulk reads land directly in the
caller's memory (a shared-memory object) with no intermediate copy, and sendfile out of it."""

from __future__ import annotations

import os
import select
import socket
import threading
from abc import ABC, abstractmethod

from lifl.errors import BadRequest

_FILL = 1 << 16


class Stream:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def readinto(self, view: memoryview) -> int:
        """Read up to len(view) bytes into view; 0 at end of stream."""
        if self._buf:
            n = min(len(view), len(self._buf))
            view[:n] = self._buf[:n]
            del self._buf[:n]
            return n
        return self.sock.recv_into(view)

    def read_exact(self, n: int) -> bytes:
        """Exactly n bytes (small items: headers, frame prefixes); EOFError if the peer closes."""
        while len(self._buf) < n:
            chunk = self.sock.recv(max(_FILL, n - len(self._buf)))
            if not chunk:
                raise EOFError("connection closed")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def read_some(self, limit: int) -> bytes:
        """At least one and at most ``limit`` bytes."""
        if not self._buf:
            chunk = self.sock.recv(_FILL)
            if not chunk:
                raise EOFError("connection closed")
            self._buf += chunk
        out = bytes(self._buf[:limit])
        del self._buf[:limit]
        return out

    def read_until(self, marker: bytes, limit: int) -> bytes:
        """Bytes up to and including ``marker``; BadRequest if it does not come within ``limit``."""
        start = 0
        while True:
            i = self._buf.find(marker, start)
            if i >= 0:
                out = bytes(self._buf[: i + len(marker)])
                del self._buf[: i + len(marker)]
                return out
            if len(self._buf) > limit:
                raise BadRequest(f"no {marker!r} within {limit} bytes", code="header_too_large")
            start = max(0, len(self._buf) - len(marker) + 1)
            chunk = self.sock.recv(_FILL)
            if not chunk:
                raise EOFError("connection closed")
            self._buf += chunk

    @property
    def buffered(self) -> int:
        return len(self._buf)


def sendfile_all(sock: socket.socket, fd: int, count: int, timeout: float) -> None:
    """Send ``count`` bytes of ``fd`` from offset 0 with sendfile (the kernel copies them from
    shared memory into the socket); TimeoutError if the peer reads nothing for ``timeout`` s."""
    offset = 0
    while offset < count:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, count - offset)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            if not select.select([], [sock], [], timeout)[1]:
                raise TimeoutError(f"the peer stopped reading after {offset} of {count} bytes") from None
            continue
        if sent == 0:
            raise ConnectionError(f"the object ended after {offset} of {count} bytes")
        offset += sent


class ThreadedServer(ABC):
    """Accepts connections and serves each on its own thread, up to ``max_connections``;
    subclasses implement ``serve`` (and ``refuse``, for connections over the limit)."""

    def __init__(self, host: str, port: int, max_connections: int = 1024) -> None:
        self._sock = socket.create_server((host, port), backlog=256)
        self.address = self._sock.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(max_connections)

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name=f"{type(self).__name__}-accept", daemon=True).start()

    def stop(self) -> None:
        self._sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                try:
                    self.refuse(sock)
                finally:
                    sock.close()
                continue
            threading.Thread(target=self._run, args=(sock,), daemon=True).start()

    def _run(self, sock: socket.socket) -> None:
        try:
            self.serve(sock)
        finally:
            self._slots.release()
            sock.close()

    @abstractmethod
    def serve(self, sock: socket.socket) -> None:
        """Speak the front end's protocol on one connection until it ends."""

    def refuse(self, sock: socket.socket) -> None:
        """Called for a connection over the limit, before it is closed."""
