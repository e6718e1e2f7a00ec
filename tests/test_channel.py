"""Key messages and the unix-socket key channel."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from lifl.channel import KIND_CLOSE, MESSAGE_BYTES, KeyMessage, UnixKeyChannel, now_ns


def test_message_round_trip_and_destination_first() -> None:
    msg = KeyMessage(dest=7, task=99, key=os.urandom(16), samples=1234, count=3, partial=True, src=5, sent_ns=now_ns())
    data = msg.pack()
    assert len(data) == MESSAGE_BYTES == 64
    assert int.from_bytes(data[:4], "little") == 7  # what an SK_MSG program routes on
    assert KeyMessage.unpack(data) == msg


@pytest.mark.parametrize("data,needle", [
    (b"", "64 bytes"),
    (bytes(63), "64 bytes"),
    (bytes(65), "64 bytes"),
    (bytes(8) + (9).to_bytes(2, "little") + bytes(54), "unknown key message kind 9"),
])
def test_malformed_messages_are_rejected(data: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        KeyMessage.unpack(data)


def test_unix_channel_delivers_and_reports_full_queues(tmp_path: Path) -> None:
    sock = UnixKeyChannel.provision(tmp_path, 3, None)
    receiver = UnixKeyChannel(sock, tmp_path)
    sender = UnixKeyChannel.sender(tmp_path)
    assert receiver.recv(timeout=0) is None
    sender.send(KeyMessage(dest=3, task=1, key=b"k" * 16))
    sender.send(KeyMessage(dest=3, task=1, kind=KIND_CLOSE, count=1))
    assert receiver.recv(timeout=30).key == b"k" * 16  # (a bound for a failure: it is already queued)
    assert receiver.recv(timeout=30).kind == KIND_CLOSE
    sent = 0
    while sender.try_send(KeyMessage(dest=3, task=1)):  # the receiver's queue is bounded
        sent += 1
        assert sent < 10_000
    assert sent >= 1
    with pytest.raises(FileNotFoundError):
        sender.send(KeyMessage(dest=4, task=1))  # no such instance
    UnixKeyChannel.retire(tmp_path, 3)
    assert not (tmp_path / "3").exists()
    receiver.close()
    sender.close()


def test_endpoint_is_group_writable_only(tmp_path: Path) -> None:
    sock = UnixKeyChannel.provision(tmp_path, 8, os.getgid())
    assert (tmp_path / "8").stat().st_mode & 0o777 == 0o660
    sock.close()


class _NoPushes:
    """The agent's side of a runtime's connection, with nothing to say."""

    def __init__(self) -> None:
        self.pushes: list = []
        self.conn, self._peer = socket.socketpair()


def test_a_run_of_a_task_takes_each_key_once_and_a_run_again_takes_them_anew(tmp_path: Path) -> None:
    """A task that failed on an instance runs again there with its inputs sent anew, while the
    copies sent to the failed run may still wait: each key counts once per run."""
    from lifl import format as fmt
    from lifl.runtime import Context, Invocation

    receiver = UnixKeyChannel(UnixKeyChannel.provision(tmp_path, 3, None), tmp_path)
    sender = UnixKeyChannel.sender(tmp_path)
    ctx = Context(3, "t", "n", _NoPushes(), receiver)  # type: ignore[arg-type]
    inv = Invocation(1, "j", 0, "middle", 3, False, fmt.ModelSpec(()))
    state, late = b"s" * 16, b"u" * 16
    sender.send(KeyMessage(dest=3, task=1, key=late))  # sent to the run that failed, never read by it
    sender.send(KeyMessage(dest=3, task=2, key=late))  # another task's: kept for it
    for key in (state, late):  # the run again's inputs
        sender.send(KeyMessage(dest=3, task=1, key=key))
    sender.send(KeyMessage(dest=3, task=1, kind=KIND_CLOSE, count=2))
    got = []
    while len(got) < 3:
        got += ctx.receive(inv)
    assert [(m.kind, m.key if m.kind != KIND_CLOSE else m.count) for m in got] == [(1, late), (1, state), (KIND_CLOSE, 2)]
    ctx.run_ended(1)
    sender.send(KeyMessage(dest=3, task=1, key=late))  # a later run is given it again
    assert [m.key for m in ctx.receive(inv)] == [late]
    assert [m.key for m in ctx.receive(Invocation(2, "j", 0, "leaf", 1, False, fmt.ModelSpec(())))] == [late]
