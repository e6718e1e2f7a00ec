"""The agent's control connections: typed messages (``lifl.protocol``) framed as JSON over unix
stream sockets, with file descriptors (shared-memory objects) passed alongside via SCM_RIGHTS.

A request is ``{"id": n, "op": ..., ...}``; its reply is ``{"id": n, "ok": true, "op": ...}``
or ``{"id": n, "ok": false, "error": {...}}``, which the caller gets back as the same
``LiflError`` subclass. Messages without an id are pushes (the agent invoking an instance).

Two ends: ``Connection`` and ``Client`` block (a function instance, tests, tools);
``MessageStream`` is served by an event loop (``lifl.net.loop``): frames are handed over as
they arrive, and what is sent in one turn of the loop goes out in one ``sendmsg``, so a burst
of requests and replies costs a system call, not one each. A reply's order on the wire is its
request's, so a peer may keep many requests in flight on one connection.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import orjson

from lifl import errors
from lifl.protocol import Message, decode

_LEN = struct.Struct("<I")
MAX_MESSAGE = 16 << 20
MAX_FDS = 253  # SCM_RIGHTS carries at most this many descriptors in one message (the kernel's SCM_MAX_FD)
RECEIVE_BYTES = 1 << 18


def encode_frame(message: dict[str, Any], nfds: int) -> bytes:
    # orjson: a tenth of the json module's time, on a path every update takes several times
    body = orjson.dumps({**message, "nfds": nfds} if nfds else message, option=orjson.OPT_NON_STR_KEYS)
    return _LEN.pack(len(body)) + body


def next_frame(buf: bytearray, fds: deque[int]) -> tuple[dict[str, Any], list[int]] | None:
    """Take the first whole frame of ``buf`` (and its descriptors from ``fds``); None until one is in."""
    if len(buf) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(buf)
    if n > MAX_MESSAGE:
        raise errors.BadRequest(f"control message of {n} bytes is too large")
    if len(buf) < _LEN.size + n:
        return None
    body = bytes(buf[_LEN.size : _LEN.size + n])
    del buf[: _LEN.size + n]
    try:
        message = orjson.loads(body)
    except ValueError:
        raise errors.BadRequest("control message is not JSON", code="bad_message") from None
    if not isinstance(message, dict):
        raise errors.BadRequest("control message is not a JSON object", code="bad_message")
    wanted = message.pop("nfds", 0)
    if not isinstance(wanted, int) or not 0 <= wanted <= len(fds):
        raise errors.BadRequest(f"control message claims {wanted!r} descriptors, {len(fds)} came", code="bad_message")
    return message, [fds.popleft() for _ in range(wanted)]


class Connection:
    """One end of a message connection; ``send`` is thread-safe, ``recv`` is not."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = encode_frame(message, len(fds))
        with self._send_lock:
            if fds:
                sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                data = data[sent:]
            if data:
                self.sock.sendall(data)

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and the fds that came with it; EOFError once the peer is gone."""
        while True:
            frame = next_frame(self._buf, self._fds)
            if frame is not None:
                return frame
            data, fds, _, _ = socket.recv_fds(self.sock, RECEIVE_BYTES, MAX_FDS)
            if not data:
                for fd in self._fds:
                    _close(fd)
                raise EOFError("connection closed")
            self._buf += data
            self._fds.extend(fds)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def reply_frame(request_id: Any, reply: Message) -> dict[str, Any]:
    return {"id": request_id, "ok": True, **reply.encode()}


def error_reply(request_id: Any, error: errors.LiflError) -> dict[str, Any]:
    return {
        "id": request_id,
        "ok": False,
        "error": {
            "type": type(error).__name__,
            "code": error.code,
            "message": error.message,
            "retry_after": error.retry_after,
            "extra": error.extra,
        },
    }


def raise_error(reply: dict[str, Any]) -> None:
    info = reply["error"]
    cls = getattr(errors, info["type"], errors.Internal)
    if not (isinstance(cls, type) and issubclass(cls, errors.LiflError)):
        cls = errors.Internal
    if issubclass(cls, errors.RetryLater):
        raise cls(info["message"], retry_after=info.get("retry_after") or 1.0, code=info["code"], extra=info.get("extra"))
    raise cls(info["message"], code=info["code"], extra=info.get("extra"))


class Client:
    """Request/reply over a Connection; pushes that arrive meanwhile are queued for ``next_push``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._next_id = 0
        self._lock = threading.Lock()
        self.pushes: deque[tuple[Message, list[int]]] = deque()

    @classmethod
    def connect(cls, path: str, hello: Message) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        client = cls(Connection(sock))
        client.call(hello)
        return client

    def call(self, request: Message, fds: Sequence[int] = ()) -> tuple[Any, list[int]]:
        """Send ``request`` and wait for its reply (of type ``request.reply``) and descriptors."""
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            self.conn.send({"id": request_id, **request.encode()}, fds)
            while True:
                frame, got = self.conn.recv()
                if frame.get("id") == request_id:
                    break
                self.pushes.append((decode(frame), got))
        if not frame.get("ok"):
            for fd in got:
                _close(fd)
            raise_error(frame)
        frame.pop("id")
        frame.pop("ok")
        reply = decode(frame)
        if request.reply is not None and not isinstance(reply, request.reply):
            raise errors.Internal(f"{request.op} was answered with {reply.op}")
        return reply, got

    def push(self, message: Message, fds: Sequence[int] = ()) -> None:
        self.conn.send(message.encode(), fds)

    def next_push(self) -> tuple[Message, list[int]]:
        """Block for the next push (EOFError when the peer is gone)."""
        if self.pushes:
            return self.pushes.popleft()
        with self._lock:
            frame, fds = self.conn.recv()
        return decode(frame), fds

    def close(self) -> None:
        self.conn.close()


