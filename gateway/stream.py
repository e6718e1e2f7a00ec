"""Socket plumbing shared by the gateway's front ends, served by one event loop
(``lifl.net.loop.Loop``): a listener, and connections that are state machines instead of
threads.

A ``Conn`` reads without blocking: small reads (request heads, frame headers) go through a
read-ahead buffer of at most ``READ_AHEAD`` bytes at a time, while bulk reads land directly in
the caller's memory (``read_into``: a shared-memory object) with no intermediate copy. It
writes without blocking too: gather lists with one ``sendmsg``, files (shared-memory objects)
with ``sendfile``; what the socket does not take waits until it is writable, and a callback
queued behind the bytes (``write(..., then=...)``) runs once they are sent. Its protocol (the
HTTP or gRPC front end) is told when it is ``readable``, and it raises ``Wait`` when it needs
bytes that have not come, or ``PeerGone`` when the peer went away.

A few connections must not deny service to the rest, so everything a peer can hold is
bounded (``lifl.net.limits.ConnectionLimits``; the gateway's command-line flags set them):

- time: a connection waiting for its next request is closed after ``idle_timeout``; a
  request head must be complete ``head_timeout`` after its first byte; a body must keep up
  ``min_body_rate`` (after ``body_grace``, averaged over ``body_window``: see RateMeter), or
  have a byte at least every ``idle_timeout``; a peer that reads nothing of what is sent to it
  for ``idle_timeout`` is cut off. Deadlines are checked every ``TIMER_RESOLUTION`` seconds by
  one timer per server, not one per connection; a stalled request is its protocol's to answer
  (``expired``), so the front end can abort what the peer held (an upload's round slot).
  Time the gateway spends on a request (the agent, Redis) is never charged to its peer.
- connections: at most ``max_connections`` in all and ``max_per_peer`` from one address.
  Over a limit, a new connection displaces the oldest one that is only waiting for (or still
  sending) a request head, the peer's own first; failing that it may take one of a few
  reserved slots, on which the front end answers only cheap requests (HTTP health checks),
  so those keep working while the limits are full. Anything else is refused at once, by the
  accept handler (``refuse``).
- memory: reads allocate as bytes arrive, never what the peer announces.

With TLS (``LoopServer.use_tls``) each connection's handshake runs on the loop too (the ssl
module's non-blocking mode: ``SSLWantReadError`` and ``SSLWantWriteError`` say what to wait
for), within ``head_timeout`` and evictable like a connection waiting for its head; one that
fails (an untrusted client certificate, an old protocol version, plain text) ends that
connection alone. Records are decrypted by ``recv_into`` straight into the caller's memory,
as over plain TCP; writes are encrypted from the caller's memory (a gather list is joined into
records of up to ``lifl.net.io.TLS_GATHER`` bytes, and a file is mapped and encrypted from the
mapping: ``sendfile`` would bypass TLS).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import socket
import ssl
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lifl.net.io import TLS_GATHER
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import Loop

LISTEN_BACKLOG = 1024
ACCEPT_BACKOFF = 0.05  # s to stop accepting when the process is out of file descriptors
ACCEPTS_PER_WAKE = 64  # connections accepted per readiness of the listener before other work gets a turn
READ_AHEAD = 4096  # bytes one small read asks for: most of a body behind a head is then read straight into its destination
TIMER_RESOLUTION = 0.1  # s between two checks of the connections' deadlines
LINGER_SECONDS = 2.0  # after a last response, how long the client's remaining bytes are read and dropped
MAX_GATHER = 64  # buffers in one sendmsg (well within IOV_MAX, 1024)
LOOP_STOP_TIMEOUT = 10.0  # s a stopping server waits for the loop it started to end
TLS_WRITE = 256 << 10  # plaintext bytes encrypted per TLS write call

# What a connection is doing, which decides its deadline and whether it may be evicted.
OPEN = "open"  # the protocol keeps its own time (gRPC): see Protocol.check
HANDSHAKE = "handshake"  # TLS, before anything else: within head_timeout
IDLE = "idle"  # waiting for the first byte of a request: idle_timeout
HEAD = "head"  # the rest of the head, within head_timeout of its first byte
BODY = "body"  # a body, at the minimum rate
BUSY = "busy"  # a request is being served: nothing is read, no deadline but a stalled write's
CLOSING = "closing"  # the last response is sent; only the peer's last bytes are still read
EVICTABLE = frozenset({HANDSHAKE, IDLE, HEAD, CLOSING})  # no request in progress


class Wait(Exception):
    """What is asked for has not come yet: the connection's protocol is called again when the
    socket is readable. Not an OSError, so that handlers of a call's own errors let it pass."""


