"""The clients of `lifl bench throughput`: one process drives many keep-alive connections from
one thread (selectors), over HTTP/1.1 or gRPC, each with one update in flight at a time.

Clients must cost little, or they take the CPU the systems under test need (two cores in all
here): each update's request is its head (or its HTTP/2 HEADERS and meta message) built from
prebuilt parts, followed by the body straight from one of a few prebuilt blobs, written with
``sendmsg``; a 202 is recognised from its status line without parsing its body.

Each update names its own client (``X-Lifl-Client``: a round takes one update per client) and
one of ``VARIANTS`` blobs with a sample count from ``sample_count``, so that the parent can
compute the exact FedAvg of a round from what each process reports it had acknowledged.

Control, one JSON object per line: this process says ``{"ready": true}`` once connected; the parent writes ``{"version": v}`` (send updates trained
from version v; with ``"limit": n``, n updates in all, then say ``{"finished": true}``) and
``{"stop": true}`` on stdin; this process writes ``{"waiting": v}`` the first time a round of
version v refuses an update because it is full or closed, and at the end ``{"report": ...}``
(see ``Report``).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.net import lifl_pb2 as pb
from lifl.net import h2
from lifl.net.grpc import chunk_messages
from lifl.net.io import take_views

VARIANTS = 4  # distinct blobs per process
REFUSED_WAIT = ("round_full", "round_closed")  # the round cannot take more: wait for the next version
RETRY_DELAY_S = 0.005  # after an error that may pass (overloaded, unavailable)
GRPC_CHUNK = 1 << 20  # data bytes per UpdateChunk message
RECEIVE_BYTES = 1 << 16
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *([0-9]+)", re.IGNORECASE)
CLIENT_LIMITS = h2.Limits(max_frame_size=h2.DEFAULT_MAX_FRAME_SIZE, stream_window=1 << 24)


def sample_count(seq: int) -> int:
    """The sample count (FedAvg weight) of a process's ``seq``-th update: weights differ."""
    return 1 + seq % 7


def variant_blobs(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> list[bytes]:
    """The ``VARIANTS`` update blobs of the process seeded ``seed`` (the parent makes the same)."""
    rng = np.random.default_rng(seed)
    return [fmt.encode({name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes})
            for _ in range(VARIANTS)]


@dataclass
class Config:
    protocol: str  # "http" or "grpc"
    address: str  # host:port
    job: str
    token: str  # "" sends no Authorization
    shapes: list[tuple[str, tuple[int, ...]]]
    seed: int
    connections: int
    name: str  # prefix of the client ids

    @classmethod
    def from_json(cls, text: str) -> Config:
        raw = json.loads(text)
        raw["shapes"] = [(n, tuple(s)) for n, s in raw["shapes"]]
        return cls(**raw)


@dataclass
class RoundAcks:
    count: int = 0
    first_sent: float = float("inf")
    last_ack: float = 0.0
    samples: list[int] = field(default_factory=lambda: [0] * VARIANTS)  # acknowledged samples per variant


@dataclass
class Outcome:
    """What one request came to: acknowledged (``code`` "") or refused with ``code``;
    ``version``: the current version the server named, if it did."""

    code: str
    version: int | None = None


class Report:
    def __init__(self) -> None:
        self.rounds: dict[int, RoundAcks] = defaultdict(RoundAcks)
        self.latencies_ms: list[float] = []
        self.refused: dict[str, int] = defaultdict(int)

    def to_json(self) -> dict[str, Any]:
        return {"rounds": {v: vars(r) for v, r in self.rounds.items()}, "latencies_ms": self.latencies_ms,
                "refused": dict(self.refused)}


class _Update:
    """One update in flight."""

    __slots__ = ("seq", "variant", "samples", "version", "sent")

    def __init__(self, seq: int, version: int) -> None:
        self.seq, self.variant, self.samples, self.version = seq, seq % VARIANTS, sample_count(seq), version
        self.sent = time.monotonic()


class HttpConnection:
    def __init__(self, config: Config, blobs: list[bytes]) -> None:
        host, port = config.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        auth = f"Authorization: Bearer {config.token}\r\n" if config.token else ""
        self._head = (f"POST /v1/jobs/{config.job}/updates HTTP/1.1\r\nHost: {config.address}\r\n{auth}"
                      "Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n"
                      "X-Lifl-Samples: {samples}\r\nX-Lifl-Base-Version: {version}\r\nX-Lifl-Client: {client}\r\n\r\n")
        self._blobs = blobs
        self._out: deque[memoryview] = deque()
        self._in = bytearray()
        self.closing = False  # the server said it closes the connection after its answer

    def start(self, update: _Update, client: str) -> None:
        blob = self._blobs[update.variant]
        head = self._head.format(length=len(blob), samples=update.samples, version=update.version, client=client)
        self._out.extend((memoryview(head.encode()), memoryview(blob)))

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def write(self) -> None:
        sent = self.sock.sendmsg(list(self._out))
        take_views(self._out, sent)

    def read(self) -> Outcome | None:
        data = self.sock.recv(RECEIVE_BYTES)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._in += data
        end = self._in.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self._in[: end + 4])
        length = _CONTENT_LENGTH.search(head)
        total = end + 4 + (int(length.group(1)) if length else 0)
        if len(self._in) < total:
            return None
        body = bytes(self._in[end + 4 : total])
        del self._in[:total]
        self.closing = b"\r\nconnection: close" in head.lower()
        status = _STATUS_LINE.match(head)
        if status is None:
            raise ConnectionError(f"not an HTTP response: {head[:40]!r}")
        if status.group(1) in (b"200", b"202"):
            return Outcome("")
        error = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
        return Outcome(str(error.get("code", f"http_{status.group(1).decode()}")), error.get("version"))


