"""A proxy in front of a real redis-server, for faults between a node and its Redis.

Every connection made to the proxy's unix socket is one to Redis, bytes passed both ways by two
threads. A fault is armed on the first command that names a script (by its SHA-1) sent after
arming, on whichever connection sends it:

- ``lose_answer``: the command reaches Redis (which runs it), and once Redis answers, both ends
  are closed without the answer: the client cannot know whether it ran.
- ``hold_answer``: Redis's answers on that connection wait until ``release`` (the client sees a
  slow Redis; what it sends meanwhile queues).
"""

from __future__ import annotations

import socket
import tempfile
import threading
from pathlib import Path

LOSE, HOLD = "lose", "hold"


class RedisProxy:
    def __init__(self, redis_url: str) -> None:
        path, _, query = redis_url.removeprefix("unix://").partition("?")
        self._target = path
        self.directory = Path(tempfile.mkdtemp(prefix="lifl-proxy-", dir="/tmp"))
        self.directory.chmod(0o755)
        self.path = self.directory / "proxy.sock"
        self.url = f"unix://{self.path}" + (f"?{query}" if query else "")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self.path.chmod(0o777)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._armed: tuple[str, bytes] | None = None  # (fault, SHA-1 of the script it waits for)
        self.fired = threading.Event()
        self._released = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_answer(self, sha: str) -> None:
        with self._lock:
            self._armed = (LOSE, sha.encode())

    def hold_answer(self, sha: str) -> None:
        with self._lock:
            self._armed = (HOLD, sha.encode())
            self._released.clear()

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._closed = True
        self._released.set()
        _shut(self._listener)  # its thread closes it: never a socket under a thread about to use it

    def _accept(self) -> None:
        try:
            while not self._closed:
                try:
                    client, _ = self._listener.accept()
                except OSError:
                    return
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    server.connect(self._target)
                except OSError:  # Redis is gone (the session ends): so is this connection
                    client.close()
                    server.close()
                    continue
                fault: dict[str, str] = {}  # this connection's fault, once one fired on it
                pair = PumpedPair(client, server)
                threading.Thread(target=self._upstream, args=(client, server, fault, pair), daemon=True).start()
                threading.Thread(target=self._downstream, args=(server, client, fault, pair), daemon=True).start()
        finally:
            self._listener.close()

    def _upstream(self, client: socket.socket, server: socket.socket, fault: dict[str, str], pair: PumpedPair) -> None:
        tail = b""  # a SHA-1 may arrive split over two reads
        try:
            while data := client.recv(1 << 16):
                with self._lock:
                    armed = self._armed
                    if armed is not None and armed[1] in tail + data:
                        self._armed = None
                        fault["kind"] = armed[0]
                        self.fired.set()
                server.sendall(data)
                tail = data[-40:]
        except OSError:
            pass
        pair.pump_ended()

    def _downstream(self, server: socket.socket, client: socket.socket, fault: dict[str, str], pair: PumpedPair) -> None:
        try:
            while data := server.recv(1 << 16):
                kind = fault.get("kind")
                if kind == LOSE:
                    break  # Redis ran it and answered: nobody hears the answer
                if kind == HOLD:
                    self._released.wait()
                client.sendall(data)
        except OSError:
            pass
        pair.pump_ended()


class PumpedPair:
    """Two connections whose bytes two threads pump across, one each way: the first to end
    shuts both down (waking the other), the last closes them (``shut`` wakes both from outside). A socket closed under a thread
    about to read it would free its descriptor number for the next socket the process opens,
    which that thread would then read from."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self._socks = (client, server)
        self._running = 2
        self._lock = threading.Lock()

    def pump_ended(self) -> None:
        for sock in self._socks:
            _shut(sock)
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            for sock in self._socks:
                sock.close()

    def shut(self) -> None:
        for sock in self._socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
