"""Every limit of the HTTP/1.1 front end and of the connection layer under it, at the limit and
one past it, against real gateway processes started with small limits through their flags.

Nothing here sleeps to synchronise: tests wait for what the gateway says (a response, a
closed connection, a job's status) with generous deadlines, and the only sleeps are the
pace of a deliberately slow client."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, wait_for
from lifl import format as fmt
from lifl.auth import Tokens
from lifl.errors import Conflict, Overloaded
from lifl.gateway.http import MAX_CHUNK_LINE, MAX_HEAD, MAX_HEADER_FIELDS, MAX_HEADER_LINE
from lifl.gateway.ingest import IDLE_CHECKERS, BlobSink, LayoutCache
from lifl.gateway.stream import RateMeter
from lifl.node.supervisor import Child
from lifl.state import ClusterState
from lifl.store import MappingCache
from test_http import read_response, update_head

# An update big enough that a trickling client never finishes it, small enough to send at once.
MODEL = {"w": np.zeros(4096, np.float32)}
UPDATE = fmt.encode({"w": np.ones(4096, np.float32)})
ATTACKERS = tuple(f"127.0.0.{i}" for i in range(2, 7))  # loopback source addresses other than the checker's


AUTH = f"Authorization: Bearer {OPERATOR_TOKEN}\r\n".encode()  # a line of a request head


class Gateway:
    """A gateway process of its own, with limits set by flags (the node's gateway keeps the defaults)."""

    def __init__(self, redis_url: str, agent_socket: str, flags: dict[str, object]) -> None:
        Tokens(ClusterState(redis_url).redis).register_operator(OPERATOR_TOKEN)
        argv = [sys.executable, "-m", "lifl.gateway", "--node", "lim", "--redis", redis_url, "--agent-socket", agent_socket,
                "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]
        for flag, value in flags.items():
            argv += [f"--{flag.replace('_', '-')}", str(value)]
        self.child = Child("gateway", argv, ready="{", log=sys.stderr)
        self.child.start()
        host, _, port = json.loads(self.child.ready_line)["http"].rpartition(":")
        self.address = (host, int(port))

    @property
    def pid(self) -> int:
        assert self.child.proc is not None
        return self.child.proc.pid

    def connect(self, source: str = "127.0.0.1", timeout: float = 30) -> socket.socket:
        return socket.create_connection(self.address, timeout=timeout, source_address=(source, 0))

    def exchange(self, data: bytes, source: str = "127.0.0.1") -> tuple[int, dict]:
        """One request on a connection of its own, which is gone from the gateway's count on return
        (the next connections are counted against the limits without it)."""
        with self.connect(source) as s:
            s.sendall(data)
            response = read_response(s)
            s.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(65536):  # until the gateway closes its side
                    pass
            return response

    def alive(self) -> bool:
        return self.child.proc is not None and self.child.proc.poll() is None

    def memory(self, field: str) -> int:
        """A /proc/PID/status figure in bytes (VmRSS: resident now; VmHWM: peak since reset)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")

    def reset_peak_memory(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path) -> Iterator:
    """Start gateways with flags, without an agent: enough for everything before a blob's header."""
    started: list[Gateway] = []

    def start(**flags: object) -> Gateway:
        started.append(Gateway(redis_url, str(tmp_path / "no-agent.sock"), flags))
        return started[-1]

    yield start
    for g in started:
        assert g.alive(), "the gateway died"
        g.child.stop()


@pytest.fixture
def node_gateway(node: RunningNode) -> Iterator:
    """Start gateways with flags on a real node (its agent admits blobs)."""
    started: list[Gateway] = []

    def start(**flags: object) -> Gateway:
        assert node.node.addresses is not None
        started.append(Gateway(node.node.addresses.redis, str(node.node.run_dir / "agent.sock"), flags))
        return started[-1]

    yield start
    for g in started:
        assert g.alive(), "the gateway died"
        g.child.stop()


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"


def health_check_head(*, size: int | None = None, fields: int | None = None, line: int | None = None) -> bytes:
    """A health check whose head is ``size`` bytes, or has ``fields`` fields, or a line of ``line`` bytes."""
    if fields is not None:
        return HEALTH + b"".join(b"X-F%d: v\r\n" % i for i in range(fields - 1)) + b"\r\n"
    if line is not None:
        return HEALTH + b"X-Long: " + b"a" * (line - 8) + b"\r\n\r\n"
    assert size is not None
    out, left = HEALTH, size - len(HEALTH) - 2
    while left:
        n = min(left, MAX_HEADER_LINE + 2)  # a filler line with its CRLF
        if left - n and left - n < 8:  # leave room for a last line of at least "X-P:" and CRLF
            n -= 8
        out += b"X-P:" + b"a" * (n - 6) + b"\r\n"
        left -= n
    return out + b"\r\n"


# -- the head: bytes, fields, line length -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("head,status,code", [
    (health_check_head(size=MAX_HEAD), 200, None),
    (health_check_head(size=MAX_HEAD + 1), 431, "head_too_large"),
    (health_check_head(fields=MAX_HEADER_FIELDS), 200, None),
    (health_check_head(fields=MAX_HEADER_FIELDS + 1), 431, "too_many_headers"),
    (health_check_head(line=MAX_HEADER_LINE), 200, None),
    (health_check_head(line=MAX_HEADER_LINE + 1), 431, "header_line_too_long"),
    (health_check_head(line=1 << 20), 431, "head_too_large"),  # a 1 MB line: answered, not dropped
    (HEALTH + b"X-F: v\r\n" * 10_000 + b"\r\n", 431, "head_too_large"),  # 10,000 fields, 80 KB
], ids=["head-at-limit", "head-past", "fields-at-limit", "fields-past", "line-at-limit", "line-past", "line-1MB",
        "fields-10000"])