class GrpcConnection:
    def __init__(self, config: Config, blobs: list[bytes]) -> None:
        host, port = config.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self._config = config
        self._blobs = blobs
        self._metadata = [("authorization", f"Bearer {config.token}")] if config.token else []
        self._h2 = h2.Connection(h2.Side.CLIENT, CLIENT_LIMITS)
        self._h2.initiate()
        self._out: deque[memoryview] = deque([memoryview(self._h2.data_to_send())])
        self._stream = 0
        self._messages: deque[memoryview] = deque()  # the call's message bytes not yet framed
        self._unframed = 0
        self._ended = True  # the current call's END_STREAM is framed
        self._settings_seen = False
        self.closing = False  # (the server ends HTTP/2 connections with GOAWAY, which fails the run)

    def start(self, update: _Update, client: str) -> None:
        c = self._config
        meta = pb.UpdateMeta(job=c.job, client=client, samples=update.samples, base_version=update.version,
                             size=len(self._blobs[update.variant])).SerializeToString()
        self._stream = self._h2.new_stream_id()
        self._h2.send_headers(self._stream, [
            (":method", "POST"), (":scheme", "http"), (":path", "/lifl.v1.Gateway/PushUpdate"),
            (":authority", c.address), ("content-type", "application/grpc"), ("te", "trailers"), *self._metadata])
        for parts in chunk_messages(meta, self._blobs[update.variant], GRPC_CHUNK):
            self._messages.extend(memoryview(p).cast("B") for p in parts)
        self._unframed = sum(len(v) for v in self._messages)
        self._ended = False
        self._frame()

    def _frame(self) -> None:
        """Frame as much of the call's messages as the windows allow (the end of the stream too)."""
        if self._h2.has_data_to_send:
            self._out.append(memoryview(self._h2.data_to_send()))
        if not self._stream or not self._settings_seen:
            return
        while self._unframed:
            window = self._h2.send_window(self._stream)
            if window <= 0:
                return
            n = min(self._unframed, window, self._h2.peer_max_frame_size)
            self._out.append(memoryview(self._h2.send_data(self._stream, n)))
            self._out.extend(take_views(self._messages, n))
            self._unframed -= n
        if not self._ended:
            self._out.append(memoryview(self._h2.send_data(self._stream, 0, end_stream=True)))
            self._ended = True

    @property
    def sending(self) -> bool:
        return bool(self._out)

    def write(self) -> None:
        sent = self.sock.sendmsg(list(self._out))
        take_views(self._out, sent)

    def read(self) -> Outcome | None:
        data = self.sock.recv(RECEIVE_BYTES)
        if not data:
            raise ConnectionError("the server closed the connection")
        outcome = None
        for ev in self._h2.receive_bytes(data):
            if isinstance(ev, h2.SettingsReceived):
                self._settings_seen = True
            elif isinstance(ev, h2.GoAwayReceived):
                raise ConnectionError(f"GOAWAY: {ev.debug[:200]!r}")
            elif getattr(ev, "stream_id", None) != self._stream:
                continue
            elif isinstance(ev, h2.StreamReset):
                raise ConnectionError(f"the server reset the call (error {ev.error_code})")
            elif isinstance(ev, h2.HeadersReceived) and ev.end_stream:
                trailers = dict(ev.headers)
                self._stream, self._ended, self._unframed = 0, True, 0
                self._messages.clear()
                if trailers.get("grpc-status") == "0":
                    outcome = Outcome("")
                else:
                    version = trailers.get("lifl-version")
                    outcome = Outcome(trailers.get("lifl-error-code", f"grpc_{trailers.get('grpc-status')}"),
                                      int(version) if version else None)
        if outcome is None:
            self._frame()
        elif self._h2.has_data_to_send:
            self._out.append(memoryview(self._h2.data_to_send()))
        return outcome


Connection = HttpConnection | GrpcConnection


