"""One-way latency of a 64-byte key message between two processes, per transport.

- ``ebpf``: TCP sockets in the eBPF key channel's sockhash; the SK_MSG verdict redirects each
  message into the receiver's queue (lifl/keys/ebpf.py; needs root and the built object);
- ``tcp``: the same bytes over a plain loopback TCP connection (TCP_NODELAY);
- ``unix``: AF_UNIX datagram sockets bound to paths, each message addressed, as ``UnixTransport`` sends.

Ping-pong: the sender stamps CLOCK_MONOTONIC into the record and sends; the receiver (a forked
process) takes the difference on arrival and answers over the same transport, and only then
does the next message go, so each figure is one hand-off, never a queue. Two placements:
``same-cpu`` (both processes pinned to one CPU, as a node's aggregators often share one: a
hand-off includes the wake-up of the receiver and the switch to it) and ``cross-cpu``. CPU per
message is both processes' CPU time over the messages sent both ways.

The ``woken`` figures are the same hand-off to a receiver that sat idle for 20 ms before each
message, as an aggregator waits between its inputs: on a virtual machine, waking an idle CPU
dominates them, and they are the floor under the data plane's ``handoff_us``.

`lifl bench channel --json` runs every transport in both placements, and measures the CPU the
eBPF transport's user-space side (the agent's fallback reader) spends over an idle interval:
nothing polls, so it is zero but for noise.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from lifl.keys import ebpf
from lifl.keys.record import KIND_ACK, MESSAGE_BYTES, KeyMessage, now_ns

TRANSPORTS = ("ebpf", "tcp", "unix")
SENDER_ID, RECEIVER_ID, BENCH_TENANT = 1, 2, 1
_LATENCY = struct.Struct("<q")  # one measured latency, ns, from the receiver to the parent


PLACEMENTS = {"same-cpu": (0, 0), "cross-cpu": (0, 1)}  # (sender CPU, receiver CPU)
MIN_MESSAGES = 10_000
COMPARE_ROUNDS = 5
IDLE_SECONDS = 10.0
WOKEN_IDLE_S = 0.02  # how long a receiver sits idle before each message of the "woken" figures
WOKEN_MESSAGES = 200
TCP_TARGET = 0.7  # eBPF's p50 on one CPU against loopback TCP's


class Latency(NamedTuple):
    messages: int
    p50_us: float
    p99_us: float
    cpu_us_per_msg: float  # both processes, per one-way message

    @classmethod
    def of(cls, runs: list[tuple[list[float], float]]) -> Latency:
        """The figures of several runs' (latencies in µs, CPU seconds) together."""
        latencies = sorted(us for run, _ in runs for us in run)
        percentiles = statistics.quantiles(latencies, n=100)
        return cls(len(latencies), percentiles[49], percentiles[98], sum(cpu for _, cpu in runs) * 1e6 / (2 * len(latencies)))


def _recv_record(sock: socket.socket, buffer: memoryview) -> None:
    """One whole record into ``buffer`` (a stream may deliver it in pieces)."""
    got = 0
    while got < MESSAGE_BYTES:
        n = sock.recv_into(buffer[got:], MESSAGE_BYTES - got)
        if not n:
            raise ConnectionError("the peer closed mid-message")
        got += n


_ACK = KeyMessage(dest=0, task=0, kind=KIND_ACK, count=ebpf.ACK_EVERY, tenant=BENCH_TENANT).pack()
_STAMP = 0x0102030405060708
_SENT_NS = struct.Struct("<Q")
_SENT_NS_AT = KeyMessage(dest=0, task=0, sent_ns=_STAMP).pack().index(_SENT_NS.pack(_STAMP))  # where the record has it


def _received(sock: socket.socket, received: int, acknowledge: bool) -> None:
    """eBPF: give the sender its credits back every ACK_EVERY messages, as EbpfEndpoint does."""
    if acknowledge and received % ebpf.ACK_EVERY == 0:
        sock.send(_ACK)


def _send_to(sock: socket.socket, address: str | None) -> Callable[[bytes], int]:
    """How a record goes out: on a connected socket, or addressed (as UnixEndpoint sends)."""
    return sock.send if address is None else (lambda record: sock.sendto(record, address))


def _receiver(sock: socket.socket, messages: int, report: int, acknowledge: bool, answer_to: str | None) -> None:
    """The child: time each arrival, answer it, then report every latency to the parent. The
    loop does no more than a receiver must (read the record, take its timestamp), so that the
    figures are the transport's, not the interpreter's."""
    latencies = array.array("q", bytes(_LATENCY.size * messages))
    answer = KeyMessage(dest=SENDER_ID, task=0, src=RECEIVER_ID, tenant=BENCH_TENANT).pack()
    buffer = memoryview(bytearray(MESSAGE_BYTES))
    send = _send_to(sock, answer_to)
    for n in range(1, messages + 1):
        _recv_record(sock, buffer)
        latencies[n - 1] = now_ns() - _SENT_NS.unpack_from(buffer, _SENT_NS_AT)[0]
        send(answer)
        _received(sock, n, acknowledge)
    with open(report, "wb") as out:
        out.write(latencies.tobytes())


