"""Socket plumbing shared by the gateway's front ends: a listener with a thread per connection,
a read side on which small reads go through a buffer while bulk reads land directly in the
caller's memory (a shared-memory object) with no intermediate copy, and sendfile out of it.

A few connections must not deny service to the rest, so everything a peer can hold is
bounded (``lifl.net.limits.ConnectionLimits``; the gateway's command-line flags set them):

- time: a connection waiting for its next request is closed after ``idle_timeout``; a
  request head must be complete ``head_timeout`` after its first byte; a body must keep up
  ``min_body_rate`` (after ``body_grace``, averaged over ``body_window``: see RateMeter). A
  stalled read raises the builtin ``TimeoutError``, so the front end can abort what the peer
  held (an upload's round slot).
- connections: at most ``max_connections`` in all and ``max_per_peer`` from one address.
  Over a limit, a new connection displaces the oldest one that is only waiting for (or still
  sending) a request head, the peer's own first; failing that it may take one of a few
  reserved slots, on which the front end answers only cheap requests (HTTP health checks),
  so those keep working while the limits are full. Anything else is refused from the
  accept loop without a thread.
- memory: reads allocate as bytes arrive, never what the peer announces.

With TLS (``ThreadedServer.use_tls``) each connection's handshake runs on its own thread,
within ``head_timeout`` and evictable like a connection waiting for its head; one that fails
(an untrusted client certificate, an old protocol version, plain text) ends that connection
alone. Bulk reads still land in the caller's memory, decrypted there (lifl.net.tls).
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import socket
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lifl.net.limits import ConnectionLimits
from lifl.net.tls import TlsSocket

LISTEN_BACKLOG = 1024
ACCEPT_BACKOFF = 0.05  # s to wait when the process is out of file descriptors

_FILL = 1 << 16  # the most one recv adds to the read buffer, whatever the peer announced
_TIMEOUT_SLACK = 0.9  # a socket timeout within 10 % above the budget is kept (saves a syscall per recv)
TLS_SEND_CHUNK = 1 << 20  # bytes of a file handed to TLS at a time, where sendfile cannot be used


class RateMeter:
    """Whether a peer keeps up ``rate`` bytes/s while we wait for its bytes. The first ``grace``
    seconds of waiting are free; after them the peer may be behind by at most ``window`` seconds'
    worth of bytes: waiting drains a credit at ``rate`` bytes/s, received bytes refill it up to
    that cap (so a burst does not buy a long stall later). Only time spent waiting is charged:
    a server busy elsewhere costs the peer nothing."""

    def __init__(self, rate: float, grace: float, window: float) -> None:
        self._rate = rate
        self._cap = rate * window
        self._credit = rate * (grace + window)

    def waited(self, seconds: float, received: int) -> None:
        drained = self._credit - seconds * self._rate
        self._credit = max(drained, min(drained + received, self._cap))

    def time_left(self) -> float:
        """Seconds we may still wait without a byte before the peer is too slow (<= 0: it is)."""
        return self._credit / self._rate if self._rate > 0 else float("inf")


# What a Stream is reading, which decides how long a read may wait.
_OPEN = "open"  # the socket's own timeout (a Stream nobody set a phase on: clients, gRPC)
_HANDSHAKE = "handshake"  # TLS, before anything else: within head_timeout
_IDLE = "idle"  # waiting for the first byte of a request: idle_timeout
_HEAD = "head"  # the rest of the head, by a deadline set at its first byte
_BODY = "body"  # a body, at the minimum rate
_CLOSING = "closing"  # the last response is sent; only the peer's last bytes are still read
_EVICTABLE = (_HANDSHAKE, _IDLE, _HEAD, _CLOSING)  # no request in progress


class Stream:
    def __init__(self, sock: socket.socket | TlsSocket, limits: ConnectionLimits | None = None) -> None:
        self.sock = sock
        self.limits = limits or ConnectionLimits()
        self._buf = bytearray()
        self._phase = _OPEN
        self._deadline = 0.0  # of the wait for a request's first byte, then of its head
        self._meter: RateMeter | None = None
        self._lock = threading.Lock()  # phase changes against eviction by the accept loop
        self._evicted = False
        self.peer_certificate: dict[str, Any] | None = None  # a verified TLS client certificate (getpeercert())

    # -- phases ---------------------------------------------------------------------------------
    def handshake(self) -> bool:
        """TLS: complete the handshake within ``head_timeout``; whether it succeeded (if not, the
        connection is only to be closed). Until then the connection may be evicted."""
        assert isinstance(self.sock, TlsSocket)
        with self._lock:
            self._phase = _HANDSHAKE
        try:
            self.sock.handshake(self.limits.head_timeout)
        except (OSError, ValueError):  # ssl.SSLError and TimeoutError are OSErrors; ValueError: closed meanwhile
            return False
        with self._lock:
            if self._evicted:
                return False
            self._phase = _OPEN
        self.peer_certificate = self.sock.getpeercert() or None  # {}: a certificate that was not verified
        return True

    def expect_request(self) -> bool:
        """Wait up to ``idle_timeout`` for the first byte of the next request, then start its
        head's deadline; False if the peer closed the connection first. Until ``expect_body``
        the connection may be evicted to make room for another."""
        with self._lock:
            self._phase = _IDLE
        self._deadline = time.monotonic() + self.limits.idle_timeout
        if not self._buf:
            chunk = self._recv(self.sock.recv, _FILL)
            if not chunk:
                return False
            self._buf += chunk
        self._deadline = time.monotonic() + self.limits.head_timeout
        self._phase = _HEAD
        return True

    def expect_body(self) -> None:
        """The head is in: the request is being served (it is no longer evicted) and reads of
        its body must keep up the minimum rate. EOFError if it was evicted meanwhile."""
        with self._lock:
            if self._evicted:
                raise EOFError("the connection was closed to make room for others")
            self._phase = _BODY
            self._meter = RateMeter(self.limits.min_body_rate, self.limits.body_grace, self.limits.body_window)

    def closing(self) -> None:
        """The last response is sent: what is left of the connection may be evicted."""
        with self._lock:
            self._phase = _CLOSING

    def evict(self) -> bool:
        """Close the connection if it has no request in progress (see ``_EVICTABLE``)."""
        with self._lock:
            if self._phase not in _EVICTABLE or self._evicted:
                return False
            self._evicted = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends (EOF) and the thread with it
        except OSError:
            pass
        return True

    # -- reading --------------------------------------------------------------------------------
    def readinto(self, view: memoryview) -> int:
        """Read up to len(view) bytes into view; 0 at end of stream."""
        if self._buf:
            n = min(len(view), len(self._buf))
            view[:n] = self._buf[:n]
            del self._buf[:n]
            return n
        return self._recv(self.sock.recv_into, view)

    def read_exact(self, n: int) -> bytes:
        """Exactly n bytes (small items: headers, frame prefixes); EOFError if the peer closes."""
        while len(self._buf) < n:
            self._fill(_FILL)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def read_some(self, limit: int) -> bytes:
        """At least one and at most ``limit`` bytes."""
        if not self._buf:
            self._fill(_FILL)
        out = bytes(self._buf[:limit])
        del self._buf[:limit]
        return out

    def read_until(self, marker: bytes, limit: int) -> bytes | None:
        """Bytes up to and including ``marker``, at most ``limit`` of them in all; None if the
        marker does not come within ``limit`` bytes. EOFError if the peer closes first."""
        start = 0
        while True:
            i = self._buf.find(marker, start, limit)
            if i >= 0:
                out = bytes(self._buf[: i + len(marker)])
                del self._buf[: i + len(marker)]
                return out
            if len(self._buf) >= limit:
                return None
            start = max(0, len(self._buf) - len(marker) + 1)
            self._fill(min(_FILL, limit - len(self._buf)))

    def _fill(self, most: int) -> None:
        chunk = self._recv(self.sock.recv, most)
        if not chunk:
            raise EOFError("connection closed")
        self._buf += chunk

    def _recv(self, receive: Callable[[Any], Any], arg: Any) -> Any:
        """One recv (or recv_into) within the phase's budget; TimeoutError once it is spent."""
        while True:
            budget = self._budget()
            if budget is not None:
                if budget <= 0:
                    raise TimeoutError(self._stall())
                self._set_timeout(budget)
            started = time.monotonic()
            try:
                got = receive(arg)
            except TimeoutError:
                if budget is None:
                    raise
                self._charge(started, 0)
                continue  # spent, or the socket's timeout was shorter than what is left: see above
            self._charge(started, got if isinstance(got, int) else len(got))
            return got

    def _charge(self, started: float, received: int) -> None:
        if self._phase == _BODY:
            assert self._meter is not None
            self._meter.waited(time.monotonic() - started, received)

    def _budget(self) -> float | None:
        """Seconds the current read may wait for its first byte (None: the socket's timeout)."""
        if self._phase in (_OPEN, _CLOSING):
            return None
        if self._phase in (_IDLE, _HEAD):
            return self._deadline - time.monotonic()
        assert self._meter is not None
        return min(self.limits.idle_timeout, self._meter.time_left())

    def _stall(self) -> str:
        limits = self.limits
        if self._phase == _IDLE:
            return f"no request for {limits.idle_timeout:g} s"
        if self._phase == _HEAD:
            return f"the request head was not complete {limits.head_timeout:g} s after its first byte"
        return (f"the body came slower than {limits.min_body_rate:g} bytes/s (averaged over {limits.body_window:g} s, "
                f"after {limits.body_grace:g} s) or stopped for {limits.idle_timeout:g} s")

    def _set_timeout(self, seconds: float) -> None:
        current = self.sock.gettimeout()
        if current is not None and _TIMEOUT_SLACK * current <= seconds <= 2 * current:
            return  # close enough: a longer wait is cut short by the budget check, a shorter one retried
        self.sock.settimeout(seconds)

    # -- writing --------------------------------------------------------------------------------
    def send_all(self, data: bytes) -> None:
        """Send ``data``; TimeoutError if the peer reads nothing for ``idle_timeout`` s."""
        self._set_timeout(self.limits.idle_timeout)
        self.sock.sendall(data)


