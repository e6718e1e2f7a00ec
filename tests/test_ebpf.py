"""The eBPF key channel (bpf/keychan.bpf.c through lifl/keys/ebpf.py) on the real kernel: redirects
into the destination's receive queue, passes everything else to the sender's TCP peer without
ever breaking the sender, keeps tenants apart, moves routes, and unloads without a trace."""

from __future__ import annotations

import fcntl
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import termios
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from lifl import kernels
from lifl.keys import ebpf
from lifl import format as fmt
from lifl.bench.channel import WOKEN_MESSAGES, compare
from lifl.keys.factory import attach
from lifl.keys.record import MESSAGE_BYTES, KeyMessage
from lifl.keys.transport import KeyEndpoint
from lifl.client import Gateway
from lifl.node.supervisor import Node, NodeConfig
from lifl.store import Tenant

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="loading eBPF programs needs root"),
]

TENANT, OTHER_TENANT = 7, 8
A, B, C = 1, 2, 3  # instance ids
UNREGISTERED_DEST = 99
UNLOAD_TIMEOUT_S = 10.0  # bounds a failure only: the kernel frees the program within an RCU grace period


@pytest.fixture(scope="module")
def built() -> Path:
    return ebpf.build()


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    path = ebpf.BPFFS / f"lifl-test-{os.getpid()}"
    yield path
    ebpf.cleanup_stale(path)


@pytest.fixture
def keymaps(built: Path, pin_dir: Path) -> Iterator[ebpf.KeyMaps]:
    maps = ebpf.load(pin_dir, built)
    yield maps
    if pin_dir.exists():
        maps.close()


Pair = tuple[socket.socket, socket.socket]  # (a registered socket, its fallback peer)


@pytest.fixture
def connect() -> Iterator[Callable[[], Pair]]:
    """TCP connections to one loopback listener standing for the node's fallback listener."""
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []

    def make() -> Pair:
        sock = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        for end in (sock, peer):
            end.settimeout(5)  # bounds a failure only
            opened.append(end)
        return sock, peer

    yield make
    for sock in opened:
        sock.close()
    listener.close()


def record(dest: int, tenant: int = TENANT, task: int = 0, agg_us: int = 0) -> bytes:
    return KeyMessage(dest=dest, task=task, src=A, tenant=tenant, agg_us=agg_us).pack()


def receive(sock: socket.socket) -> KeyMessage:
    data = b""
    while len(data) < MESSAGE_BYTES:
        chunk = sock.recv(MESSAGE_BYTES - len(data))
        assert chunk, "connection closed"
        data += chunk
    return KeyMessage.unpack(data)


def readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def assert_peer_next_is_sentinel(sender: socket.socket, peer: socket.socket) -> None:
    """The fallback peer received nothing before now: a message with no route, sent now, is
    the first one it reads (TCP keeps order), so nothing earlier travelled the TCP path."""
    sender.send(record(UNREGISTERED_DEST, task=424242))
    assert receive(peer).task == 424242


def test_redirects_into_the_destination_receive_queue(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, a_peer), (b, b_peer) = connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)
    assert keymaps.routes() == {A: TENANT, B: TENANT}

    a.send(record(B, task=5, agg_us=300))

    got = receive(b)
    assert (got.dest, got.task, got.tenant, got.agg_us) == (B, 5, TENANT, 300)
    assert keymaps.stats() == {B: ebpf.DestStats(messages=1, bytes=64, agg_us=300)}
    assert_peer_next_is_sentinel(a, a_peer)
    assert not readable(b_peer)


def test_unknown_destination_travels_tcp_and_the_sender_keeps_working(
        keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, a_peer), (b, _) = connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)

    a.send(record(UNREGISTERED_DEST, task=1))
    assert receive(a_peer).task == 1
    a.send(record(B, task=2))  # SK_DROP would make this fail with EACCES for good
    assert receive(b).task == 2
    assert keymaps.passed()["no_route"] == 1


def test_a_send_that_is_not_one_record_travels_tcp(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, a_peer), (b, _) = connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)

    two = record(B, task=1) + record(B, task=2)  # one verdict per send(): not split
    a.send(two)
    assert receive(a_peer).task == 1 and receive(a_peer).task == 2
    a.send(record(B, task=3))
    assert receive(b).task == 3
    assert keymaps.passed()["not_a_record"] == 1


def test_other_tenants_messages_are_not_delivered(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, _), (b, _), (intruder, intruder_peer) = connect(), connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)
    keymaps.register(C, OTHER_TENANT, intruder)

    intruder.send(record(B, tenant=OTHER_TENANT, task=1))  # honest about its tenant
    intruder.send(record(B, tenant=TENANT, task=2))  # claims B's tenant: the socket's tenant decides
    assert receive(intruder_peer).task == 1
    assert receive(intruder_peer).task == 2
    a.send(record(B, task=3))
    assert receive(b).task == 3  # B's first message: the intruder's never reached it
    assert keymaps.passed()["tenant"] == 2
    assert keymaps.stats() == {B: ebpf.DestStats(1, 64, 0)}


