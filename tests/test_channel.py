"""Key messages and the unix-socket key channel."""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from lifl.keys.factory import attach, transport
from lifl.keys.record import FLAG_PARTIAL, KIND_CLOSE, KINDS, MESSAGE_BYTES, RECORD_FIELDS, KeyMessage, _RECORD, now_ns
from lifl.keys.unix import UnixTransport
from lifl.store import Tenant

ACME = Tenant("acme", id=610001)
REPO = Path(__file__).resolve().parent.parent


def test_message_round_trip_and_destination_first() -> None:
    msg = KeyMessage(dest=7, task=99, key=os.urandom(16), samples=1234, count=3, partial=True, src=5, sent_ns=now_ns(),
                     tenant=610001, agg_us=1500)
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


def test_the_record_is_the_one_bpf_keymsg_h_defines(tmp_path: Path) -> None:
    """The Python layout pinned to the C struct, compiled: offsets and sizes of every field, and
    the kinds and flags."""
    program = tmp_path / "layout.c"
    fields = ", ".join(f'"{name}"' for name in RECORD_FIELDS)
    offsets = " ".join(f'printf("%zu %zu\\n", offsetof(struct keymsg, {f}), sizeof(((struct keymsg *)0)->{f}));'
                       for f in RECORD_FIELDS)
    program.write_text(f"""#include <linux/types.h>
#include <stddef.h>
#include <stdio.h>
#include "keymsg.h"
static const char *names[] = {{{fields}}};
int main(void) {{ printf("%zu\\n", sizeof(struct keymsg)); {offsets}
  printf("%d %d %d %d %d\\n", KEYMSG_KIND_KEY, KEYMSG_KIND_CLOSE, KEYMSG_KIND_ACK, KEYMSG_KIND_PREPARE,
         KEYMSG_FLAG_PARTIAL);
  return names[0] == 0; }}
""")
    subprocess.run(["cc", "-std=c11", "-I", str(REPO / "bpf"), "-o", str(tmp_path / "layout"), str(program)], check=True)
    lines = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.split("\n")
    c_layout = [tuple(map(int, line.split())) for line in lines[1:-2]]
    assert int(lines[0]) == MESSAGE_BYTES == _RECORD.size
    assert c_layout == _python_layout()
    assert [int(v) for v in lines[-2].split()] == [*KINDS, FLAG_PARTIAL]


def _python_layout() -> list[tuple[int, int]]:
    """(offset, size) of each field of the packed record (no padding: each follows the last)."""
    layout, offset = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", _RECORD.format):
        size = struct.calcsize("<" + count + code)
        layout.append((offset, size))
        offset += size
    return layout


def test_unix_channel_delivers_and_reports_full_queues(tmp_path: Path) -> None:
    keys = UnixTransport(tmp_path)
    sock, spec = keys.provision(ACME, 3)
    receiver = attach(spec, sock)
    sender = keys.sender(ACME)
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
    keys.retire(ACME, 3)
    assert not (tmp_path / "acme" / "3").exists()
    receiver.close()
    keys.close()


def test_endpoints_are_the_tenants_alone(tmp_path: Path) -> None:
    keys, why = transport("unix", "n", tmp_path)
    assert why == "asked for (--channel unix)"
    tenant = Tenant("acme", os.getuid(), os.getgid(), 610001)
    sock, _ = keys.provision(tenant, 8)
    assert (tmp_path / "acme").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "acme" / "8").stat().st_mode & 0o777 == 0o660
    sock.close()
    with pytest.raises(ValueError, match="unknown key transport 'carrier-pigeon'"):
        transport("carrier-pigeon", "n", tmp_path)


def test_a_message_speaks_for_its_senders_tenant_only(tmp_path: Path) -> None:
    """Messages are stamped with the sending endpoint's tenant; one of another tenant is
    neither sent nor taken."""
    keys = UnixTransport(tmp_path)
    sock, spec = keys.provision(ACME, 3)
    receiver = attach(spec, sock)
    keys.sender(ACME).send(KeyMessage(dest=3, task=1, key=b"k" * 16))
    assert receiver.recv(timeout=30).tenant == ACME.id
    with pytest.raises(ValueError, match="cannot be sent from tenant"):
        keys.sender(ACME).send(KeyMessage(dest=3, task=1, tenant=ACME.id + 1))
    forged = KeyMessage(dest=3, task=1, tenant=ACME.id + 1).pack()  # straight onto the socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
        raw.sendto(forged, str(tmp_path / "acme" / "3"))
    with pytest.raises(ValueError, match="reached an endpoint of tenant"):
        receiver.recv(timeout=30)
    keys.close()


@pytest.mark.parametrize("spec", ["unix", "unix:x:/tmp", "unix:1:", "ebpf-nope:1", "ebpf:", "ebpf:x", ""])
def test_malformed_endpoint_specs_are_refused(spec: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, pytest.raises(ValueError):
        attach(spec, sock)


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

    keys = UnixTransport(tmp_path)
    sock, spec = keys.provision(ACME, 3)
    receiver = attach(spec, sock)
    sender = keys.sender(ACME)
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