class PeerGone(Exception):
    """The peer closed the connection (``eof``) or the socket failed."""

    def __init__(self, message: str, *, eof: bool = False) -> None:
        super().__init__(message)
        self.eof = eof


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


class ConnectionProtocol:
    """What a front end implements for each of its connections (``conn``); the defaults suit
    a protocol with no deadlines of its own and nothing to give back."""

    conn: Conn

    def readable(self) -> None:
        """Bytes (or the end) may be there: read what the protocol's state wants."""
        raise NotImplementedError

    def expired(self, phase: str) -> None:
        """The deadline of ``phase`` (HEAD or BODY) passed: answer, and close."""
        self.conn.close()

    def check(self, now: float) -> None:
        """In phase OPEN, every TIMER_RESOLUTION seconds: the protocol's own deadlines."""

    def closed(self) -> None:
        """The connection is closed: give back what its requests held."""


class _File:
    """A file to send (a shared-memory object): the bytes of ``fd`` from ``offset`` (which moves
    as they are sent) up to ``end``."""

    __slots__ = ("fd", "offset", "end")

    def __init__(self, fd: int, offset: int, end: int) -> None:
        self.fd, self.offset, self.end = fd, offset, end


class _Then:
    """A callback queued behind bytes: it runs once they are sent."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class Conn:
    """One accepted connection (see the module docstring). Everything runs on the loop."""

    def __init__(self, server: LoopServer, sock: socket.socket, peer: str, reserved: bool) -> None:
        self.server = server
        self.loop = server.loop
        self.limits = server.limits
        self.sock = sock  # socket.socket or ssl.SSLSocket, non-blocking
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.peer = peer  # the source address, the unit of the per-peer limit
        self.reserved = reserved  # admitted over the limits: serve only what the reserve is for, then close
        self.peer_certificate: dict[str, Any] | None = None  # a verified TLS client certificate (getpeercert())
        self.protocol: ConnectionProtocol | None = None
        self.inbuf = bytearray()  # bytes read ahead, not taken yet
        self.closed = False
        self.phase = OPEN
        self._since = time.monotonic()  # when the phase's clock started
        self.last_byte = self._since  # when a byte last arrived
        self._meter: RateMeter | None = None
        self._waiting_since: float | None = None  # in BODY: when the current wait for bytes began
        self._charged = 0.0  # in BODY: up to when waiting has been charged to the meter
        self._reading = False  # the protocol wants readable()
        self._read_watch = False  # the loop watches for readability (it may while not _reading: see pause_reading)
        self._read_wants_write = False  # TLS: a read must wait for the socket to be writable
        self._watched = (False, False)
        self._out: deque[memoryview | _File | _Then] = deque()
        self._out_bytes = 0  # bytes queued (files counted too)
        self._tls_pending: memoryview | None = None  # TLS: a record being written, retried as it is
        self._write_progress = self._since  # when the peer last took bytes (or the queue last started)
        self._close_by = 0.0  # in CLOSING: when the connection is closed at the latest

    # -- phases ---------------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._since = time.monotonic()
        self._waiting_since = None
        if phase == BODY:
            limits = self.limits
            self._meter = RateMeter(limits.min_body_rate, limits.body_grace, limits.body_window)
            self._charged = self._since

    def evict(self) -> bool:
        """Close the connection if it has no request in progress (see ``EVICTABLE``)."""
        if self.phase not in EVICTABLE or self.closed:
            return False
        self.close()
        return True

    def check(self, now: float) -> None:
        """The deadlines of the current phase (the server calls it every TIMER_RESOLUTION s)."""
        limits = self.limits
        if (self._out or self._tls_pending is not None) and now - self._write_progress >= limits.idle_timeout:
            self.close()  # the peer has read nothing for idle_timeout
            return
        phase = self.phase
        if phase == IDLE:
            if now - self._since >= limits.idle_timeout:
                self.close()
        elif phase in (HANDSHAKE, HEAD):
            if now - self._since >= limits.head_timeout:
                if phase == HANDSHAKE or self.protocol is None:
                    self.close()
                else:
                    self.protocol.expired(phase)
        elif phase == BODY:
            if self._waiting_since is None:
                return  # reading, or paused while the gateway works: not the peer's time
            assert self._meter is not None
            self._meter.waited(now - self._charged, 0)
            self._charged = now
            if self._meter.time_left() <= 0 or now - self._waiting_since >= limits.idle_timeout:
                assert self.protocol is not None
                self.protocol.expired(BODY)
        elif phase == CLOSING:
            if now >= self._close_by:
                self.close()
        elif phase == OPEN and self.protocol is not None:
            self.protocol.check(now)

    def stall_message(self) -> str:
        """Why the current phase's deadline passed (for a 408 or a GOAWAY)."""
        limits = self.limits
        if self.phase == HEAD:
            return f"the request head was not complete {limits.head_timeout:g} s after its first byte"
        return (f"the body came slower than {limits.min_body_rate:g} bytes/s (averaged over {limits.body_window:g} s, "
                f"after {limits.body_grace:g} s) or stopped for {limits.idle_timeout:g} s")

    # -- reading --------------------------------------------------------------------------------
    def start_reading(self, *, at_once: bool = False) -> None:
        """Have the protocol's ``readable`` called whenever bytes come, from now on; soon in any
        case if ``at_once`` (the protocol has work that needs no byte), or if some may be waiting
        already (in the read-ahead buffer, or decrypted in TLS's: epoll sees neither)."""
        self._reading = True
        if not self._read_watch:
            self._read_watch = True
            self._rewatch()
        if at_once or self.inbuf or (self.tls and self.sock.pending()):  # type: ignore[attr-defined]
            self.loop.post(self._readable)

    def read_now(self) -> None:
        """``start_reading``, and call the protocol's ``readable`` now rather than on a later turn
        of the loop (for a protocol whose state allows it to run inside its own callbacks)."""
        self.start_reading()
        self._readable()

    def pause_reading(self) -> None:
        """Read nothing until ``start_reading``: the gateway is busy with what came (its time is
        not charged to the peer). The loop stops watching the socket only if it becomes readable
        meanwhile (most pauses end before: a change of what epoll watches is a system call)."""
        self._reading = False
        self._stop_waiting()

    def fill(self, most: int = READ_AHEAD) -> int:
        """Read up to ``most`` more bytes into ``inbuf``; how many came (at least one). Wait if
        none are there; PeerGone at the end."""
        data = self._recv(self.sock.recv, most)
        self.inbuf += data
        return len(data)

    def read_into(self, view: memoryview) -> int:
        """Read up to len(view) bytes into ``view``, from the read-ahead buffer first, else
        straight from the socket (TLS: decrypted into it); at least one. Wait, or PeerGone."""
        buffered = len(self.inbuf)
        if buffered:
            n = min(len(view), buffered)
            view[:n] = self.inbuf[:n]
            del self.inbuf[:n]
            return n
        return self._recv(self.sock.recv_into, view)

    def _recv(self, receive: Callable[[Any], Any], arg: Any) -> Any:
        """One non-blocking recv (or recv_into): what it got, at least a byte; Wait or PeerGone."""
        try:
            got = receive(arg)
        except (BlockingIOError, ssl.SSLWantReadError):
            self._must_wait()
        except ssl.SSLWantWriteError:
            self._must_wait(write=True)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            raise PeerGone("connection closed", eof=True) from None
        except OSError as e:
            raise PeerGone(str(e)) from None
        n = got if isinstance(got, int) else len(got)
        if n == 0:
            raise PeerGone("connection closed", eof=True)
        self._received(n)
        return got

    def take(self, n: int) -> bytes:
        """The first ``n`` bytes of the read-ahead buffer (which has them)."""
        out = bytes(self.inbuf[:n])
        del self.inbuf[:n]
        return out

    def _must_wait(self, *, write: bool = False) -> None:
        self._read_wants_write = write
        if self.phase == BODY and self._waiting_since is None:
            self._waiting_since = self._charged = time.monotonic()  # what came before was not waiting
        if write:
            self._rewatch()
        raise Wait

    def _received(self, n: int) -> None:
        now = time.monotonic()
        self.last_byte = now
        if self.phase == BODY:
            assert self._meter is not None
            self._meter.waited(now - self._charged if self._waiting_since is not None else 0.0, n)
            self._charged = now
            self._waiting_since = None

    def _stop_waiting(self) -> None:
        if self.phase == BODY and self._waiting_since is not None:
            assert self._meter is not None
            now = time.monotonic()
            self._meter.waited(now - self._charged, 0)
            self._charged = now
        self._waiting_since = None

    def _readable(self) -> None:
        if self.closed:
            return
        if not self._reading:
            if self._read_watch:  # bytes came while paused: stop watching until start_reading
                self._read_watch = False
                self._rewatch()
            return
        self._read_wants_write = False
        if self.protocol is not None:
            self.protocol.readable()
        elif self.phase == HANDSHAKE:
            self.server.handshake(self)

    # -- writing ----------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Bytes waiting to be written."""
        return self._out_bytes

    def write(self, parts: Sequence[bytes | bytearray | memoryview], then: Callable[[], None] | None = None) -> None:
        """Send ``parts`` (views of them are kept until they are sent: the caller must not change
        them), then call ``then`` once they are."""
        self._starting_to_write()
        for part in parts:
            if len(part):
                view = part if isinstance(part, memoryview) else memoryview(part)
                self._out.append(view)
                self._out_bytes += len(view)
        if then is not None:
            self._out.append(_Then(then))
        self.flush()

    def sendfile(self, fd: int, count: int, then: Callable[[], None] | None = None, *, offset: int = 0) -> None:
        """Send ``count`` bytes of ``fd`` from ``offset`` (the kernel copies them from shared memory
        into the socket; over TLS they are encrypted from a mapping of ``fd``). ``fd`` stays the
        caller's: it must stay open until ``then`` runs or the connection closes."""
        self._starting_to_write()
        if count:
            self._out.append(_File(fd, offset, offset + count))
            self._out_bytes += count
        if then is not None:
            self._out.append(_Then(then))
        self.flush()

    def _starting_to_write(self) -> None:
        """The peer's time to take what is queued starts now if nothing was queued."""
        if not self._out and self._tls_pending is None:
            self._write_progress = time.monotonic()

    def flush(self) -> None:
        """Write what the socket takes now; wait for it to be writable for the rest."""
        if self.closed:
            return
        try:
            while self._out or self._tls_pending is not None:
                if self._tls_pending is None:
                    head = self._out[0]
                    if isinstance(head, _Then):
                        self._out.popleft()
                        head.fn()
                        if self.closed:
                            return
                        continue
                    if isinstance(head, _File):
                        if self.tls:
                            self._map_file(head)
                            continue
                        if not self._sendfile(head):
                            break
                        continue
                if self.tls:
                    if not self._tls_write():
                        break
                elif not self._sendmsg():
                    break
        except OSError:
            self.close()  # the peer went away: its protocol learns it in closed()
            return
        self._rewatch()

    def _sendmsg(self) -> bool:
        views: list[memoryview] = []
        for item in self._out:
            if not isinstance(item, memoryview) or len(views) == MAX_GATHER:
                break
            views.append(item)
        try:
            sent = self.sock.sendmsg(views)
        except BlockingIOError:
            return False
        self._sent(sent)
        while sent:
            head = self._out[0]
            assert isinstance(head, memoryview)
            if sent >= len(head):
                sent -= len(head)
                self._out.popleft()
            else:
                self._out[0] = head[sent:]
                sent = 0
        return True

    def _sendfile(self, item: _File) -> bool:
        try:
            sent = os.sendfile(self.sock.fileno(), item.fd, item.offset, item.end - item.offset)
        except BlockingIOError:
            return False
        if sent == 0:
            raise ConnectionError(f"the object ended at byte {item.offset}, before {item.end}")
        self._sent(sent)
        item.offset += sent
        if item.offset == item.end:
            self._out.popleft()
        return True

    def _map_file(self, item: _File) -> None:
        """TLS: replace a file by views of its mapping (closed once they are sent); the mapping
        starts at the page of ``offset``, so a range near the end maps little."""
        self._out.popleft()
        start = item.offset - item.offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(item.fd, item.end - start, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ, offset=start)
        view = memoryview(mapping)
        parts: list[memoryview | _Then] = [view[i : i + TLS_WRITE] for i in range(item.offset - start, item.end - start, TLS_WRITE)]

        def unmap() -> None:
            try:
                view.release()
                mapping.close()
            except BufferError:  # a view of it is still referenced somewhere: the collector closes it
                pass

        parts.append(_Then(unmap))
        self._out.extendleft(reversed(parts))

    def _tls_write(self) -> bool:
        """Encrypt and write one record's worth; a write that must wait is retried with the very
        same bytes (OpenSSL's rule)."""
        if self._tls_pending is None:
            head = self._out.popleft()
            assert isinstance(head, memoryview)
            if len(head) < TLS_GATHER and self._out and isinstance(self._out[0], memoryview):
                joined = bytearray(head)  # small parts (frame headers) travel together, one record
                while self._out and isinstance(self._out[0], memoryview) and len(joined) < TLS_GATHER:
                    joined += self._out.popleft()
                head = memoryview(joined)
            elif len(head) > TLS_WRITE:
                self._out.appendleft(head[TLS_WRITE:])
                head = head[:TLS_WRITE]
            self._tls_pending = head
        try:
            sent = self.sock.send(self._tls_pending)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return False
        self._sent(sent)
        rest = self._tls_pending[sent:]
        self._tls_pending = rest if len(rest) else None
        return True

    def _sent(self, n: int) -> None:
        self._out_bytes -= n
        self._write_progress = time.monotonic()

    def _writable(self) -> None:
        if self._read_wants_write:
            self._read_wants_write = False
            self._readable()
        self.flush()

    def _rewatch(self) -> None:
        if self.closed:
            return
        writing = bool(self._out) or self._tls_pending is not None or self._read_wants_write
        wanted = (self._read_watch, writing)
        if wanted != self._watched:
            self._watched = wanted
            self.loop.watch(self.sock, self._readable if wanted[0] else None, self._writable if wanted[1] else None)

    # -- the end ---------------------------------------------------------------------------------
    def linger(self) -> None:
        """The last response is sent: half-close, and read (and drop) what the client still sends
        for up to LINGER_SECONDS, so that it sees our response and not a reset."""
        if self.closed:
            return
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_WR)  # TCP's own (no TLS close_notify)
        except OSError:
            self.close()
            return
        self.set_phase(CLOSING)
        self._close_by = self._since + LINGER_SECONDS
        self.protocol = _Discard(self)
        self.start_reading()

    def linger_when_sent(self, timeout: float) -> None:
        """Linger once what is queued is sent (closing after ``timeout`` s at the latest): a
        peer that still sends sees our last frames and a FIN, not a reset that may discard them."""
        if self.closed:
            return
        self.pause_reading()
        self.set_phase(CLOSING)
        self._close_by = self._since + timeout
        self.write([], then=self.linger)

    def close(self) -> None:
        """Close now (what is queued is dropped); the protocol gives back what its requests held."""
        if not self.closed:
            self.closed = True
            self._release()

    def _release(self) -> None:
        self.loop.unwatch(self.sock)
        with contextlib.suppress(OSError):
            self.sock.close()
        self._out.clear()
        self._tls_pending = None
        self.server.forget(self)
        if self.protocol is not None:
            try:
                self.protocol.closed()
            except Exception:  # a bug: the rest of the loop's work must go on
                traceback.print_exc()