def test_head_limits(gateway, head: bytes, status: int, code: str | None) -> None:
    g = gateway()
    if code is None:
        assert len(head) <= MAX_HEAD
    got, body = g.exchange(head)
    assert (got, body.get("error", {}).get("code")) == (status, code)
    assert g.exchange(HEALTH + b"\r\n")[0] == 200


@pytest.mark.slow
@pytest.mark.parametrize("extension,status", [(MAX_CHUNK_LINE - 3, 201), (MAX_CHUNK_LINE - 2, 400)], ids=["at-limit", "past"])
def test_chunk_size_line_limit(gateway, extension: int, status: int) -> None:
    g = gateway()
    body = b'{"job": "c", "goal": 1}'
    size_line = b"%x;" % len(body) + b"e" * extension  # hex size (2 digits), ';', then the extension
    assert len(size_line) == extension + 3
    got, reply = g.exchange(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                            + size_line + b"\r\n" + body + b"\r\n0\r\n\r\n")
    assert got == status and (status == 201 or reply["error"]["code"] == "bad_chunk")


# -- time: head deadline, idle keep-alive, body rate ---------------------------------------------
@pytest.mark.slow
def test_head_deadline(gateway) -> None:
    g = gateway(head_timeout=1)
    with g.connect() as s:  # within the deadline, in pieces
        s.sendall(HEALTH)
        s.sendall(b"\r\n")
        assert read_response(s)[0] == 200
    with g.connect() as s:  # a head that never ends: cut at the deadline, though bytes keep coming
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        stop = threading.Event()
        trickle = threading.Thread(target=_trickle, args=(s, b"X-Slow: " + b"a" * 10_000, 0.1, stop), daemon=True)
        trickle.start()
        status, body = read_response(s)
        stop.set()
        assert (status, body["error"]["code"]) == (408, "head_timeout")


@pytest.mark.slow
def test_idle_keep_alive_timeout(gateway) -> None:
    g = gateway(idle_timeout=1)
    with g.connect() as s:
        s.sendall(HEALTH + b"\r\n")
        assert read_response(s)[0] == 200
        s.sendall(HEALTH + b"\r\n")  # the next request on the same connection, well within the idle time
        assert read_response(s)[0] == 200
        assert s.recv(1) == b""  # then nothing: the gateway closes the connection


def _trickle(s: socket.socket, data: bytes, pause: float, stop: threading.Event) -> None:
    """A client sending one byte every ``pause`` seconds until told to stop or cut off."""
    for i in range(len(data)):
        if stop.wait(pause):
            return
        try:
            s.sendall(data[i : i + 1])
        except OSError:
            return