def _ping_pong(sender: socket.socket, receiver: socket.socket, messages: int, cpus: tuple[int, int],
               acknowledge: bool = False, idle_s: float = 0.0,
               addresses: tuple[str, str] | None = None) -> tuple[list[float], float]:
    """Each hand-off's latency (µs) and the CPU seconds both processes spent. ``addresses``:
    (the receiver's, the sender's) for sockets that are not connected."""
    original_affinity = os.sched_getaffinity(0)
    read_end, write_end = os.pipe()
    started = time.process_time()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code (pytest, the CLI)
        status = 1
        try:
            os.close(read_end)
            os.sched_setaffinity(0, {cpus[1]})
            _receiver(receiver, messages, write_end, acknowledge, addresses[1] if addresses else None)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        record = bytearray(KeyMessage(dest=RECEIVER_ID, task=0, src=SENDER_ID, tenant=BENCH_TENANT).pack())
        answer = memoryview(bytearray(MESSAGE_BYTES))
        send = _send_to(sender, addresses[0] if addresses else None)
        for n in range(1, messages + 1):
            if idle_s:
                time.sleep(idle_s)
            _SENT_NS.pack_into(record, _SENT_NS_AT, now_ns())
            send(record)
            _recv_record(sender, answer)
            _received(sender, n, acknowledge)
        with open(read_end, "rb") as report:  # to EOF before waiting: it may exceed a pipe's buffer
            raw = report.read()
    finally:
        os.sched_setaffinity(0, original_affinity)
        _, status, usage = os.wait4(pid, 0)
    cpu_s = time.process_time() - started + usage.ru_utime + usage.ru_stime
    if status != 0 or len(raw) != messages * _LATENCY.size:
        raise RuntimeError(f"the receiver failed (status {status}, {len(raw) // _LATENCY.size} of {messages} latencies)")
    return [value / 1000 for (value,) in _LATENCY.iter_unpack(raw)], cpu_s


@contextlib.contextmanager
def _tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as sender:
            receiver, _ = listener.accept()
            with receiver:
                for sock in (sender, receiver):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                yield sender, receiver


@contextlib.contextmanager
def _ebpf_pair(keymaps: ebpf.KeyMaps) -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two registered sockets, each connected to a fallback listener that should get nothing."""
    with socket.create_server(("127.0.0.1", 0)) as fallback, contextlib.ExitStack() as stack:
        ends = []
        for instance in (SENDER_ID, RECEIVER_ID):
            sock = stack.enter_context(socket.create_connection(fallback.getsockname()))
            stack.enter_context(fallback.accept()[0])  # the fallback's end stays open, unread
            keymaps.register(instance, BENCH_TENANT, sock)
            ends.append(sock)
        try:
            yield ends[0], ends[1]
        finally:
            for instance in (SENDER_ID, RECEIVER_ID):
                keymaps.unregister(instance)


def _run(transport: str, messages: int, cpus: tuple[int, int], keymaps: ebpf.KeyMaps | None,
         idle_s: float) -> tuple[list[float], float]:
    if transport == "unix":  # as UnixTransport: datagram sockets bound to paths, each send addressed
        with tempfile.TemporaryDirectory() as directory:
            addresses = (f"{directory}/{RECEIVER_ID}", f"{directory}/{SENDER_ID}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender, \
                    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
                receiver.bind(addresses[0])
                sender.bind(addresses[1])
                return _ping_pong(sender, receiver, messages, cpus, idle_s=idle_s, addresses=addresses)
    if transport == "tcp":
        with _tcp_pair() as (sender, receiver):
            return _ping_pong(sender, receiver, messages, cpus, idle_s=idle_s)
    if transport != "ebpf" or keymaps is None:
        raise ValueError(f"unknown transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    with _ebpf_pair(keymaps) as (sender, receiver):
        return _ping_pong(sender, receiver, messages, cpus, acknowledge=True, idle_s=idle_s)


@contextlib.contextmanager
def _keymaps(transports: Iterable[str], keymaps: ebpf.KeyMaps | None) -> Iterator[ebpf.KeyMaps | None]:
    """The channel to register the eBPF pair in: the one given, or one loaded for the run."""
    if keymaps is not None or "ebpf" not in transports:
        yield keymaps
        return
    own = ebpf.load(ebpf.BPFFS / f"lifl-bench-{os.getpid()}")
    try:
        yield own
    finally:
        own.close()


def channel_latency(transport: str, messages: int = MIN_MESSAGES, cpus: tuple[int, int] = PLACEMENTS["same-cpu"],
                    keymaps: ebpf.KeyMaps | None = None, idle_s: float = 0.0) -> Latency:
    """p50/p99 one-way latency of ``messages`` hand-offs over ``transport``, each after the
    receiver sat idle for ``idle_s`` (0: back to back). For ``ebpf``, pass a loaded channel's
    ``keymaps`` (its instances 1 and 2 are used), or one is loaded into a private pin directory
    for the run."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    with _keymaps([transport], keymaps) as loaded:
        return Latency.of([_run(transport, messages, cpus, loaded, idle_s)])


