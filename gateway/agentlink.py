"""The gateway's connections to its node's agent, served by the gateway's event loop.

One ``AgentLink`` carries every request of the gateway's front ends (``Hello("gateway")``):
requests are numbered, many are in flight at once, and each reply is matched to its request by
id whatever order the agent answers in, with the descriptors that came along handed to the
request that waits for them. What is sent in one turn of the loop goes out in one ``sendmsg``
(``lifl.rpc.MessageStream``), so the agent receives the admissions that arrive together at
once and batches them into one Redis call: keeping many requests in flight on one connection is
what makes a node cheap.

The uploads the agent hands out belong to the connection that admitted them: the agent gives
them back if it closes. With every client sharing this one connection, an upload whose client
goes away is given back explicitly (``Abort``, by ``Ingest.abort``).

If the connection drops (the agent restarts, the node stops), every request waiting on it
fails with 503 ``agent_unavailable`` and the link connects again, backing off from
``RECONNECT_FIRST`` to ``RECONNECT_MAX`` seconds; until then a request fails at once (with the
same answer) instead of waiting. ``epoch`` counts the connections made: an object admitted on
one is meaningless on the next.

A second link with ``Hello("forwarder")`` takes the agent's pushes (``ForwardPartial``) and
pushes its answers back (``Forwarded``).

Threads: the link is the loop's. ``request`` may be called from any thread (it posts itself to
the loop from others); ``call`` is for the pool's threads, which block on the reply, never the
loop's.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from lifl import errors
from lifl.errors import Internal, LiflError, Unavailable
from lifl.net.loop import Loop, Timer
from lifl.protocol import Hello, Message, decode
from lifl.rpc import MessageStream, raise_error

RECONNECT_FIRST = 0.05  # s before the first attempt to connect again after a drop
RECONNECT_MAX = 1.0  # s between attempts at most (the back-off doubles up to it)
RETRY_AFTER = 1.0  # s a client refused for want of the agent is told to wait

# (reply, descriptors) on success, else the error; the receiver owns the descriptors
Reply = tuple[Message, list[int]]
ReplyDone = Callable[[Reply | None, BaseException | None], None]


def agent_unavailable(reason: str) -> Unavailable:
    return Unavailable(f"the node's agent is unreachable: {reason}", code="agent_unavailable", retry_after=RETRY_AFTER)


class AgentLink:
    """One connection to the agent, as ``role`` ("gateway": requests; "forwarder": pushes)."""

    def __init__(self, loop: Loop, path: str, role: str = "gateway",
                 on_push: Callable[[Message, list[int]], None] | None = None) -> None:
        self.loop = loop
        self.path = path
        self.role = role
        self._on_push = on_push
        self._stream: MessageStream | None = None
        self._pending: dict[int, tuple[type[Message] | None, ReplyDone]] = {}
        self._next_id = 0
        self.epoch = 0  # connections made so far; the current one's number while connected
        self._backoff = RECONNECT_FIRST
        self._retry: Timer | None = None  # a connection attempt scheduled after a failure
        self._closed = False
        self.last_error = "not connected yet"

    @property
    def connected(self) -> bool:
        return self._stream is not None and not self._stream.closed

    # -- connecting ------------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect now if not connected (on the loop); on failure, again after the back-off."""
        if self.connected or self._closed:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.path)  # a unix socket connects at once, or not at all (a full backlog: EAGAIN)
        except OSError as e:
            sock.close()
            self.last_error = os.strerror(e.errno) if e.errno else str(e)
            if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN):
                print(f"lifl gateway: cannot connect to the agent ({self.role}): {e}", file=sys.stderr)
            self._schedule_reconnect()
            return
        self.epoch += 1
        self._stream = MessageStream(self.loop, sock, self._on_frame, self._on_close)
        self._send(Hello(self.role), (), self._welcomed)

    def _welcomed(self, reply: Reply | None, error: BaseException | None) -> None:
        if error is None:
            self._backoff = RECONNECT_FIRST
            return
        print(f"lifl gateway: the agent refused this gateway's hello ({self.role}): {error}", file=sys.stderr)

    def _schedule_reconnect(self) -> None:
        if self._closed or self._retry is not None:
            return
        delay, self._backoff = self._backoff, min(2 * self._backoff, RECONNECT_MAX)
        self._retry = self.loop.later(delay, self._reconnect)

    def _reconnect(self) -> None:
        self._retry = None
        self.connect()

    def _on_close(self) -> None:
        """The connection dropped: fail every request waiting on it, then connect again."""
        self._stream = None
        self.last_error = "the connection closed"
        pending, self._pending = self._pending, {}
        error = agent_unavailable("the connection closed")
        for _, done in pending.values():
            _deliver(done, None, error)
        self._schedule_reconnect()

    def close(self) -> None:
        """For good (the gateway stops): no more reconnecting."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        if self._stream is not None:
            self._stream.close()

    # -- requests ----------------------------------------------------------------------------------
    def request(self, message: Message, fds: Sequence[int] = (), done: ReplyDone | None = None) -> None:
        """Send ``message`` (and ``fds``, which become the link's to close); ``done(reply, error)``
        on the loop once answered (nothing for a request whose answer nobody needs). From any
        thread; ``done`` always runs later, never inside this call."""
        if not self.loop.in_loop():
            self.loop.post(lambda: self.request(message, fds, done))
            return
        if not self.connected and self._retry is None:
            self.connect()  # not connected and not backing off: the agent may be back
        if not self.connected:
            for fd in fds:
                os.close(fd)
            if done is not None:
                error = agent_unavailable(self.last_error)
                self.loop.post(lambda: done(None, error))
            return
        self._send(message, fds, done)

    def _send(self, message: Message, fds: Sequence[int], done: ReplyDone | None) -> None:
        assert self._stream is not None
        self._next_id += 1
        self._pending[self._next_id] = (message.reply, done or _ignore)
        self._stream.send({"id": self._next_id, **message.encode()}, fds)

    def push(self, message: Message, fds: Sequence[int] = ()) -> None:
        """Send a message that has no reply (the forwarder's ``Forwarded``); dropped when not connected."""
        if not self.loop.in_loop():
            self.loop.post(lambda: self.push(message, fds))
            return
        if self._stream is None:
            for fd in fds:
                os.close(fd)
            return
        self._stream.send(message.encode(), fds)

    def call(self, message: Message, fds: Sequence[int] = ()) -> Reply:
        """From a thread other than the loop's (the pool's): send ``message`` and wait for its
        reply; the error the agent answered (or ``agent_unavailable``) is raised."""
        assert not self.loop.in_loop(), "the loop's thread must not wait for the agent"
        future: Future[Reply] = Future()

        def done(reply: Reply | None, error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(reply)  # type: ignore[arg-type]

        self.request(message, fds, done)
        return future.result()

    # -- replies -------------------------------------------------------------------------------------
    def _on_frame(self, frame: dict[str, Any], fds: list[int]) -> None:
        request_id = frame.pop("id", None)
        waiting = self._pending.pop(request_id, None) if request_id is not None else None
        if waiting is None:
            if request_id is None and self._on_push is not None:
                self._push_arrived(frame, fds)
            else:
                for fd in fds:
                    os.close(fd)
            return
        expected, done = waiting
        try:
            ok = frame.pop("ok", False)
            if not ok:
                raise_error(frame)
            reply = decode(frame)
            if expected is not None and not isinstance(reply, expected):
                raise Internal(f"a {expected.op} reply was expected, the agent sent {reply.op}")
        except LiflError as e:
            for fd in fds:
                os.close(fd)
            _deliver(done, None, e)
            return
        _deliver(done, (reply, fds), None)

    def _push_arrived(self, frame: dict[str, Any], fds: list[int]) -> None:
        assert self._on_push is not None
        try:
            message = decode(frame)
        except errors.LiflError as e:
            print(f"lifl gateway: the agent pushed a malformed message: {e.message}", file=sys.stderr)
            for fd in fds:
                os.close(fd)
            return
        try:
            self._on_push(message, fds)
        except Exception:  # one push's failure must not stop the frames behind it
            traceback.print_exc()


def _deliver(done: ReplyDone, reply: Reply | None, error: BaseException | None) -> None:
    """Run one request's continuation; its failure (a bug: it is logged) must not stop the
    frames behind it."""
    try:
        done(reply, error)
    except Exception:
        traceback.print_exc()


def _ignore(reply: Reply | None, error: BaseException | None) -> None:
    """The continuation of a request whose answer nobody needs: its descriptors are closed."""
    if reply is not None:
        for fd in reply[1]:
            os.close(fd)
