"""The gateway's multiplexed connection to its agent (gateway/agentlink.py), against a scripted
agent on a real unix socket: Hello first, many requests in flight, replies matched by id in
whatever order they come with their descriptors, every waiting request failed with 503
``agent_unavailable`` when the connection drops, and a new connection after a back-off."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_for
from lifl.errors import Conflict, Unavailable
from lifl.gateway.agentlink import RECONNECT_MAX, AgentLink
from lifl.net.loop import Loop
from lifl.protocol import Hello, ModelOpened, OpenModel, Welcome, decode
from lifl.rpc import Connection, error_reply, reply_frame


class ScriptedAgent:
    """Accepts gateway connections; answers Hello at once and holds every other request until
    the test answers it (``answer``), in any order, or drops the connection (``drop``).

    Each socket is closed by the thread that reads it, and ``drop``/``close`` wait for those
    threads: a socket closed under a thread about to read it frees its descriptor number for
    the next socket the process opens (a later test's Redis connection), which that thread
    would then read from."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.connections: list[tuple[Connection, threading.Thread]] = []
        self.hellos: list[Hello] = []
        self.requests: list[tuple[Connection, int, Any]] = []  # (connection, id, message), in arrival order
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        try:
            while True:
                try:
                    sock, _ = self.listener.accept()
                except OSError:  # close() shut the listener down
                    return
                conn = Connection(sock)
                serving = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                with self._lock:
                    self.connections.append((conn, serving))
                serving.start()
        finally:
            self.listener.close()

    def _serve(self, conn: Connection) -> None:
        try:
            while True:
                frame, fds = conn.recv()
                for fd in fds:
                    os.close(fd)
                request_id = frame.pop("id")
                message = decode(frame)
                if isinstance(message, Hello):
                    self.hellos.append(message)
                    conn.send(reply_frame(request_id, Welcome("n1", message.protocol)))
                    continue
                with self._lock:
                    self.requests.append((conn, request_id, message))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def answer(self, index: int, reply: Any, fds: list[int] = ()) -> None:
        conn, request_id, _ = self.requests[index]
        conn.send(reply_frame(request_id, reply), fds)

    def refuse(self, index: int, error: Exception) -> None:
        conn, request_id, _ = self.requests[index]
        conn.send(error_reply(request_id, error))

    def drop(self) -> None:
        """End every connection: each one's thread sees it end, closes it, and is waited for."""
        with self._lock:
            connections, self.connections = self.connections, []
            self.requests.clear()
        for conn, _ in connections:
            _shut(conn.sock)
        for _, serving in connections:
            serving.join(30)
            assert not serving.is_alive(), "a connection's thread did not end"

    def close(self) -> None:
        _shut(self.listener)
        self._accepting.join(30)
        assert not self._accepting.is_alive(), "the accepting thread did not end"
        self.drop()


def _shut(sock: socket.socket) -> None:
    """Wake the thread blocked on ``sock`` (its read or accept ends) without closing it under that thread."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[ScriptedAgent]:
    a = ScriptedAgent(tmp_path / "agent.sock")
    yield a
    a.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    loop = Loop("test gateway")
    thread = loop.start()
    yield loop
    loop.stop()
    thread.join(10)
    loop.close()


class Replies:
    """What requests made from the test get back, by name."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[Any, BaseException | None]] = {}

    def into(self, name: str) -> Any:
        def done(reply: Any, error: BaseException | None) -> None:
            self.got[name] = (reply, error)

        return done


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("reply")
    os.write(fd, data)
    return fd


def test_replies_out_of_order_reach_their_requests_with_their_descriptors(agent: ScriptedAgent, loop: Loop) -> None:
    link = AgentLink(loop, str(agent.path))
    replies = Replies()
    loop.call(lambda: [link.request(OpenModel(job), done=replies.into(job)) for job in ("a", "b", "c")])
    wait_for(lambda: len(agent.requests) == 3, what="three requests in flight at once")
    assert [h.role for h in agent.hellos] == ["gateway"]  # the connection said hello first
    assert [m.job for _, _, m in agent.requests] == ["a", "b", "c"]
    for index, job in ((2, "c"), (0, "a")):  # the agent answers in its own order
        agent.answer(index, ModelOpened(job.encode(), 1, 4), [memfd_with(job.encode() * 4)])
    agent.refuse(1, Conflict("not now", code="busy"))
    wait_for(lambda: len(replies.got) == 3, what="every reply")
    for job in ("a", "c"):
        (reply, fds), error = replies.got[job]
        assert error is None and reply.key == job.encode() and len(fds) == 1
        assert os.pread(fds[0], 4, 0) == job.encode() * 4  # the descriptor that came with this very reply
        os.close(fds[0])
    reply, error = replies.got["b"]
    assert reply is None and isinstance(error, Conflict) and error.code == "busy"


def test_a_dropped_connection_fails_what_waits_and_the_link_connects_again(agent: ScriptedAgent, loop: Loop) -> None:
    link = AgentLink(loop, str(agent.path))
    replies = Replies()
    loop.call(lambda: [link.request(OpenModel(job), done=replies.into(job)) for job in ("a", "b")])
    wait_for(lambda: len(agent.requests) == 2, what="two requests in flight")
    agent.drop()
    wait_for(lambda: len(replies.got) == 2, what="both requests to fail")
    for _, error in replies.got.values():
        assert isinstance(error, Unavailable) and error.code == "agent_unavailable" and error.status == 503
    wait_for(lambda: len(agent.hellos) == 2, timeout=60, what="a new connection, with its hello")
    assert loop.call(lambda: link.epoch) == 2
    result: list[Any] = []
    threading.Thread(target=lambda: result.append(link.call(OpenModel("d"))), daemon=True).start()  # a pool's thread
    wait_for(lambda: len(agent.requests) == 1, what="the request on the new connection")
    agent.answer(0, ModelOpened(b"d", 0, 4), [memfd_with(b"dddd")])
    wait_for(lambda: result, what="the blocking call's reply")
    (reply, fds), = result
    assert reply.key == b"d" and os.pread(fds[0], 4, 0) == b"dddd"
    os.close(fds[0])


def test_without_an_agent_requests_fail_at_once_and_the_link_keeps_trying(tmp_path: Path, loop: Loop) -> None:
    path = tmp_path / "agent.sock"
    link = AgentLink(loop, str(path))
    replies = Replies()
    loop.call(lambda: link.request(OpenModel("a"), done=replies.into("a")))
    wait_for(lambda: "a" in replies.got, what="the refusal")
    reply, error = replies.got["a"]
    assert reply is None and isinstance(error, Unavailable) and error.code == "agent_unavailable"
    agent = ScriptedAgent(path)  # the agent starts: the link finds it within the back-off's longest wait
    try:
        wait_for(lambda: agent.hellos, timeout=60 + RECONNECT_MAX, what="the link to connect")
        loop.call(lambda: link.request(OpenModel("b"), done=replies.into("b")))
        wait_for(lambda: agent.requests, what="the request")
        agent.answer(0, ModelOpened(b"b", 0, 1), [memfd_with(b"b")])
        wait_for(lambda: "b" in replies.got, what="the reply")
        (reply, fds), error = replies.got["b"]
        assert error is None and reply.key == b"b"
        os.close(fds[0])
    finally:
        agent.close()