def compare(messages: int = MIN_MESSAGES, cpus: tuple[int, int] = PLACEMENTS["same-cpu"],
            keymaps: ebpf.KeyMaps | None = None, rounds: int = COMPARE_ROUNDS) -> dict[str, Latency]:
    """Every transport under the same conditions: ``messages`` hand-offs each, in ``rounds``
    runs taken in turn (ebpf, tcp, unix, ebpf, ...), so that drift hits all alike."""
    runs: dict[str, list[tuple[list[float], float]]] = {transport: [] for transport in TRANSPORTS}
    with _keymaps(TRANSPORTS, keymaps) as loaded:
        for r in range(rounds):
            for transport in TRANSPORTS:
                runs[transport].append(_run(transport, messages // rounds + (r < messages % rounds), cpus, loaded, 0.0))
    return {transport: Latency.of(runs[transport]) for transport in TRANSPORTS}


def sidecar_idle_cpu_s(seconds: float = IDLE_SECONDS) -> float:
    """CPU the eBPF transport's user-space side spends over ``seconds`` with two registered,
    silent instances: this process's CPU time while it only waits."""
    from lifl.store import Tenant

    keys = ebpf.EbpfTransport(f"bench{os.getpid()}", Path("/nonexistent"))
    try:
        for instance in (SENDER_ID, RECEIVER_ID):
            keys.provision(Tenant("bench", id=BENCH_TENANT), instance)[0].close()
        started = time.process_time()
        time.sleep(seconds)  # the measurement is of what happens meanwhile: nothing should
        return time.process_time() - started
    finally:
        keys.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--messages", type=int, default=MIN_MESSAGES, help=f"hand-offs per measurement (default {MIN_MESSAGES})")
    p.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS, help="the idle interval (default 10 s)")


def main(args: argparse.Namespace) -> int:
    if (why_not := ebpf.available()) is not None:
        print(f"lifl bench channel: the eBPF transport cannot run here: {why_not}", file=sys.stderr)
        return 2
    if args.messages < MIN_MESSAGES or os.cpu_count() is None or os.cpu_count() < 2:  # type: ignore[operator]
        print(f"lifl bench channel: needs --messages >= {MIN_MESSAGES} and two CPUs", file=sys.stderr)
        return 2
    results = []
    for placement, cpus in PLACEMENTS.items():
        for transport, latency in compare(args.messages, cpus).items():
            results.append({"channel": transport, "placement": placement, "messages": latency.messages,
                            "p50_us": round(latency.p50_us, 2), "p99_us": round(latency.p99_us, 2),
                            "cpu_us_per_msg": round(latency.cpu_us_per_msg, 2)})
    woken = []  # what a hand-off to an aggregator that sat idle costs: the wake-up of an idle CPU
    for transport in TRANSPORTS:
        latency = channel_latency(transport, WOKEN_MESSAGES, PLACEMENTS["cross-cpu"], idle_s=WOKEN_IDLE_S)
        woken.append({"channel": transport, "idle_ms": WOKEN_IDLE_S * 1e3, "messages": latency.messages,
                      "p50_us": round(latency.p50_us, 2), "p99_us": round(latency.p99_us, 2)})
    same_cpu = {r["channel"]: r["p50_us"] for r in results if r["placement"] == "same-cpu"}
    report = {"benchmark": "channel", "results": results, "woken": woken,
              "sidecar_idle_cpu_s": round(sidecar_idle_cpu_s(args.idle_seconds), 4),
              "targets_met": {"ebpf_vs_unix": same_cpu["ebpf"] <= same_cpu["unix"],
                              "ebpf_vs_tcp": same_cpu["ebpf"] <= TCP_TARGET * same_cpu["tcp"]}}
    if args.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(f"{r['channel']:5} {r['placement']:9}  p50 {r['p50_us']:7.2f} µs  p99 {r['p99_us']:7.2f} µs  "
                  f"{r['cpu_us_per_msg']:6.2f} CPU-µs per message")
        for r in woken:
            print(f"{r['channel']:5} woken after {r['idle_ms']:g} ms idle  p50 {r['p50_us']:7.2f} µs  p99 {r['p99_us']:7.2f} µs")
        print(f"targets (same CPU, p50: eBPF <= unix, eBPF <= {TCP_TARGET} x TCP): {report['targets_met']}")
        print(f"eBPF sidecar idle CPU over {args.idle_seconds:g} s: {report['sidecar_idle_cpu_s']} s")
    return 0
