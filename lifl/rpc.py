"""The agent's control connections: framed JSON messages over unix stream sockets, with file
descriptors (shared-memory objects, channel endpoints) passed alongside via SCM_RIGHTS.

A request is ``{"id": n, "op": ..., ...}``; its reply is ``{"id": n, "ok": true, ...}`` or
``{"id": n, "ok": false, "error": {...}}``, which the caller gets back as the same
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
                    message = json.loads(body)
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
    if cls is errors.Overloaded:
        raise errors.Overloaded(info["message"], retry_after=info.get("retry_after") or 1.0, code=info["code"])
    raise cls(info["message"], code=info["code"], extra=info.get("extra"))


class Client:
    """Request/reply over a Connection; pushes that arrive meanwhile are queued for ``next_push``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._next_id = 0
        self._lock = threading.Lock()
        self.pushes: deque[tuple[dict[str, Any], list[int]]] = deque()

    @classmethod
    def connect(cls, path: str, hello: dict[str, Any]) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        client = cls(Connection(sock))
        client.call("hello", **hello)
        return client

    def call(self, op: str, fds: Sequence[int] = (), **args: Any) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            self.conn.send({"id": request_id, "op": op, **args}, fds)
            while True:
                message, got = self.conn.recv()
                if message.get("id") == request_id:
                    break
                self.pushes.append((message, got))
        if not message.get("ok"):
            for fd in got:
                _close(fd)
            raise_error(message)
        return message, got

    def next_push(self) -> tuple[dict[str, Any], list[int]]:
        """Block for the next push (EOFError when the agent is gone)."""
        if self.pushes:
            return self.pushes.popleft()
        with self._lock:
            return self.conn.recv()

    def close(self) -> None:
        self.conn.close()