class _Discard(ConnectionProtocol):
    """A lingering connection's protocol: the peer's last bytes are read and dropped."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    def readable(self) -> None:
        conn = self.conn
        try:
            while socket.socket.recv(conn.sock, 1 << 16):  # raw: TLS records are dropped unread
                pass
        except BlockingIOError:
            return
        except OSError:
            pass
        conn.close()


class LoopServer(ABC):
    """Accepts connections and serves them all from ``loop`` within ``limits`` (see the module
    docstring); subclasses make each connection's protocol (``protocol``) and may implement
    ``refuse``. ``reserve`` slots beyond the limits are used only by subclasses that serve
    reserved connections cheaply."""

    def __init__(self, loop: Loop, host: str, port: int, limits: ConnectionLimits | None = None, *, reserve: int = 0) -> None:
        self.loop = loop
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self._sock.setblocking(False)
        self.address = self._sock.getsockname()[:2]
        self.limits = limits or ConnectionLimits()
        self._reserve = reserve
        self._by_peer: dict[str, list[Conn]] = {}  # ordinary connections, oldest first
        self._reserved: list[Conn] = []
        self._ordinary = 0
        self._tls: ssl.SSLContext | None = None
        self._sweeper: Any = None
        self._stopped = False
        self._loop_thread: threading.Thread | None = None  # the loop's, if this server started it

    def use_tls(self, context: ssl.SSLContext) -> None:
        """Serve TLS with ``context`` (lifl.net.tls.ServerTls.context); call before ``start``."""
        self._tls = context

    @property
    def connections(self) -> int:
        """Connections open now (reserved ones included)."""
        return self._ordinary + len(self._reserved)

    def start(self) -> None:
        """Listen. The loop is started if nothing started it yet (with its pools' threads): then
        it is this server's, and ``stop`` ends it."""
        if self.loop.running:
            self.loop.call(self._listen)
            return
        self._listen()
        self.loop.start_pools()
        self._loop_thread = self.loop.start()

    def stop(self) -> None:
        """Stop listening and close every connection (what their requests held is given back);
        then end the loop and its pools if this server started them."""
        if self.loop.running and not self.loop.in_loop():
            self.loop.call(self._shut)
        else:
            self._shut()
        if self._loop_thread is not None:
            self.loop.stop()
            self._loop_thread.join(LOOP_STOP_TIMEOUT)
            self.loop.close()
            self._loop_thread = None

    def _listen(self) -> None:
        self.loop.watch(self._sock, self._accept)
        self._sweeper = self.loop.every(f"{type(self).__name__} deadlines", TIMER_RESOLUTION, self._sweep)

    def _shut(self) -> None:
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.loop.unwatch(self._sock)
        self._sock.close()
        for conn in [*self._reserved, *(c for conns in self._by_peer.values() for c in conns)]:
            conn.close()

    # -- accepting --------------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, address = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if self._stopped:
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting()  # out of descriptors or memory: let connections end
                    return
                continue  # the peer reset it before we took it
            sock.setblocking(False)
            if self._tls is not None:
                try:  # no I/O yet: the handshake is the loop's, in turns
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except OSError:
                    sock.close()
                    continue
            conn = self._admit(sock, str(address[0]))
            if conn is None:
                self._refuse(sock)
                continue
            self._serve(conn)

    def _pause_accepting(self) -> None:
        self.loop.unwatch(self._sock)

        def resume() -> None:
            if not self._stopped:
                self.loop.watch(self._sock, self._accept)

        self.loop.later(ACCEPT_BACKOFF, resume)

    def _admit(self, sock: socket.socket, peer: str) -> Conn | None:
        """Register a new connection, making room over a limit if it can; None: refuse it."""
        limits = self.limits
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
        conn = Conn(self, sock, peer, reserved)
        if reserved:
            self._reserved.append(conn)
        else:
            self._by_peer.setdefault(peer, []).append(conn)
            self._ordinary += 1
        return conn

    @staticmethod
    def _evict_oldest(candidates: list[Conn]) -> bool:
        """Close the oldest of ``candidates`` that has no request in progress."""
        return any(conn.evict() for conn in list(candidates))

    def forget(self, conn: Conn) -> None:
        """A connection closed (Conn.close calls it)."""
        if conn.reserved:
            if conn in self._reserved:
                self._reserved.remove(conn)
            return
        mine = self._by_peer.get(conn.peer)
        if mine is None or conn not in mine:
            return
        mine.remove(conn)
        if not mine:
            del self._by_peer[conn.peer]
        self._ordinary -= 1

    def _refuse(self, sock: socket.socket) -> None:
        """Over every limit: answer without waiting, and close (over TLS just close: an answer
        would need a handshake)."""
        try:
            if not isinstance(sock, ssl.SSLSocket):
                self.refuse(sock)
        except OSError:
            pass
        finally:
            sock.close()

    def _serve(self, conn: Conn) -> None:
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if conn.tls:
            conn.set_phase(HANDSHAKE)
            conn.start_reading()  # handshake() runs when the client's hello comes
            return
        self._open(conn)

    def handshake(self, conn: Conn) -> None:
        """One step of a TLS handshake (its connection was readable, or writable as OpenSSL asked)."""
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            return
        except ssl.SSLWantWriteError:
            conn._read_wants_write = True
            conn._rewatch()
            return
        except (OSError, ValueError):  # ssl.SSLError is an OSError: a failed handshake ends its connection alone
            conn.close()
            return
        conn.peer_certificate = conn.sock.getpeercert() or None  # type: ignore[attr-defined]  # {}: not verified
        conn.set_phase(OPEN)
        self._open(conn)

    def _open(self, conn: Conn) -> None:
        try:
            conn.protocol = self.protocol(conn)
        except Exception:
            traceback.print_exc()
            conn.close()

    def _sweep(self) -> None:
        now = time.monotonic()
        for conns in [self._reserved, *self._by_peer.values()]:
            for conn in list(conns):
                if not conn.closed:
                    try:
                        conn.check(now)
                    except Exception:  # a bug in one connection's protocol: close it, go on
                        print("lifl gateway: checking a connection's deadlines failed", file=sys.stderr)
                        traceback.print_exc()
                        conn.close()

    @abstractmethod
    def protocol(self, conn: Conn) -> ConnectionProtocol:
        """The protocol that serves ``conn`` from now on (its handshake done, if TLS); it starts
        reading (``conn.start_reading``) when it is ready to."""

    def refuse(self, sock: socket.socket) -> None:
        """Called with a non-blocking socket for a connection over every limit, before it is closed."""
