"""Redis from an event loop (``lifl.net.loop``): commands written to one non-blocking connection,
replies parsed by hiredis as they arrive and handed to each command's callback, in order.

Why not redis-py here: a blocking call has to run on a pool thread, and its client costs about
as much Python per call as everything else a batch of uploads does at the node; this costs a
``pack_command`` and a callback. Redis answers a connection's commands in the order it got them,
so any number may be in flight: the pending callbacks are a queue.

Failures: a connection that breaks, or a command not answered within ``timeout`` (a frozen
server), fails every pending command with ``ConnectionError`` (the caller decides what that
means: the answer is unknown) and closes; the next command connects again. Until Redis answers
again, commands fail at once but for one probe now and then (``Outage``, which the blocking
clients of ``lifl.state`` share). A script the server does not have (it restarted) is loaded
once and its call sent again.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis

Done = Callable[[Any, BaseException | None], None]
RECEIVE_BYTES = 1 << 16
PROBE_EVERY_S = 0.25  # while Redis is known to be down, one call this often finds out whether it is back


class Outage:
    """Redis known to be unreachable or frozen: calls fail at once instead of each waiting out
    its timeout (a pool of blocked threads would hold every later request for longer), and one
    call per PROBE_EVERY_S goes through to find out whether it is back. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._down = False
        self._next_probe = 0.0

    def admits(self) -> bool:
        """Whether a call may go to Redis now (always, unless it is known to be down)."""
        if not self._down:  # the common case, without the lock (a bool is read atomically)
            return True
        with self._lock:
            now = self._clock()
            if not self._down:
                return True
            if now < self._next_probe:
                return False
            self._next_probe = now + PROBE_EVERY_S
            return True

    def failed(self) -> None:
        """A call found Redis unreachable or got no answer in time."""
        with self._lock:
            self._down = True
            self._next_probe = self._clock() + PROBE_EVERY_S

    def answered(self) -> None:
        if self._down:
            with self._lock:
                self._down = False


class Resp:
    def __init__(self, loop: Any, url: str, timeout: float) -> None:
        self.loop = loop
        self.url = url
        self.timeout = timeout  # seconds a command may wait for its answer
        self.outage = Outage()
        self._sock: socket.socket | None = None
        self._reader = hiredis.Reader()
        self._pending: deque[tuple[Done, float]] = deque()  # callbacks, and when their command was sent
        self._out = bytearray()
        self._timer: Any = None
        self._connecting = False  # a TCP connection not known to be established yet

    # -- commands --------------------------------------------------------------------------------
    def command(self, args: Sequence[Any], done: Done) -> None:
        """Send ``args`` (a Redis command); ``done(reply, None)`` or ``done(None, error)`` on the loop.
        An error Redis answers with is a ``hiredis.ReplyError``; a failed connection, ``ConnectionError``."""
        if not self.outage.admits():
            self._refuse(done, ConnectionError(f"Redis at {self.url} did not answer the last command"))
            return
        try:
            self._connected()
        except OSError as e:
            self.outage.failed()
            self._refuse(done, ConnectionError(f"Redis at {self.url} is unreachable: {e}"))
            return
        self._send(args, done)

    def _refuse(self, done: Done, error: BaseException) -> None:
        """A command fails from the loop, never from inside ``command`` (a send may fail at once):
        its caller may not have finished recording it yet."""
        self.loop.post(lambda: done(None, error))

    def script(self, sha: str, text: str, keys: Sequence[str], args: Sequence[Any], done: Done) -> None:
        """Run the script ``text`` by its SHA-1 (EVALSHA; loaded first if the server does not have it)."""
        call = ("EVALSHA", sha, len(keys), *keys, *args)

        def loaded(_: Any, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
            else:
                self.command(call, done)

        def answered(reply: Any, error: BaseException | None) -> None:
            if isinstance(error, hiredis.ReplyError) and str(error).startswith("NOSCRIPT"):
                self.command(("SCRIPT", "LOAD", text), loaded)
            else:
                done(reply, error)

        self.command(call, answered)

    def close(self) -> None:
        self._fail(ConnectionError("the connection to Redis was closed"))

    # -- the connection --------------------------------------------------------------------------
    def _connected(self) -> None:
        """Connect if not connected: a unix socket at once, TCP without waiting (what is sent
        meanwhile waits for the connection; its failure fails it)."""
        if self._sock is not None:
            return
        parts = urlsplit(self.url)
        query = parse_qs(parts.query)
        if parts.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(parts.path)
            sock.setblocking(False)
            db = query.get("db", ["0"])[0]
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex((parts.hostname or "localhost", parts.port or 6379))  # EINPROGRESS: writable when done
            self._connecting = True
            db = (parts.path or "/0").lstrip("/") or query.get("db", ["0"])[0]
        self._sock, self._reader = sock, hiredis.Reader()
        self.loop.watch(sock, self._readable, self._write)
        if parts.password:
            auth = (unquote(parts.username), unquote(parts.password)) if parts.username else (unquote(parts.password),)
            self._send(("AUTH", *auth), self._setup_answer)
        if db not in ("", "0"):
            self._send(("SELECT", db), self._setup_answer)

    def _setup_answer(self, reply: Any, error: BaseException | None) -> None:
        if error is not None or isinstance(reply, hiredis.ReplyError):
            self._fail(ConnectionError(f"Redis at {self.url} refused the connection's setup: {error or reply}"))

    def _send(self, args: Sequence[Any], done: Done) -> None:
        self._pending.append((done, time.monotonic()))
        self._out += hiredis.pack_command(tuple(args))
        self._write()
        if self._timer is None:
            self._timer = self.loop.later(self.timeout, self._check_timeout)

    def _write(self) -> None:
        if self._sock is None:
            return
        if self._connecting:
            error = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                self._fail(ConnectionError(f"Redis at {self.url} is unreachable: {os.strerror(error)}"))
                return
            self._connecting = False
        try:
            sent = self._sock.send(self._out)
            del self._out[:sent]
        except BlockingIOError:
            pass
        except OSError as e:
            self._fail(ConnectionError(f"Redis connection failed: {e}"))
            return
        self.loop.watch(self._sock, self._readable, self._write if self._out else None)

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(RECEIVE_BYTES)
        except BlockingIOError:
            return
        except OSError as e:
            self._fail(ConnectionError(f"Redis connection failed: {e}"))
            return
        if not data:
            self._fail(ConnectionError("Redis closed the connection"))
            return
        self._reader.feed(data)
        while self._pending:
            reply = self._reader.gets()
            if reply is False:
                break
            done, _ = self._pending.popleft()
            self.outage.answered()
            if isinstance(reply, hiredis.ReplyError):
                done(None, reply)
            else:
                done(reply, None)

    def _check_timeout(self) -> None:
        self._timer = None
        if not self._pending:
            return
        waited = time.monotonic() - self._pending[0][1]
        if waited >= self.timeout:
            self._fail(ConnectionError(f"Redis did not answer within {self.timeout:g} s"))
            return
        self._timer = self.loop.later(self.timeout - waited, self._check_timeout)

    def _fail(self, error: BaseException) -> None:
        """Every pending command fails (its outcome is unknown) and the connection closes."""
        self.outage.failed()
        if self._sock is not None:
            self.loop.unwatch(self._sock)
            self._sock.close()
            self._sock, self._connecting = None, False
        self._out.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, deque()
        for done, _ in pending:
            self._refuse(done, error)
