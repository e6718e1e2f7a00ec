"""The socket I/O server and client share: gather lists, so that frame headers and payloads
straight from a caller's memory go out together in one system call."""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Sequence

MAX_FRAMES_PER_WRITE = 64  # frames gathered into one sendmsg: a header and a few views each, well within IOV_MAX (1024)


def sendmsg_all(sock: socket.socket, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write every byte of ``parts`` (sendmsg may write part of them)."""
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