class Load:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.blobs = variant_blobs(config.shapes, config.seed)
        self._kind = HttpConnection if config.protocol == "http" else GrpcConnection
        self.connections: list[Connection] = [self._kind(config, self.blobs) for _ in range(config.connections)]
        self.selector = selectors.DefaultSelector()
        self.version: int | None = None
        self.stopped = False
        self.report = Report()
        self._seq = 0
        self._limit: int | None = None  # updates to send in all, if the parent set a limit
        self._said_finished = False  # ...and they are all answered
        self._waiting_for: set[int] = set()  # versions we told the parent we wait past
        self._inflight: dict[Connection, _Update] = {}
        self._idle: deque[Connection] = deque(self.connections)
        self._retry_at: list[tuple[float, Connection]] = []
        self._control = bytearray()

    def run(self) -> None:
        os.set_blocking(sys.stdin.fileno(), False)
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
        for conn in self.connections:
            self.selector.register(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE * conn.sending, conn)
        print(json.dumps({"ready": True}), flush=True)
        while not self.stopped:
            self._start_idle()
            timeout = None
            if self._retry_at:
                timeout = max(0.0, min(t for t, _ in self._retry_at) - time.monotonic())
            for key, mask in self.selector.select(timeout):
                conn = key.data
                if conn is None:
                    self._read_control()
                    continue
                if mask & selectors.EVENT_WRITE:
                    conn.write()
                if mask & selectors.EVENT_READ:
                    outcome = conn.read()
                    if outcome is not None:
                        if conn.closing:  # a baseline closes the connection after an error
                            conn = self._reconnect(conn)
                        self._finished(conn, outcome)
                self._watch(conn)
            now = time.monotonic()
            due = [c for t, c in self._retry_at if t <= now]
            self._retry_at = [(t, c) for t, c in self._retry_at if t > now]
            self._idle.extend(due)
        print(json.dumps({"report": {"seed": self.config.seed, **self.report.to_json()}}), flush=True)

    def _reconnect(self, conn: Connection) -> Connection:
        """A new connection in place of ``conn`` (its update in flight moves with it)."""
        self.selector.unregister(conn.sock)
        conn.sock.close()
        fresh = self._kind(self.config, self.blobs)
        self.connections[self.connections.index(conn)] = fresh
        self._inflight[fresh] = self._inflight.pop(conn)
        self.selector.register(fresh.sock, selectors.EVENT_READ, fresh)
        return fresh

    def _watch(self, conn: Connection) -> None:
        self.selector.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.sending else 0), conn)

    def _start_idle(self) -> None:
        if self.version is None:
            return
        while self._idle:
            if self._limit is not None and self._seq >= self._limit:
                if not self._inflight and not self._said_finished:
                    self._said_finished = True
                    print(json.dumps({"finished": True}), flush=True)
                return
            conn = self._idle.popleft()
            self._seq += 1
            update = _Update(self._seq, self.version)
            self._inflight[conn] = update
            conn.start(update, f"{self.config.name}-{self._seq}")
            self._watch(conn)

    def _finished(self, conn: Connection, outcome: Outcome) -> None:
        update = self._inflight.pop(conn)
        now = time.monotonic()
        if not outcome.code:
            acks = self.report.rounds[update.version]
            acks.count += 1
            acks.first_sent = min(acks.first_sent, update.sent)
            acks.last_ack = now
            acks.samples[update.variant] += update.samples
            self.report.latencies_ms.append((now - update.sent) * 1e3)
            self._idle.append(conn)
            return
        self.report.refused[outcome.code] += 1
        if outcome.code == "version_conflict" and outcome.version is not None:
            # sent before we heard of the new version, or the server is ahead of the parent's word
            self.version = max(self.version if self.version is not None else -1, outcome.version)
            self._idle.append(conn)
        elif outcome.code in REFUSED_WAIT:
            full = outcome.version if outcome.version is not None else update.version
            if self.version is not None and self.version <= full:
                self.version = None  # until the parent says which version is next
            self._idle.append(conn)
            if full not in self._waiting_for:
                self._waiting_for.add(full)
                print(json.dumps({"waiting": full}), flush=True)
        else:
            self._retry_at.append((now + RETRY_DELAY_S, conn))

    def _read_control(self) -> None:
        data = os.read(sys.stdin.fileno(), 1 << 16)
        if not data:
            self.stopped = True
            return
        self._control += data
        while (end := self._control.find(b"\n")) >= 0:
            line, self._control = bytes(self._control[:end]), self._control[end + 1 :]
            message = json.loads(line)
            if message.get("stop"):
                self.stopped = True
            elif "version" in message and (self.version is None or message["version"] > self.version):
                self.version = int(message["version"])
                self._limit = message.get("limit")


def main() -> None:
    Load(Config.from_json(sys.argv[1])).run()


if __name__ == "__main__":
    main()