class MessageStream:
    """One end of a message connection served by an event loop (``lifl.net.loop.Loop``).

    Each frame that arrives goes to ``on_frame(frame, fds)`` (which owns the descriptors);
    ``send`` queues a frame and the descriptors that go with it (the stream closes them once
    sent), and everything queued in one turn of the loop is written at its end, in as few
    ``sendmsg`` calls as descriptors allow. ``on_close`` runs once, when the peer goes, a frame
    is malformed (the connection cannot be trusted further), or ``close`` is called."""

    def __init__(self, loop: Any, sock: socket.socket, on_frame: Any, on_close: Any) -> None:
        self.loop = loop
        self.sock = sock
        sock.setblocking(False)
        self._on_frame = on_frame
        self._on_close = on_close
        self._in = bytearray()
        self._fds_in: deque[int] = deque()
        self._out: deque[tuple[memoryview, list[int]]] = deque()  # bytes, and the descriptors of their first byte
        self._flush_posted = False
        self._closing = False  # close once what is queued is sent
        self.closed = False
        loop.watch(sock, self._readable)

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        """Queue ``message``; the descriptors ``fds`` are the stream's to close once sent."""
        if self.closed:
            for fd in fds:
                _close(fd)
            return
        self._out.append((memoryview(encode_frame(message, len(fds))), list(fds)))
        if not self._flush_posted:
            self._flush_posted = True
            self.loop.post(self._flush)

    def _flush(self) -> None:
        self._flush_posted = False
        if self.closed:
            return
        try:
            while self._out:
                batch: list[tuple[memoryview, list[int]]] = []
                fds: list[int] = []
                while self._out and len(fds) + len(self._out[0][1]) <= MAX_FDS:  # one sendmsg while descriptors fit
                    batch.append(self._out.popleft())
                    fds += batch[-1][1]
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
                try:
                    sent = self.sock.sendmsg([data for data, _ in batch], ancillary)
                except BlockingIOError:
                    self._out.extendleft(reversed(batch))
                    break
                for fd in fds:  # they went with the first byte: the kernel holds its own references
                    _close(fd)
                unsent = []
                for data, _ in batch:  # what is left goes later, without descriptors (they went already)
                    if sent >= len(data):
                        sent -= len(data)
                    else:
                        unsent.append((data[sent:], []))
                        sent = 0
                if unsent:
                    self._out.extendleft(reversed(unsent))
                    break
        except OSError:
            self.close()
            return
        if self._closing and not self._out:
            self.close()
            return
        self.loop.watch(self.sock, None if self._closing else self._readable, self._flush if self._out else None)

    def finish(self) -> None:
        """Close once what is queued is sent (an error's answer before the connection ends); read nothing more."""
        self._closing = True
        if not self._flush_posted:
            self._flush_posted = True
            self.loop.post(self._flush)

    def _readable(self) -> None:
        try:
            while True:
                data, fds, flags, _ = socket.recv_fds(self.sock, RECEIVE_BYTES, MAX_FDS)
                self._fds_in.extend(fds)
                if flags & socket.MSG_CTRUNC:
                    raise errors.BadRequest("descriptors were cut off (more than the limit in one message)")
                if not data:
                    self.close()
                    return
                self._in += data
                if len(data) < RECEIVE_BYTES:
                    break
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            return
        except errors.LiflError as e:
            print(f"lifl: closing a control connection: {e.message}", file=sys.stderr)
            self.close()
            return
        while not self.closed:
            try:
                frame = next_frame(self._in, self._fds_in)
            except errors.LiflError as e:
                print(f"lifl: closing a control connection: {e.message}", file=sys.stderr)
                self.close()
                return
            if frame is None:
                return
            self._on_frame(*frame)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.unwatch(self.sock)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for fd in self._fds_in:
            _close(fd)
        for _, fds in self._out:
            for fd in fds:
                _close(fd)
        self._out.clear()
        self._on_close()
