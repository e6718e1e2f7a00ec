"""Shared fixtures: a real redis-server per test session, fresh databases per test."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from hypothesis import HealthCheck, settings

from lifl.keys.ebpf import remove_node_channel
from lifl.node.agent import Agent, AgentConfig
from lifl.state import ClusterState
from k8s.bed import testbed  # noqa: F401,E402 (the k8s suites' module fixture, shared through this conftest)

# The operator token of every node the tests start (in this process or as `lifl up`, clusters
# included); SDK Gateways present it (LIFL_TOKEN) unless a test gives them another. Set for the
# whole session: fixtures of any scope start nodes.
OPERATOR_TOKEN = f"test-operator-{secrets.token_hex(16)}"
os.environ["LIFL_OPERATOR_TOKEN"] = OPERATOR_TOKEN
os.environ["LIFL_TOKEN"] = OPERATOR_TOKEN


# Fuzz suites (marked `fuzz`) run a bounded number of examples in `make test`; `make fuzz` runs
# the same properties much longer. No per-example deadline: the machine may be loaded.
settings.register_profile("bounded", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=30000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("LIFL_FUZZ_PROFILE", "bounded"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="also run the slow suites (real nodes, big objects); CI does")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fast by default: slow suites run with --all (make test) or when selected with -m."""
    if config.getoption("--all") or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: run with --all (make test)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A real redis-server listening on a unix socket; yields its URL (database 0)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed; run `make test`, which installs it")
    # the service user's, as a node's embedded redis is: gateways that drop to that user reach it
    from lifl.node.privilege import make_private_tree, popen_as, service_identity

    service = service_identity()
    directory = Path(tempfile.mkdtemp(prefix="lifl-redis-", dir="/tmp"))
    make_private_tree(directory, service)
    sock = directory / "redis.sock"
    proc = subprocess.Popen(
        [exe, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
         "--dir", str(directory), "--databases", "64"],
        stdout=subprocess.DEVNULL, **popen_as(service),
    )
    url = f"unix://{sock}"
    deadline = time.monotonic() + 60  # bounds a failure only: a loaded machine may start it slowly
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.02)
    yield url
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


_db_counter = itertools.cycle(range(1, 64))  # each test flushes its database first


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """A URL of an empty database of the session's redis-server."""
    url = f"{redis_server}?db={next(_db_counter)}"
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def state(redis_url: str) -> ClusterState:
    return ClusterState(redis_url)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns something true, and return that; fail after ``timeout`` s.

    The way tests wait for something to happen (never a bare ``time.sleep``). The timeout only
    bounds a failing test, so it is generous: a loaded 2-core machine must not make a correct
    run time out."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value: {value!r})")
        time.sleep(interval)