@pytest.mark.slow
def test_trickling_upload_is_cut_and_its_round_slot_released(node: RunningNode, node_gateway) -> None:
    g = node_gateway(min_body_rate=1000, body_grace=1, body_window=5)
    assert node.json("POST", "/v1/jobs", {"job": "t", "goal": 1})[0] == 201
    assert node.json("PUT", "/v1/jobs/t/model", fmt.encode(MODEL))[0] == 201
    header = fmt.parse_layout(UPDATE).data_start
    with g.connect() as slow:
        slow.sendall(update_head(job="t", length=len(UPDATE), **{"X-Lifl-Client": "slow"}) + UPDATE[:header])
        stop = threading.Event()
        threading.Thread(target=_trickle, args=(slow, UPDATE[header:], 0.2, stop), daemon=True).start()
        status, body = read_response(slow)  # 5 bytes/s: cut after the grace and a window
        stop.set()
    assert (status, body["error"]["code"]) == (408, "body_timeout")
    round_ = node.json("GET", "/v1/jobs/t")[1]["round"]
    assert round_["rejected"] == {"body_timeout": 1}  # it had been admitted, and was aborted
    assert round_["in_progress"] == 0
    with g.connect() as steady:  # at 10x the minimum rate, over several windows: accepted
        steady.sendall(update_head(job="t", length=len(UPDATE), **{"X-Lifl-Client": "steady"}))
        for i in range(0, len(UPDATE), 1000):
            steady.sendall(UPDATE[i : i + 1000])
            time.sleep(0.1)  # the client's pace
        assert read_response(steady)[0] == 202
    wait_for(lambda: node.json("GET", "/v1/jobs/t")[1]["version"] == 1, what="the honest update's round")


def test_rate_meter_at_the_minimum_rate_and_below_it() -> None:
    rate, grace, window = 1000.0, 2.0, 5.0
    exact, slow = RateMeter(rate, grace, window), RateMeter(rate, grace, window)
    waited, late_after = 0.0, None
    for _ in range(800):  # 100 s of waiting, 1/8 s at a time (exact in binary floating point)
        waited += 1 / 8
        exact.waited(1 / 8, 125)  # exactly the rate: never behind
        assert exact.time_left() >= window
        slow.waited(1 / 8, 112.5)  # 10 % below: a window's worth (5000 bytes) behind 50 s after the grace
        if late_after is None and slow.time_left() <= 0:
            late_after = waited
    assert late_after == grace + window * rate / 100
    burst = RateMeter(rate, grace, window)
    assert burst.time_left() == grace + window  # nothing asked during the grace
    burst.waited(grace, 0)
    burst.waited(0.0, 10**9)  # a burst does not buy more than a window of stalling
    assert burst.time_left() == window
    assert RateMeter(0.0, grace, window).time_left() == float("inf")  # no minimum


# -- connections: per peer, in total, health checks on the reserve --------------------------------
def _busy(g: Gateway, source: str) -> socket.socket:
    """A connection with a request in progress: a model upload waiting for its body (on a node)."""
    s = g.connect(source)
    s.sendall(b"PUT /v1/jobs/m/model HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n")
    assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")  # the gateway is reading its body
    return s


