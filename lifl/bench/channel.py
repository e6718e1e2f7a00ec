"""One-way latency of a 64-byte key message between two processes, per transport.

- ``ebpf``: TCP sockets in the eBPF key channel's sockhash; the SK_MSG verdict redirects each
  message into the receiver's queue (lifl/ebpf.py; needs root and the built object);
- ``tcp``: the same bytes over a plain loopback TCP connection (TCP_NODELAY);
- ``unix``: an AF_UNIX datagram socket pair, what ``UnixTransport`` uses.

Ping-pong: the sender stamps CLOCK_MONOTONIC into the record and sends; the receiver (a forked
process) takes the difference on arrival and answers over the same transport, and only then
does the next message go, so each figure is one hand-off, never a queue. Both processes are
pinned to one CPU, as a node's aggregators often share one: a hand-off includes the wake-up
of the receiver and the switch to it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import struct
from collections.abc import Iterator
from typing import NamedTuple

from lifl import ebpf
from lifl.channel import KIND_ACK, MESSAGE_BYTES, KeyMessage, now_ns

TRANSPORTS = ("ebpf", "tcp", "unix")
SENDER_ID, RECEIVER_ID, BENCH_TENANT = 1, 2, 1
_LATENCY = struct.Struct("<q")  # one measured latency, ns, from the receiver to the parent


class Latency(NamedTuple):
    messages: int
    p50_us: float
    p99_us: float


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed mid-message")
        data += chunk
    return data


_ACK = KeyMessage(dest=0, task=0, kind=KIND_ACK, count=ebpf.ACK_EVERY, tenant=BENCH_TENANT).pack()


def _received(sock: socket.socket, received: int, acknowledge: bool) -> None:
    """eBPF: give the sender its credits back every ACK_EVERY messages, as EbpfEndpoint does."""
    if acknowledge and received % ebpf.ACK_EVERY == 0:
        sock.send(_ACK)


def _receiver(sock: socket.socket, messages: int, report: int, acknowledge: bool) -> None:
    """The child: time each arrival, answer it, then report every latency to the parent."""
    latencies = bytearray()
    answer = KeyMessage(dest=SENDER_ID, task=0, src=RECEIVER_ID, tenant=BENCH_TENANT).pack()
    for n in range(1, messages + 1):
        message = KeyMessage.unpack(_recv_exact(sock, MESSAGE_BYTES))
        latencies += _LATENCY.pack(now_ns() - message.sent_ns)
        sock.send(answer)
        _received(sock, n, acknowledge)
    with open(report, "wb") as out:
        out.write(latencies)


def _ping_pong(sender: socket.socket, receiver: socket.socket, messages: int, cpu: int, acknowledge: bool = False) -> Latency:
    original_affinity = os.sched_getaffinity(0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code (pytest, the CLI)
        status = 1
        try:
            os.close(read_end)
            os.sched_setaffinity(0, {cpu})
            _receiver(receiver, messages, write_end, acknowledge)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    try:
        os.sched_setaffinity(0, {cpu})
        for n in range(1, messages + 1):
            sender.send(KeyMessage(dest=RECEIVER_ID, task=0, src=SENDER_ID, tenant=BENCH_TENANT, sent_ns=now_ns()).pack())
            _recv_exact(sender, MESSAGE_BYTES)
            _received(sender, n, acknowledge)
        with open(read_end, "rb") as report:  # to EOF before waiting: it may exceed a pipe's buffer
            raw = report.read()
    finally:
        os.sched_setaffinity(0, original_affinity)
        _, status = os.waitpid(pid, 0)
    if status != 0 or len(raw) != messages * _LATENCY.size:
        raise RuntimeError(f"the receiver failed (status {status}, {len(raw) // _LATENCY.size} of {messages} latencies)")
    latencies_us = sorted(value / 1000 for (value,) in _LATENCY.iter_unpack(raw))
    percentiles = statistics.quantiles(latencies_us, n=100)
    return Latency(messages, percentiles[49], percentiles[98])


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


def channel_latency(transport: str, messages: int = 10_000, cpu: int = 0,
                    keymaps: ebpf.KeyMaps | None = None) -> Latency:
    """p50/p99 one-way latency of ``messages`` hand-offs over ``transport``. For ``ebpf``,
    pass a loaded channel's ``keymaps`` (its instances 1 and 2 are used), or one is loaded
    into a private pin directory for the run."""
    if transport == "unix":
        sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        with sender, receiver:
            return _ping_pong(sender, receiver, messages, cpu)
    if transport == "tcp":
        with _tcp_pair() as (sender, receiver):
            return _ping_pong(sender, receiver, messages, cpu)
    if transport != "ebpf":
        raise ValueError(f"unknown transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    if keymaps is not None:
        with _ebpf_pair(keymaps) as (sender, receiver):
            return _ping_pong(sender, receiver, messages, cpu, acknowledge=True)
    own = ebpf.load(ebpf.BPFFS / f"lifl-bench-{os.getpid()}")
    try:
        with _ebpf_pair(own) as (sender, receiver):
            return _ping_pong(sender, receiver, messages, cpu, acknowledge=True)
    finally:
        own.close()


def compare(messages: int = 10_000, cpu: int = 0, keymaps: ebpf.KeyMaps | None = None) -> dict[str, Latency]:
    """Every transport, one after another, under the same conditions."""
    return {transport: channel_latency(transport, messages, cpu, keymaps) for transport in TRANSPORTS}