def read_response(sock) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of the whole HTTP/1.1 response arriving on a
    raw socket: one ``recv`` may return only part of it."""
    import http.client

    response = http.client.HTTPResponse(sock, method="POST")
    response.begin()
    try:
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        response.close()


@pytest.fixture
def shm_node(request: pytest.FixtureRequest) -> Iterator[str]:
    """A unique node id, and a check that nothing of it is left in /dev/shm afterwards."""
    node = f"t{abs(hash(request.node.nodeid)) % 10**8}"
    yield node
    remove_node_channel(node)  # a node killed for good (its next start would have unloaded it)
    leftovers = sorted(p.name for p in Path("/dev/shm").glob(f"lifl-{node}-*"))
    for p in leftovers:
        (Path("/dev/shm") / p).unlink(missing_ok=True)
    assert not leftovers, f"shared memory leaked: {leftovers}"


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A run directory that tenant functions (other uids) can reach, unlike pytest's tmp_path."""
    path = Path(tempfile.mkdtemp(prefix="lifl-test-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path / "run"
    shutil.rmtree(path, ignore_errors=True)


def auth(token: str = OPERATOR_TOKEN) -> dict[str, str]:
    """The Authorization header of a token."""
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def node_with(redis_url: str, run_dir: Path, shm_node: str) -> Iterator[Callable[..., RunningNode]]:
    """Start a real node (agent, gateway and aggregator processes) on the session's redis-server,
    with these NodeConfig options (e.g. ``gateway_limits``); one at a time (they share the test's
    node id and run directory: starting one stops the last), stopped after the test."""
    from lifl.node.supervisor import Node, NodeConfig

    nodes: list[Node] = []

    def start(**options: Any) -> RunningNode:
        for n in nodes:
            n.stop()
        config = NodeConfig(
            node=shm_node, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=run_dir,
            data_dir=run_dir.parent / "data", **{"shm_capacity": 1 << 30, "keep_warm": 30, **options},
        )
        n = Node(config)
        nodes.append(n)
        addresses = n.start()
        return RunningNode(n, addresses.http, addresses.grpc, ClusterState(redis_url))

    yield start
    for n in nodes:
        n.stop()


@pytest.fixture
def node(node_with: Callable[..., RunningNode]) -> RunningNode:
    """A real node (agent, gateway and aggregator processes) on the session's redis-server."""
    return node_with()


class RunningNode:
    """A started node, and helpers that call its gateway as the operator (unless told otherwise)."""

    def __init__(self, node, http: str, grpc: str, state: ClusterState) -> None:
        self.node, self.http, self.grpc, self.state = node, http, grpc, state

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, body bytes) of one HTTP request; with the operator's token unless
        ``headers`` has an Authorization of its own (None as its value: send none)."""
        import http.client

        headers = {**auth(), **(headers or {})}
        headers = {k: v for k, v in headers.items() if v is not None}
        host, port = self.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, headers: dict | None = None):
        import json

        data = json.dumps(body).encode() if body is not None and not isinstance(body, (bytes, bytearray)) else body
        status, _, raw = self.request(method, path, data, headers)
        return status, json.loads(raw) if raw else None

    def push(self, job: str, blob: bytes, *, client: str = "c", samples: int = 1, version: int = 0):
        return self.json("POST", f"/v1/jobs/{job}/updates", blob, {
            "X-Lifl-Client": client, "X-Lifl-Samples": str(samples), "X-Lifl-Base-Version": str(version),
        })

    def grpc_stub(self, token: str | None = OPERATOR_TOKEN):
        """A grpcio stub whose calls carry ``token`` (None: no token)."""
        from lifl.net import lifl_pb2_grpc

        channel = grpc.insecure_channel(self.grpc)
        if token is not None:
            channel = grpc.intercept_channel(channel, WithMetadata([("authorization", f"Bearer {token}")]))
        return lifl_pb2_grpc.GatewayStub(channel)


class WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (a token) to every call of a grpcio channel."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self.metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@pytest.fixture
def started(run_dir: Path, redis_url: str, shm_node: str) -> Iterator[Callable[..., Agent]]:
    """Start a node agent in this process with these options (stopped after the test)."""
    agents: list[Agent] = []

    def start(**options: Any) -> Agent:
        options = {"max_instances": 6, "keep_warm": 30, "data_dir": run_dir.parent / "data", **options}
        a = Agent(AgentConfig(shm_node, run_dir, redis_url, 256 << 20, 64 << 20, **options), ClusterState(redis_url))
        a.start()
        agents.append(a)
        return a

    yield start
    for a in agents:
        a.stop()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount a tmpfs of so many bytes (a file system that fills up; needs root); unmounted after."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk: Path) -> Path:
    """Take every free block of a file system; returns the file holding them."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler


def outcomes_in_threads(names: list[str], run: Callable[[int], str]) -> dict[str, str]:
    """``run(i)`` for every one of ``names`` at once, each in a thread of its own (clients of one
    round): by name, what it returned, or the exception it raised."""
    outcomes: dict[str, str] = {}

    def one(i: int) -> None:
        try:
            outcomes[names[i]] = run(i)
        except Exception as e:  # the test reads what happened to each
            outcomes[names[i]] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return outcomes


@contextlib.contextmanager
def namespaced_cluster(nodes: int, stem: str, prefix: str, subnet: str) -> Iterator[tuple[Any, Any]]:
    """``nodes`` lifl nodes, each in a network namespace of its own (root), on a bridge of
    ``subnet``; (the cluster, its addresses)."""
    from lifl.node.cluster import Cluster, ClusterConfig

    base = Path(tempfile.mkdtemp(prefix=f"lifl-{stem}-", dir="/tmp"))
    os.chmod(base, 0o755)
    c = Cluster(ClusterConfig(nodes=nodes, node_stem=stem, prefix=prefix, subnet=subnet, run_dir=base / "run",
                              data_dir=base / "data", shm_capacity=256 << 20, keep_warm=30))
    try:
        yield c, c.start()
    finally:
        c.stop()