def sendfile_all(sock: socket.socket | TlsSocket, fd: int, count: int, timeout: float) -> None:
    """Send ``count`` bytes of ``fd`` from offset 0 with sendfile (the kernel copies them from
    shared memory into the socket); TimeoutError if the peer reads nothing for ``timeout`` s.
    Over TLS, which sendfile would bypass, the bytes are encrypted from a mapping of ``fd``."""
    if isinstance(sock, (TlsSocket, ssl.SSLSocket)):
        _send_mapped(sock, fd, count, timeout)
        return
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


def _send_mapped(sock: socket.socket | TlsSocket, fd: int, count: int, timeout: float) -> None:
    if count == 0:
        return
    mapping = mmap.mmap(fd, count, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
    try:
        sock.settimeout(timeout)  # a TLS socket's timeout bounds each wait for the peer to read
        with memoryview(mapping) as view:
            for offset in range(0, count, TLS_SEND_CHUNK):
                sock.sendall(view[offset : offset + TLS_SEND_CHUNK])
    finally:
        mapping.close()


@dataclass(eq=False)
class Connection:
    sock: socket.socket | TlsSocket
    peer: str  # the source address, the unit of the per-peer limit
    stream: Stream
    reserved: bool  # admitted over the limits: serve only what ``reserve`` is for, then close


class ThreadedServer(ABC):
    """Accepts connections and serves each on its own thread within ``limits`` (see the module
    docstring); subclasses implement ``serve`` and may implement ``refuse``. ``reserve`` slots
    beyond the limits are used only by subclasses that serve reserved connections cheaply."""

    def __init__(self, host: str, port: int, limits: ConnectionLimits | None = None, *, reserve: int = 0) -> None:
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self.address = self._sock.getsockname()[:2]
        self.limits = limits or ConnectionLimits()
        self._reserve = reserve
        self._lock = threading.Lock()
        self._by_peer: dict[str, list[Connection]] = {}  # ordinary connections, oldest first
        self._reserved: list[Connection] = []
        self._by_sock: dict[socket.socket, Connection] = {}
        self._ordinary = 0
        self._stopped = False
        self._tls: ssl.SSLContext | None = None

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Serve TLS with ``context`` (lifl.net.tls.ServerTls.context); call before ``start``."""
        self._tls = context

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name=f"{type(self).__name__}-accept", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._sock.close()

    def connection(self, sock: socket.socket | TlsSocket) -> Connection:
        """The record of a connection being served (its Stream carries the limits)."""
        return self._by_sock[sock]

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, address = self._sock.accept()
            except OSError as e:
                if self._stopped:
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(ACCEPT_BACKOFF)  # out of descriptors or memory: let connections end
                continue
            if self._tls is not None:
                try:  # no I/O yet: the handshake is the connection's thread's
                    sock = TlsSocket(self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False))
                except OSError:  # reset before it could be wrapped
                    sock.close()
                    continue
            conn = self._admit(sock, str(address[0]))
            if conn is None:
                self._refuse(sock)
                continue
            try:
                threading.Thread(target=self._run, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._release(conn)

    def _admit(self, sock: socket.socket | TlsSocket, peer: str) -> Connection | None:
        """Register a new connection, making room over a limit if it can; None: refuse it."""
        limits = self.limits
        with self._lock:
            mine = self._by_peer.get(peer, [])
            reserved = False
            if len(mine) >= limits.max_per_peer:
                room = self._evict_oldest(mine)
            elif self._ordinary >= limits.max_connections:
                room = any(self._evict_oldest(c) for c in sorted(self._by_peer.values(), key=len, reverse=True))
            else:
                room = True
            if not room:
                if len(self._reserved) >= self._reserve and not self._evict_oldest(self._reserved):
                    return None
                reserved = True
            conn = Connection(sock, peer, Stream(sock, limits), reserved)
            if reserved:
                self._reserved.append(conn)
            else:
                self._by_peer.setdefault(peer, []).append(conn)
                self._ordinary += 1
            self._by_sock[sock] = conn
            return conn

    def _evict_oldest(self, candidates: list[Connection]) -> bool:
        """Close the oldest of ``candidates`` that has no request in progress (lock held)."""
        for conn in candidates:
            if conn.stream.evict():
                self._forget(conn)
                return True
        return False

    def _forget(self, conn: Connection) -> None:
        if self._by_sock.pop(conn.sock, None) is None:
            return  # already evicted
        if conn.reserved:
            self._reserved.remove(conn)
            return
        mine = self._by_peer[conn.peer]
        mine.remove(conn)
        if not mine:
            del self._by_peer[conn.peer]
        self._ordinary -= 1

    def _release(self, conn: Connection) -> None:
        with self._lock:  # closing under the lock: an eviction never shuts down a reused descriptor
            self._forget(conn)
            conn.sock.close()

    def _refuse(self, sock: socket.socket | TlsSocket) -> None:
        """Over every limit: answer from the accept loop without waiting, and close (over TLS
        just close: an answer would need a handshake)."""
        try:
            if isinstance(sock, socket.socket):
                sock.setblocking(False)
                self.refuse(sock)
        except OSError:
            pass
        finally:
            sock.close()

    def _run(self, conn: Connection) -> None:
        try:
            if self._tls is None or conn.stream.handshake():
                self.serve(conn.sock)
        finally:
            self._release(conn)

    @abstractmethod
    def serve(self, sock: socket.socket | TlsSocket) -> None:
        """Speak the front end's protocol on one connection until it ends; ``connection(sock)``
        gives its record and Stream (with TLS, ``sock`` is a TlsSocket, its handshake done)."""

    def refuse(self, sock: socket.socket) -> None:
        """Called with a non-blocking socket for a connection over every limit, before it is closed."""