def _closed_by_gateway(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_per_peer_limit_evicts_the_peers_oldest_idle_connection(gateway) -> None:
    g = gateway(max_connections_per_peer=4, max_connections=64, reserved_connections=2, min_body_rate=0)
    with contextlib.ExitStack() as stack:
        idle = [stack.enter_context(g.connect(ATTACKERS[0])) for _ in range(4)]  # at the limit: all served
        for s in idle:
            s.sendall(HEALTH + b"\r\n")
            assert read_response(s)[0] == 200
        extra = stack.enter_context(g.connect(ATTACKERS[0]))  # one past: the oldest idle one makes room
        extra.sendall(HEALTH + b"\r\n")
        assert read_response(extra)[0] == 200
        assert _closed_by_gateway(idle[0])
        for s in idle[1:]:
            s.sendall(HEALTH + b"\r\n")
            assert read_response(s)[0] == 200
        assert g.exchange(HEALTH + b"\r\n", ATTACKERS[1])[0] == 200  # other peers are not affected


@pytest.mark.slow
def test_peer_at_its_limit_with_requests_in_progress_gets_only_health_checks(node_gateway) -> None:
    g = node_gateway(max_connections_per_peer=4, max_connections=64, reserved_connections=2, min_body_rate=0)
    assert g.exchange(b'POST /v1/jobs HTTP/1.1\r\nHost: x\r\n' + AUTH + b'Content-Length: 23\r\n\r\n{"job": "m", "goal": 1}')[0] == 201
    with contextlib.ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(_busy(g, ATTACKERS[0]))
        assert g.exchange(HEALTH + b"\r\n", ATTACKERS[0])[0] == 200  # on a reserved connection
        status, body = g.exchange(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n", ATTACKERS[0])
        assert (status, body["error"]["code"]) == (503, "too_many_connections")
        assert g.exchange(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n", ATTACKERS[1])[0] == 200


@pytest.mark.slow
def test_total_limit_evicts_from_the_biggest_peer_and_health_checks_get_through(node_gateway) -> None:
    g = node_gateway(max_connections=8, max_connections_per_peer=6, reserved_connections=2, min_body_rate=0)
    assert g.exchange(b'POST /v1/jobs HTTP/1.1\r\nHost: x\r\n' + AUTH + b'Content-Length: 23\r\n\r\n{"job": "m", "goal": 1}')[0] == 201
    with contextlib.ExitStack() as stack:
        big = [stack.enter_context(g.connect(ATTACKERS[0])) for _ in range(6)]
        small = [stack.enter_context(g.connect(ATTACKERS[1])) for _ in range(2)]
        for s in big + small:  # at the limit: all eight are served
            s.sendall(HEALTH + b"\r\n")
            assert read_response(s)[0] == 200
        assert g.exchange(HEALTH + b"\r\n")[0] == 200  # one past: room made on the biggest peer
        assert _closed_by_gateway(big[0])
        for s in big[1:] + small:
            s.sendall(HEALTH + b"\r\n")
            assert read_response(s)[0] == 200
    with contextlib.ExitStack() as stack:  # every slot busy with a request: the reserve answers health checks
        for i in range(8):
            stack.enter_context(_busy(g, ATTACKERS[i % 2]))
        for _ in range(5):
            assert g.exchange(HEALTH + b"\r\n")[0] == 200
        status, body = g.exchange(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        assert (status, body["error"]["code"]) == (503, "too_many_connections")


@pytest.mark.slow
def test_over_every_limit_connections_are_refused_from_the_accept_loop(node_gateway) -> None:
    g = node_gateway(max_connections=2, max_connections_per_peer=2, reserved_connections=0, min_body_rate=0)
    assert g.exchange(b'POST /v1/jobs HTTP/1.1\r\nHost: x\r\n' + AUTH + b'Content-Length: 23\r\n\r\n{"job": "m", "goal": 1}')[0] == 201
    with _busy(g, ATTACKERS[0]), _busy(g, ATTACKERS[1]), g.connect() as refused:
        status, body = read_response(refused)  # sent at once, before the client says anything
        assert (status, body["error"]["code"]) == (503, "too_many_connections")


@pytest.mark.slow
def test_health_checks_answer_while_1100_connections_trickle(gateway) -> None:
    """The issue's attack: 1,100 connections that each sent a byte of a head and then wait, from
    a few addresses, against the default limits; health checks from elsewhere keep working."""
    g = gateway()
    sockets: list[socket.socket] = []
    try:
        for i in range(1100):
            s = g.connect(ATTACKERS[i % len(ATTACKERS)])
            s.sendall(b"G")
            sockets.append(s)
        latencies = []
        for _ in range(20):
            start = time.perf_counter()
            assert g.exchange(HEALTH + b"\r\n")[0] == 200
            latencies.append(time.perf_counter() - start)
        print(f"health check under 1,100 trickling connections: median {statistics.median(latencies) * 1e3:.1f} ms, "
              f"max {max(latencies) * 1e3:.1f} ms")
    finally:
        for s in sockets:
            s.close()


# -- memory: claims are not allocated, refused layouts are not cached ------------------------------
@pytest.mark.slow
def test_claimed_headers_do_not_grow_the_gateway(node_gateway) -> None:
    """30 model uploads whose 8-byte prefix claims a 16 MiB header, then nothing: the gateway
    allocates what arrives, not what is claimed (it grew by 460 MB before)."""
    g = node_gateway(min_body_rate=1000, body_grace=0.5, body_window=0.5)
    assert g.exchange(b'POST /v1/jobs HTTP/1.1\r\nHost: x\r\n' + AUTH + b'Content-Length: 23\r\n\r\n{"job": "m", "goal": 1}')[0] == 201
    for _ in range(3):  # warm up: threads, buffers, the job's state
        assert g.exchange(HEALTH + b"\r\n")[0] == 200
    g.reset_peak_memory()
    baseline = g.memory("VmRSS")
    claim = fmt.MAX_HEADER_BYTES - 64
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(g.connect()) for _ in range(30)]
        for s in conns:
            s.sendall(b"PUT /v1/jobs/m/model HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: %d\r\n\r\n" % (8 + claim + 64)
                      + claim.to_bytes(8, "little"))
        for s in conns:  # the gateway waited for each header until the body was too slow
            status, body = read_response(s)
            assert (status, body["error"]["code"]) == (408, "body_timeout")
    peak, after = g.memory("VmHWM"), g.memory("VmRSS")
    print(f"gateway RSS: {baseline / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB during 30 claims of "
          f"{claim / 2**20:.0f} MiB headers, {after / 2**20:.0f} MiB after")
    assert peak - baseline < 64 << 20  # 30 claims would have been 480 MiB


@pytest.mark.slow
def test_update_header_is_bounded_by_its_model(node: RunningNode) -> None:
    assert node.json("POST", "/v1/jobs", {"job": "h", "goal": 1})[0] == 201
    assert node.json("PUT", "/v1/jobs/h/model", fmt.encode(MODEL))[0] == 201
    spec = fmt.parse_layout(UPDATE).spec()
    layout = fmt.parse_layout(UPDATE)

    def padded(header_bytes: int) -> bytes:  # the same update, its header space-padded
        text = UPDATE[8 : layout.data_start].rstrip(b" ").ljust(header_bytes, b" ")
        return header_bytes.to_bytes(8, "little") + text + UPDATE[layout.data_start :]

    status, body = node.push("h", padded(spec.max_header_bytes + 1))  # refused before it is read
    assert (status, body["error"]["code"]) == (413, "header_too_large")
    assert node.push("h", padded(spec.max_header_bytes))[0] == 202


def test_layout_cache_is_bounded_by_bytes() -> None:
    headers = [fmt.encode_header([(f"t{i}", fmt.F32, (4,))])[8:] for i in range(4)]
    layouts = [fmt.parse_header(h) for h in headers]
    costs = [LayoutCache.cost(h, lay) for h, lay in zip(headers, layouts)]
    at_limit = LayoutCache(max_bytes=sum(costs[:3]))
    for h, lay in zip(headers[:3], layouts[:3]):
        at_limit.remember(h, None, False, lay)
    assert (len(at_limit), at_limit.bytes) == (3, sum(costs[:3]))
    at_limit.remember(headers[3], None, False, layouts[3])  # one past: the least recently used goes
    assert len(at_limit) == 3 and at_limit.bytes <= at_limit.max_bytes
    too_big = LayoutCache(max_bytes=costs[0] - 1)
    too_big.remember(headers[0], None, False, layouts[0])
    assert (len(too_big), too_big.bytes) == (0, 0)


def test_a_cached_layout_keeps_at_most_its_idle_checkers() -> None:
    header = fmt.encode_header([("t", fmt.F32, (4,))])[8:]
    layout = fmt.parse_header(header)
    cache = LayoutCache()
    cache.remember(header, None, False, layout)
    made = [cache.checker(layout) for _ in range(IDLE_CHECKERS + 1)]  # one more than are kept
    for checker in made:
        checker.cursor = layout.total_size  # as a finished blob leaves it
        cache.give_back(layout, checker)
    again = [cache.checker(layout) for _ in range(IDLE_CHECKERS + 1)]
    assert sum(any(c is m for m in made) for c in again) == IDLE_CHECKERS  # the kept ones serve again...
    assert all(c.cursor == layout.data_start for c in again)  # ...from the start of the next blob
    other = fmt.parse_header(header)  # a layout that is not cached keeps no checker
    cache.give_back(other, cache.checker(other))
    assert all(cache.checker(other) is not c for c in again)


@pytest.mark.parametrize("refusal", [Conflict("full", code="round_full"), Overloaded("full", code="shm_exhausted")])
def test_refused_layouts_are_not_cached(refusal: Exception) -> None:
    spec = fmt.parse_layout(UPDATE).spec()
    cache = LayoutCache()

    def admit(layout: fmt.Layout) -> tuple[bytes, int]:
        raise refusal

    for i in range(5):  # distinct headers (metadata), each refused at admission
        blob = fmt.encode({"w": np.ones(4096, np.float32)}, {"n": str(i)})
        sink = BlobSink(limit=1 << 20, spec=spec, admit=admit, mappings=MappingCache(), layouts=cache)
        with pytest.raises(type(refusal)):
            sink.write(blob)
    assert (len(cache), cache.bytes) == (0, 0)