def test_registering_again_moves_the_route(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, a_peer), (b, _), (c, _) = connect(), connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)
    a.send(record(B, task=1))
    assert receive(b).task == 1

    keymaps.register(B, TENANT, c)
    a.send(record(B, task=2))

    assert receive(c).task == 2
    assert not readable(b)  # a redirect is done when send() returns: it would be queued already
    assert_peer_next_is_sentinel(a, a_peer)


def test_unregister_returns_the_counts_and_the_destination_falls_back(
        keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    (a, a_peer), (b, _) = connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)
    a.send(record(B, agg_us=10))
    receive(b)

    assert keymaps.unregister(B) == ebpf.DestStats(1, 64, 10)
    assert keymaps.unregister(B) is None
    a.send(record(B, task=7))
    assert receive(a_peer).task == 7
    assert keymaps.routes() == {A: TENANT}


def test_ids_beyond_32_bits_are_refused(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    a, _ = connect()
    keymaps.register(ebpf.MAX_ID, ebpf.MAX_ID, a)
    with pytest.raises(ValueError):
        keymaps.register(ebpf.MAX_ID + 1, TENANT, a)
    with pytest.raises(ValueError):
        keymaps.register(A, -1, a)


def test_a_socket_stands_for_one_instance(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    a, _ = connect()
    keymaps.register(A, TENANT, a)
    with pytest.raises(ebpf.EbpfError, match="another instance"):
        keymaps.register(B, TENANT, a)


def test_at_most_max_instances(keymaps: ebpf.KeyMaps, connect: Callable[[], Pair]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = ebpf.MAX_INSTANCES + ebpf.MAX_INSTANCES // 10  # both ends of each connection, and slack
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    sockets = [end for _ in range(ebpf.MAX_INSTANCES // 2 + 1) for end in connect()]  # both ends are TCP sockets
    for instance, sock in enumerate(sockets[:ebpf.MAX_INSTANCES], start=1):
        keymaps.register(instance, TENANT, sock)
    with pytest.raises(ebpf.EbpfError, match=f"at most {ebpf.MAX_INSTANCES}"):
        keymaps.register(ebpf.MAX_INSTANCES + 1, TENANT, sockets[ebpf.MAX_INSTANCES])
    assert len(keymaps.routes()) == ebpf.MAX_INSTANCES


def test_unload_leaves_nothing_pinned_or_attached(built: Path, pin_dir: Path, connect: Callable[[], Pair]) -> None:
    keymaps = ebpf.load(pin_dir, built)
    program = ebpf.program_id(pin_dir)
    assert keymaps.attached_programs() == [program]
    (a, _), (b, _) = connect(), connect()
    keymaps.register(A, TENANT, a)
    keymaps.register(B, TENANT, b)

    keymaps.close()

    assert not pin_dir.exists()
    assert ebpf.wait_unloaded(program, UNLOAD_TIMEOUT_S), f"program {program} is still loaded"


def test_a_crashed_runs_pins_are_cleaned_up(built: Path, pin_dir: Path) -> None:
    crash = "import os, sys; from pathlib import Path; from lifl.keys import ebpf; ebpf.load(Path(sys.argv[1])); os._exit(0)"
    subprocess.run([sys.executable, "-c", crash, str(pin_dir)], check=True, timeout=60)
    program = ebpf.program_id(pin_dir)

    assert ebpf.cleanup_stale(pin_dir)

    assert not pin_dir.exists()
    assert ebpf.wait_unloaded(program, UNLOAD_TIMEOUT_S)
    assert not ebpf.cleanup_stale(pin_dir)
    ebpf.load(pin_dir, built).close()  # and the node can load again


def test_latency_against_tcp_and_unix(keymaps: ebpf.KeyMaps, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured, not asserted (a loaded CI machine decides timing): one-way p50/p99 in µs."""
    figures = compare(messages=10_000, keymaps=keymaps)
    assert {name: latency.messages for name, latency in figures.items()} == {"ebpf": 10_000, "tcp": 10_000, "unix": 10_000}
    with capsys.disabled():
        print()
        for name, latency in figures.items():
            print(f"key message one-way latency, {name:>4}: p50 {latency.p50_us:6.1f} µs  p99 {latency.p99_us:6.1f} µs")


# -- the transport on a real node -------------------------------------------------------------------
def _metric(text: str, name: str, labels: str = "") -> float:
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.split(" ", 1)[0] == wanted:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {wanted} in the metrics")


@pytest.mark.parametrize("channel", ["ebpf", "unix"])
def test_a_round_through_each_channel_is_exact_and_ebpf_carries_its_keys(
        channel: str, redis_url: str, run_dir: Path, shm_node: str) -> None:
    node = Node(NodeConfig(node=shm_node, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=run_dir,
                           data_dir=run_dir.parent / "data", shm_capacity=1 << 30, channel=channel))
    addresses = node.start()
    try:
        gw = Gateway(addresses.http)
        gw.create_job("j", 6, leaf_fan_in=2)  # three leaves, a middle: keys pass between instances
        gw.set_model("j", fmt.encode({"w": np.zeros(16, np.float32)}))
        for i in range(6):
            gw.push("j", fmt.encode({"w": np.full(16, float(i), np.float32)}), client=f"c{i}", samples=i + 1, base_version=0)
        wait_for(lambda: gw.job("j")["version"] == 1, what="version 1")
        _, blob = gw.model("j")
        expected = sum(i * (i + 1) for i in range(6)) / sum(range(1, 7))
        assert np.allclose(fmt.views(blob, kernels.validate(blob))["w"], expected, rtol=1e-6)
        text = gw.metrics()
        if channel == "ebpf":
            # the leaves' results to the middle (the agent's keys travel in the invocations, as inputs)
            assert _metric(text, "lifl_channel_messages_total") >= 3
            assert _metric(text, "lifl_channel_bytes_total") == 64 * _metric(text, "lifl_channel_messages_total")
            assert _metric(text, "lifl_channel_reported_aggregation_seconds_total") > 0  # the leaves' folds
            for reason in set(ebpf.PASS_REASONS) - {"ack"}:  # nothing travelled TCP but acknowledgements, if any
                assert _metric(text, "lifl_channel_passed_total", f'reason="{reason}"') == 0, reason
            assert (ebpf.PIN_ROOT / shm_node).exists()
        else:
            assert "lifl_channel_messages" not in text
    finally:
        node.stop()
    assert not (ebpf.PIN_ROOT / shm_node).exists()  # the agent unloaded its channel


# -- the transport: flow control and fallback ---------------------------------------------------------
@pytest.fixture
def keys(built: Path) -> Iterator[ebpf.EbpfTransport]:
    transport = ebpf.EbpfTransport(f"ft{os.getpid()}", Path("/nonexistent"))
    yield transport
    transport.close()
    assert not transport.pin_dir.exists()


def _tenant(tenant: int) -> Tenant:
    return Tenant(f"t{tenant}", id=tenant)


def _endpoints(keys: ebpf.EbpfTransport, *instances: int, tenant: int = TENANT) -> list[KeyEndpoint]:
    return [attach(spec, sock) for sock, spec in (keys.provision(_tenant(tenant), i) for i in instances)]


def _queued(endpoint: KeyEndpoint) -> int:
    """Bytes waiting in the endpoint's receive queue."""
    return struct.unpack("i", fcntl.ioctl(endpoint.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def test_a_stuck_receiver_holds_its_credits_and_then_its_senders_stop(keys: ebpf.EbpfTransport) -> None:
    """The kernel gives no backpressure on redirected messages: past MAX_OUTSTANDING they go the
    TCP way to the agent, which holds MAX_PARKED and then stops reading the sender, whose TCP
    buffers fill: its try_send says no. Once the receiver reads, every message arrives, once."""
    sender, receiver = _endpoints(keys, A, B)
    sent = 0
    while sender.try_send(KeyMessage(dest=B, task=sent)):
        sent += 1
        assert sent < 1_000_000, "nothing stopped the sender"
    wait_for(lambda: keys.keymaps.outstanding(B) == ebpf.MAX_OUTSTANDING, what="the receiver's credits used up")
    assert _queued(receiver) == ebpf.MAX_OUTSTANDING * MESSAGE_BYTES  # what the stuck receiver holds, no more
    assert sent > ebpf.MAX_OUTSTANDING + ebpf.MAX_PARKED
    received: set[int] = set()
    while len(received) < sent:
        message = receiver.recv(timeout=60)
        assert message is not None, f"{len(received)} of {sent} arrived"
        assert message.task not in received
        received.add(message.task)
    assert keys.refused == 0


def test_a_message_nobody_takes_reaches_the_agent_and_the_sender_goes_on(keys: ebpf.EbpfTransport) -> None:
    sender, receiver = _endpoints(keys, A, B)
    other, = _endpoints(keys, C, tenant=OTHER_TENANT)
    sender.send(KeyMessage(dest=UNREGISTERED_DEST, task=1))
    other.send(KeyMessage(dest=B, task=2))  # another tenant's instance
    wait_for(lambda: keys.refused == 2, what="both refused at the agent")
    sender.send(KeyMessage(dest=B, task=3))
    assert receiver.recv(timeout=60).task == 3  # the sender still works; nothing else reached B


def test_lifl_bench_channel_reports_every_channel_in_both_placements() -> None:
    import json

    run = subprocess.run([sys.executable, "-m", "lifl", "bench", "channel", "--json", "--idle-seconds", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert {(r["channel"], r["placement"]) for r in report["results"]} == {
        (c, p) for c in ("ebpf", "unix", "tcp") for p in ("same-cpu", "cross-cpu")}
    for r in report["results"]:
        assert r["messages"] >= 10_000 and 0 < r["p50_us"] <= r["p99_us"] and r["cpu_us_per_msg"] > 0
    assert {r["channel"] for r in report["woken"]} == {"ebpf", "unix", "tcp"}
    for r in report["woken"]:  # each message after the receiver sat idle
        assert r["messages"] == WOKEN_MESSAGES and r["idle_ms"] == 20 and 0 < r["p50_us"] <= r["p99_us"]
    assert report["sidecar_idle_cpu_s"] >= 0
