"""Blocking socket I/O, for clients (the SDK, and the gateway's own calls to other nodes'
gateways): gather lists, so that frame headers and payloads straight from a caller's memory go
out together in one system call, and files sent with sendfile."""

from __future__ import annotations

import mmap
import os
import select
import socket
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

MAX_FRAMES_PER_WRITE = 64  # frames gathered into one sendmsg: a header and a few views each, well within IOV_MAX (1024)
TLS_GATHER = 64 << 10  # over TLS, parts smaller than this are joined up to this size: one TLS record each, not one per part
TLS_SEND_CHUNK = 1 << 20  # bytes of a file handed to TLS at a time, where sendfile cannot be used


def ready(files: Sequence[Any], timeout: float | None = None, *, write: bool = False) -> list[Any]:
    """Those of ``files`` (sockets or descriptors) readable (``write``: writable), or closed or
    failed, within ``timeout`` s (None: however long it takes). poll, not select: select cannot
    watch a descriptor past 1024, and a node's processes hold more than that."""
    poller = select.poll()
    by_fd: dict[int, Any] = {}
    for f in files:
        fd = f if isinstance(f, int) else f.fileno()
        by_fd[fd] = f
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
    events = poller.poll(None if timeout is None else max(0.0, timeout) * 1000)
    return [by_fd[fd] for fd, _ in events]


def sendmsg_all(sock: socket.socket | Any, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write every byte of ``parts`` (sendmsg may write part of them). A TLS socket has no
    sendmsg: small parts (frame headers) are joined with their neighbours, large ones go as they are."""
    if isinstance(sock, ssl.SSLSocket) or not isinstance(sock, socket.socket):
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


def sendfile_all(sock: socket.socket, fd: int, count: int, timeout: float, *, start: int = 0,
                 on_sent: Callable[[int], None] = lambda _: None) -> None:
    """Send ``count`` bytes of ``fd`` from offset ``start`` with sendfile (the kernel copies them
    from shared memory, or a file's pages, into the socket); TimeoutError if the peer reads nothing
    for ``timeout`` s. Over TLS, which sendfile would bypass, the bytes are encrypted from a
    mapping of ``fd``. ``on_sent(n)`` hears of every n bytes the socket took, also of those
    before a failure."""
    if isinstance(sock, ssl.SSLSocket):
        _send_mapped(sock, fd, start, count, timeout, on_sent)
        return
    offset, end = start, start + count
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, end - offset)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            if not ready([sock], timeout, write=True):
                raise TimeoutError(f"the peer stopped reading after {offset - start} of {count} bytes") from None
            continue
        if sent == 0:
            raise ConnectionError(f"the file ended at byte {offset}, before {end}")
        offset += sent
        on_sent(sent)


def _send_mapped(sock: ssl.SSLSocket, fd: int, start: int, count: int, timeout: float,
                 on_sent: Callable[[int], None]) -> None:
    if count == 0:
        return
    base = start - start % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
    mapping = mmap.mmap(fd, start + count - base, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ, offset=base)
    try:
        sock.settimeout(timeout)  # bounds each wait for the peer to read
        with memoryview(mapping) as view:
            for offset in range(start - base, start + count - base, TLS_SEND_CHUNK):
                chunk = view[offset : offset + TLS_SEND_CHUNK]
                sock.sendall(chunk)
                on_sent(len(chunk))
    finally:
        mapping.close()
