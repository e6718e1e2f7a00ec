"""The socket I/O server and client share: gather lists, so that frame headers and payloads
straight from a caller's memory go out together in one system call."""

from __future__ import annotations

import socket
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any

MAX_FRAMES_PER_WRITE = 64  # frames gathered into one sendmsg: a header and a few views each, well within IOV_MAX (1024)
TLS_GATHER = 64 << 10  # over TLS, parts smaller than this are joined up to this size: one TLS record each, not one per part


def sendmsg_all(sock: socket.socket | Any, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write every byte of ``parts`` (sendmsg may write part of them). A TLS socket has no
    sendmsg: small parts (frame headers) are joined with their neighbours, large ones go as they are."""
    if isinstance(sock, ssl.SSLSocket) or not isinstance(sock, socket.socket):  # lifl.net.tls.TlsSocket too
        _sendall_gathered(sock, parts)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _sendall_gathered(sock: Any, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    pending = bytearray()
    for part in parts:
        view = memoryview(part).cast("B")
        if len(view) >= TLS_GATHER:
            if pending:
                sock.sendall(pending)
                pending.clear()
            sock.sendall(view)
            continue
        pending += view
        if len(pending) >= TLS_GATHER:
            sock.sendall(pending)
            pending.clear()
    if pending:
        sock.sendall(pending)


def take_views(views: deque[memoryview], size: int) -> list[memoryview]:
    """Up to ``size`` bytes from the front of ``views``, as views (the rest stays)."""
    taken: list[memoryview] = []
    while views and size:
        view = views[0]
        if len(view) <= size:
            taken.append(views.popleft())
            size -= len(view)
        else:
            taken.append(view[:size])
            views[0] = view[size:]
            size = 0
    return taken
