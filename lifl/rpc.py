"""The agent's control connections: typed messages (``lifl.protocol``) framed as JSON over unix
stream sockets, with file descriptors (shared-memory objects) passed alongside via SCM_RIGHTS.

A request is ``{"id": n, "op": ..., ...}``; its reply is ``{"id": n, "ok": true, "op": ...}``
or ``{"id": n, "ok": false, "error": {...}}``, which the caller gets back as the same
``LiflError`` subclass. Messages without an id are pushes (the agent invoking an instance).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from lifl import errors
from lifl.protocol import Message, decode

_LEN = struct.Struct("<I")
MAX_MESSAGE = 16 << 20
MAX_FDS = 16


class Connection:
    """One end of a message connection; ``send`` is thread-safe, ``recv`` is not."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        body = json.dumps({**message, "nfds": len(fds)} if fds else message, separators=(",", ":")).encode()
        data = _LEN.pack(len(body)) + body
        with self._send_lock:
            if fds:
                sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                data = data[sent:]
            if data:
                self.sock.sendall(data)

    def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next message and the fds that came with it; EOFError once the peer is gone."""
        while True:
            if len(self._buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(self._buf)
                if n > MAX_MESSAGE:
                    raise errors.BadRequest(f"control message of {n} bytes is too large")
                if len(self._buf) >= _LEN.size + n:
                    body = bytes(self._buf[_LEN.size : _LEN.size + n])
                    del self._buf[: _LEN.size + n]
                    try:
                        message = json.loads(body)
                    except ValueError:
                        raise errors.BadRequest("control message is not JSON", code="bad_message") from None
                    if not isinstance(message, dict):
                        raise errors.BadRequest("control message is not a JSON object", code="bad_message")
                    fds = [self._fds.popleft() for _ in range(message.pop("nfds", 0))]
                    return message, fds
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, MAX_FDS)
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
        raise cls(info["message"], retry_after=info.get("retry_after") or 1.0, code=info["code"])
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
