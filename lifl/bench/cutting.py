"""A TCP proxy that breaks a connection after so many bytes, as a failing network would, and
counts what crosses it both ways: `lifl bench large` and the tests of resumable transfers
measure with it what a client sends again after the break."""

from __future__ import annotations

import contextlib
import socket
import threading

UP, DOWN = "up", "down"  # client to server, server to client


class CuttingProxy:
    """Forwards connections to ``upstream``; the first ``cuts`` are cut (both ends shut) once
    ``cut_after`` bytes went ``direction`` (the rest of the connection's bytes are not forwarded),
    or, with ``cut_at``, before the bytes that hold it would go; later connections pass whole.
    ``passed[UP]`` and ``passed[DOWN]`` count the bytes forwarded over every connection."""

    def __init__(self, upstream: str, cut_after: int | None = None, direction: str = UP, cuts: int = 1,
                 cut_at: bytes | None = None) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.cut_after, self.cut_at, self.direction, self.cuts_left = cut_after, cut_at, direction, cuts
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "{}:{}".format(*self.listener.getsockname())
        self.passed = {UP: 0, DOWN: 0}
        self.cut = 0  # connections cut so far
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client = self.listener.accept()[0]
                server = socket.create_connection(self.upstream)
                with self._lock:
                    cutting = self.cuts_left > 0
                    self.cuts_left -= 1
                for source, sink, direction in ((client, server, UP), (server, client, DOWN)):
                    threading.Thread(target=self._pump, args=(source, sink, direction,
                                                              cutting and direction == self.direction),
                                     daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str, cutting: bool) -> None:
        limit = self.cut_after if cutting else None
        passed = 0
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16 if limit is None else min(1 << 16, limit - passed)):
                if cutting and self.cut_at is not None and self.cut_at in data:
                    self._cut()
                    break
                sink.sendall(data)
                passed += len(data)
                with self._lock:
                    self.passed[direction] += len(data)
                if limit is not None and passed >= limit:
                    self._cut()
                    break
        for sock in (source, sink):  # what was forwarded arrives before the end (a FIN, not a reset)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _cut(self) -> None:
        with self._lock:
            self.cut += 1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
