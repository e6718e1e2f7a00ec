"""`lifl bench flstore`: non-training FL workloads (FLStore, §5) on lifl against the paper's
baselines, measured side by side in one run on this machine.

Systems, each given the same data (a base model, one round of client updates, its aggregate)
and sent the same query bodies on the same path (``POST /v1/jobs/{job}/queries``):

- ``lifl``: a real node; the job's retention policy keeps the round's updates and models in
  shared memory, where the node's query functions read them in place.
- ``objstore`` (ObjStore-Agg): updates and models in a real S3 server (s3proxy from Maven
  Central, on a filesystem directory), and a stateless function server that, per request,
  fetches every object the workload needs with boto3.
- ``cache`` (Cache-Agg): the same objects in a redis-server, the same stateless function server
  fetching them with redis-py.

The baselines' function server (``python -m lifl.bench.flstore serve``) keeps nothing across
requests (that is the baseline), parses objects with ``lifl.format`` and calls the very
functions of ``lifl.flstore.workloads`` that lifl's query functions call: only data movement
differs. Both stores are reached over loopback TCP.

Per (system, workload, model): the first request's latency (lifl: on a round of its own, so it
derives the round's statistics, which later queries of the round reuse), p50/p95 latency at the client, CPU-seconds per request of every
process of the system (function server + store server; lifl's agent, gateway, function
instances and redis), bytes moved per request (fetched from the store, plus the request and
response bodies) and the memory hit rate.

The trace (lifl only, FLStore appendix C): inference requests, then filtering requests, on a
fresh job, twice: with a static policy (models only: filtering fetches updates back from the
checkpoint store) and with the policy switched at the workload change (updates kept too).
"""

from __future__ import annotations

import argparse
import fcntl
import http.client
import itertools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from lifl import format as fmt
from lifl import procstat
from lifl.procs import stop_process
from lifl.errors import BadRequest, NotFound
from lifl.models import MODELS

SYSTEMS = ("lifl", "objstore", "cache")
BASELINES = SYSTEMS[1:]
WORKLOADS = ("cosine", "filter", "cluster", "reputation", "provenance", "inference")
MODEL_COMPUTE = ("inference",)  # bound by the model's compute, not by data movement: no latency target
TARGETS = {"objstore": 10.0, "cache": 3.0}  # baseline p50 / lifl p50, at least (FLStore §5)
TRACE_TARGET_HIT_RATE = 0.98
STATIC_POLICY = {"models": 2, "history": 2}
ADAPTIVE_POLICY = {"models": 2, "updates": 2, "history": 2}
BENCH_POLICY = ADAPTIVE_POLICY  # the side-by-side runs: the round's updates and models in memory

S3PROXY_VERSION = "2.6.0"
S3PROXY_ARTIFACT = f"org.gaul:s3proxy:{S3PROXY_VERSION}:jar:jar-with-dependencies"
BUCKET = "flstore"
STARTUP_TIMEOUT_S = 120.0  # bounds a failure only: a JVM on a loaded machine starts slowly
ROUND_TIMEOUT_S = 300.0
FETCH_THREADS = 4  # a baseline function's parallel GETs: its best shot at its store
MAX_QUERY_BYTES = 1 << 20  # a query body (inference inputs included)
MIN_CLIENTS, MAX_CLIENTS = 3, 200  # filtering's Krum scores need three
MAX_REQUESTS = 1000
MAX_TRACE_REQUESTS = 10_000
WARMUP_REQUESTS = 1  # per system and workload, untimed: process imports and instance cold starts
INFERENCE_ROWS = 32
OUTLIERS = 2  # one scaled, one sign-flipped: what filtering should find
OUTLIER_SCALE = 10.0
UPDATE_NOISE = 0.01  # each delta: a shared direction plus a client's own noise, both of this scale
SEED = 0


class MissingTool(RuntimeError):
    """A program the bench needs (java, mvn, redis-server) is not installed."""


# -- the data: a base model, one round of client updates, its aggregate --------------------------------


@dataclass
class RoundBlobs:
    model: str
    base: bytearray
    updates: list[tuple[str, int, bytearray]]  # (client, samples, blob)
    outliers: dict[str, str]  # client -> how it was made an outlier

    @property
    def update_bytes(self) -> int:
        return sum(len(blob) for _, _, blob in self.updates)


def outlier_count(clients: int) -> int:
    """Outliers among ``clients``, a minority always."""
    return min(OUTLIERS, (clients - 1) // 2)


def make_round(model: str, clients: int, seed: int = SEED) -> RoundBlobs:
    """The model's initial state_dict as the base; each client's update is the base plus a shared
    direction plus its own noise (seeded); the last outliers are scaled up or sign-flipped.
    Integer tensors (BatchNorm's counters) stay as they are."""
    from lifl.client import to_blob
    from lifl.models import make_model

    state = {name: t.detach().numpy() for name, t in make_model(model, seed).state_dict().items()}
    shared, *own_seeds = np.random.SeedSequence(seed).spawn(clients + 1)  # independent streams
    rng = np.random.default_rng(shared)
    direction = {name: rng.standard_normal(a.shape, dtype=np.float32) * UPDATE_NOISE
                 for name, a in state.items() if a.dtype.kind == "f"}
    kinds = ["scaled", "sign-flipped"][: outlier_count(clients)]
    outliers = {f"client-{clients - len(kinds) + i}": kind for i, kind in enumerate(kinds)}
    updates = []
    for i in range(clients):
        client = f"client-{i}"
        scale = {"scaled": OUTLIER_SCALE, "sign-flipped": -1.0}.get(outliers.get(client, ""), 1.0)
        own = np.random.default_rng(own_seeds[i])
        tensors = {}
        for name, a in state.items():
            if name in direction:
                delta = direction[name] + own.standard_normal(a.shape, dtype=np.float32) * UPDATE_NOISE
                tensors[name] = (a + scale * delta).astype(a.dtype)
            else:
                tensors[name] = a
        updates.append((client, int(own.integers(20, 200)), to_blob(tensors)))
    return RoundBlobs(model, to_blob(state), updates, outliers)


def fedavg(blobs: RoundBlobs) -> bytearray:
    """The round's aggregate when lifl does not run: samples-weighted mean of float tensors
    (in float64), integer tensors kept from the base."""
    base = fmt.views(blobs.base, fmt.parse_layout(blobs.base))
    total = sum(samples for _, samples, _ in blobs.updates)
    sums = {name: np.zeros(a.shape, np.float64) for name, a in base.items() if a.dtype.kind == "f"}
    for _, samples, blob in blobs.updates:
        views = fmt.views(blob, fmt.parse_layout(blob))
        for name in sums:
            sums[name] += views[name] * (samples / total)
    return fmt.encode({name: sums[name].astype(a.dtype) if name in sums else a for name, a in base.items()})


def digits_inputs(rows: int = INFERENCE_ROWS) -> list[Any]:
    """Test images of the digits workload, as a query's nested-list inputs (N x 1 x 8 x 8)."""
    from lifl.workload import load_digits_split

    return load_digits_split(10, 0.5, SEED).test[0][:rows].tolist()


# -- the baselines' stores ----------------------------------------------------------------------------


class Objects(Protocol):
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None: ...

    def get(self, key: str) -> bytes: ...


def s3_client(endpoint: str, pool: int = FETCH_THREADS) -> Any:
    import boto3
    from botocore.config import Config

    # s3proxy takes no aws-chunked trailers: checksums only where S3 requires them
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="lifl-bench",
                        aws_secret_access_key="lifl-bench",
                        config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required",
                                      max_pool_connections=pool, retries={"max_attempts": 1}))


class S3Objects:
    def __init__(self, endpoint: str, bucket: str = BUCKET) -> None:
        self.client = s3_client(endpoint)
        self.bucket = bucket

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data))

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise NotFound(f"no object {key!r} in the object store", code="not_found") from None


class RedisObjects:
    def __init__(self, url: str) -> None:
        from lifl.redisconn import bulk_client

        self.client = bulk_client(url)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.client.set(key, bytes(data))

    def get(self, key: str) -> bytes:
        value = self.client.get(key)
        if value is None:
            raise NotFound(f"no object {key!r} in the cache", code="not_found")
        return value


def job_key(job: str) -> str:
    return f"{job}/job.json"


def manifest_key(job: str, round_id: int) -> str:
    return f"{job}/rounds/{round_id}/manifest.json"


def update_key(job: str, round_id: int, client: str) -> str:
    return f"{job}/rounds/{round_id}/updates/{client}"


def model_key(job: str, version: int) -> str:
    return f"{job}/models/{version}"


def upload(objects: Objects, job: str, architecture: str, round_id: int, blobs: RoundBlobs, aggregate: bytes | bytearray) -> int:
    """The round as a baseline keeps it: the base model (version 0) and the aggregate (version 1),
    each update, the round's manifest and the job's record. Returns the bytes stored."""
    objects.put(model_key(job, 0), blobs.base)
    objects.put(model_key(job, 1), aggregate)
    for client, _, blob in blobs.updates:
        objects.put(update_key(job, round_id, client), blob)
    objects.put(manifest_key(job, round_id), json.dumps({
        "round": round_id, "version": 0, "clients": [{"client": c, "samples": s} for c, s, _ in blobs.updates]}).encode())
    objects.put(job_key(job), json.dumps({"architecture": architecture, "rounds": [round_id], "version": 1}).encode())
    return len(blobs.base) + len(aggregate) + blobs.update_bytes


# -- store servers: s3proxy and redis-server as real processes ------------------------------------------


def s3proxy_jar() -> Path:
    """s3proxy's self-contained jar in the local Maven repository, fetched from Maven Central on
    first use ($LIFL_S3PROXY_JAR names another)."""
    if os.environ.get("LIFL_S3PROXY_JAR"):
        return Path(os.environ["LIFL_S3PROXY_JAR"])
    repository = Path(os.environ.get("LIFL_M2_REPOSITORY") or Path.home() / ".m2" / "repository")
    jar = repository / "org" / "gaul" / "s3proxy" / S3PROXY_VERSION / f"s3proxy-{S3PROXY_VERSION}-jar-with-dependencies.jar"
    if jar.exists():
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingTool(f"the ObjStore-Agg baseline runs s3proxy {S3PROXY_VERSION}, which is fetched with Maven: "
                          "install it (apt-get install maven) or set LIFL_S3PROXY_JAR to the jar")
    repository.mkdir(parents=True, exist_ok=True)
    with open(repository / ".lifl-s3proxy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs fetch it once
        if not jar.exists():
            done = subprocess.run([mvn, "-q", "-B", f"-Dmaven.repo.local={repository}", "dependency:get",
                                   f"-Dartifact={S3PROXY_ARTIFACT}"], capture_output=True, text=True)
            if done.returncode or not jar.exists():
                raise RuntimeError(f"fetching {S3PROXY_ARTIFACT} with Maven failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return jar


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until(ready: Callable[[], bool], alive: Callable[[], bool], what: str, log_path: Path | None,
                timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not alive() or time.monotonic() > deadline:
            tail = log_path.read_text()[-2000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"{what} did not start{' (it exited)' if not alive() else ''}\n{tail}")
        time.sleep(0.05)


class StoreServer:
    """A store's server process, started in a directory of its own and stopped with it."""

    name = ""

    def __init__(self, directory: Path | None = None) -> None:
        self._own_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix=f"lifl-{self.name}-"))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.directory / f"{self.name}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _spawn(self, argv: list[str]) -> None:
        from lifl.procs import die_with_parent

        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.directory, start_new_session=True, preexec_fn=die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


class S3Proxy(StoreServer):
    """s3proxy on loopback with the filesystem provider (objects are files under ``directory``)
    and no authorization; the bucket is made once it answers."""

    name = "s3proxy"

    def start(self) -> str:
        java = shutil.which("java")
        if java is None:
            raise MissingTool("the ObjStore-Agg baseline runs s3proxy, a Java server: install a JRE (apt-get install default-jre-headless)")
        jar = s3proxy_jar()
        (self.directory / "objects").mkdir(exist_ok=True)
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        properties = self.directory / "s3proxy.properties"
        properties.write_text(f"s3proxy.endpoint={self.endpoint}\ns3proxy.authorization=none\njclouds.provider=filesystem\n"
                              f"jclouds.filesystem.basedir={self.directory / 'objects'}\n")
        self._spawn([java, "-jar", str(jar), "--properties", str(properties)])
        try:
            _wait_until(self._answers, self.alive, f"s3proxy on port {port}", self.log_path)
            s3_client(self.endpoint).create_bucket(Bucket=BUCKET)
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


class RedisServer(StoreServer):
    """redis-server on loopback TCP, in memory only (no snapshots, no append-only file)."""

    name = "redis"

    def start(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise MissingTool("the Cache-Agg baseline runs redis-server: install it (apt-get install redis-server)")
        port = free_port()
        self.url = f"redis://127.0.0.1:{port}"
        self._spawn([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                     "--dir", str(self.directory), "--protected-mode", "no"])
        try:
            _wait_until(self._answers, self.alive, f"redis-server on port {port}", self.log_path)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=2).ping())
        except redis.RedisError:
            return False


# -- the baselines' function server ----------------------------------------------------------------------


@dataclass
class Fetches:
    objects: int = 0
    bytes: int = 0
    seconds: float = 0.0


class QueryFunction:
    """Answers a query the stateless way: fetch every object the workload needs from the store,
    parse it, run the workload; keep nothing."""

    def __init__(self, objects: Objects) -> None:
        self.objects = objects
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="fetch")

    def _fetch(self, keys: Sequence[str], fetches: Fetches) -> list[bytes]:
        t0 = time.perf_counter()
        blobs = list(self.pool.map(self.objects.get, keys))
        fetches.seconds += time.perf_counter() - t0
        fetches.objects += len(blobs)
        fetches.bytes += sum(len(b) for b in blobs)
        return blobs

    def _json(self, key: str, fetches: Fetches) -> Any:
        return json.loads(self._fetch([key], fetches)[0])

    @staticmethod
    def _tensors(blob: bytes) -> dict[str, np.ndarray]:
        return fmt.views(blob, fmt.parse_layout(blob))

    def _round(self, job: str, round_id: int, with_aggregate: bool, fetches: Fetches) -> Any:
        from lifl.flstore.workloads import ClientUpdate, RoundData

        manifest = self._json(manifest_key(job, round_id), fetches)
        version, clients = manifest["version"], manifest["clients"]
        keys = [model_key(job, version)] + ([model_key(job, version + 1)] if with_aggregate else [])
        blobs = self._fetch(keys + [update_key(job, round_id, c["client"]) for c in clients], fetches)
        models = [self._tensors(b) for b in blobs[: len(keys)]]
        updates = [ClientUpdate(c["client"], int(c["samples"]), self._tensors(b)) for c, b in zip(clients, blobs[len(keys):])]
        return RoundData(round_id, version, models[0], models[1] if with_aggregate else None, updates)

    def answer(self, job: str, body: Any) -> dict[str, Any]:
        from lifl.flstore import workloads

        t0 = time.perf_counter()
        if not isinstance(body, dict):
            raise BadRequest("a query is a JSON object", code="bad_query")
        workload = body.get("workload")
        params = workloads.check_params(workload, {k: v for k, v in body.items() if k not in ("workload", "round", "version")})
        fetches = Fetches()
        record = self._json(job_key(job), fetches)
        if workload == "inference":
            version = _index(body, "version", record["version"])
            blob, = self._fetch([model_key(job, version)], fetches)
            t_compute = time.perf_counter()
            # a key of its own: a stateless function builds the model from what it fetched, every time
            result = workloads.inference(record["architecture"], f"{job}/{version}/{uuid.uuid4().hex}", self._tensors(blob), params)
            round_id = None
        else:
            round_id = _index(body, "round", record["rounds"][-1])
            if round_id not in record["rounds"]:
                raise NotFound(f"round {round_id} of job {job!r} is not in the store", code="not_retained")
            ids = [r for r in record["rounds"] if r <= round_id] if workload == "reputation" else [round_id]
            with_aggregate = workload != "cluster" and not (workload == "cosine" and params.get("against") == "clients")
            rounds = [self._round(job, r, with_aggregate, fetches) for r in ids]
            version = rounds[-1].version
            t_compute = time.perf_counter()
            result = workloads.run(workload, rounds, params)
        done = time.perf_counter()
        return {"workload": workload, "round": round_id, "version": version, "result": result,
                "data": {"objects": fetches.objects, "memory": 0, "store": fetches.objects, "bytes_fetched": fetches.bytes},
                "seconds": {"total": done - t0, "fetch": fetches.seconds, "compute": done - t_compute}}


def _index(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{name!r} must be a non-negative integer", code="bad_query")
    return value


QUERY_PATH_PREFIX, QUERY_PATH_SUFFIX = "/v1/jobs/", "/queries"


def serve(function: QueryFunction, address: str) -> Any:
    """The function's HTTP server (lifl's path: POST /v1/jobs/{job}/queries), serving in a thread."""
    from lifl.baselines import httpd

    class Handler(httpd.Handler):
        def do_POST(self) -> None:  # noqa: N802 - the standard library's name
            self.guarded(self._query)

        def _query(self) -> None:
            path = self.path.split("?", 1)[0]
            job = path[len(QUERY_PATH_PREFIX): -len(QUERY_PATH_SUFFIX)]
            if not (path.startswith(QUERY_PATH_PREFIX) and path.endswith(QUERY_PATH_SUFFIX)) or not job or "/" in job:
                raise NotFound(f"no such path {path!r}; queries go to POST /v1/jobs/JOB/queries", code="no_route")
            try:
                body = json.loads(self.read_body())
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise BadRequest("the query body is not JSON", code="bad_query") from None
            self.send_json(200, function.answer(job, body))

    return httpd.serve(Handler, address, MAX_QUERY_BYTES)


def serve_main(argv: list[str]) -> None:
    """``python -m lifl.bench.flstore serve``: a baseline's function server, until SIGTERM."""
    from lifl.procs import die_with_parent, on_signals

    p = argparse.ArgumentParser(prog="lifl-flstore-function")
    p.add_argument("--store", choices=("s3", "redis"), required=True)
    p.add_argument("--endpoint", required=True, help="s3: the server's URL; redis: redis://HOST:PORT")
    p.add_argument("--http", default="127.0.0.1:0")
    args = p.parse_args(argv)
    die_with_parent()
    stop = threading.Event()
    on_signals(stop.set)
    objects: Objects = S3Objects(args.endpoint) if args.store == "s3" else RedisObjects(args.endpoint)
    from lifl.flstore import workloads  # noqa: F401 - imported before the first request, as a deployed function is

    server = serve(QueryFunction(objects), args.http)
    print(f"flstore function listening on {server.address}", flush=True)
    stop.wait()
    server.shutdown()


# -- systems under test ----------------------------------------------------------------------------


class Target(Protocol):
    name: str

    def query(self, job: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]: ...

    def cpu_seconds(self) -> float: ...


def _wire_bytes(body: Any, response: Any) -> int:
    return len(json.dumps(body)) + len(json.dumps(response))


class LiflTarget:
    """A real lifl node (``lifl.bench.compare``'s): jobs with a retention policy and the model's
    architecture, one round pushed through its gateway."""

    name = "lifl"

    def __init__(self, tmp: Path, log: IO[str]) -> None:
        from lifl.bench.compare import LiflUnderTest
        from lifl.client import Gateway

        self.node = LiflUnderTest(tmp, log)
        self.gateway = Gateway(self.node.http, token=self.node.token)

    def prepare(self, job: str, blobs: RoundBlobs, aggregate: bytes | bytearray | None = None,
                retention: Mapping[str, Any] = BENCH_POLICY) -> tuple[int, bytes | bytearray]:
        """Create the job, push every update of its first round; returns (round, aggregate)."""
        self.gateway.create_job(job, len(blobs.updates), retention=dict(retention), architecture=blobs.model)
        self.gateway.set_model(job, blobs.base)
        round_id = int(self.gateway.job(job)["round"]["id"])
        for client, samples, blob in blobs.updates:
            self.gateway.push(job, blob, samples=samples, base_version=0, client=client)
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while self.gateway.job(job)["version"] < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lifl did not complete round {round_id} of {job} in {ROUND_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        version, model = self.gateway.model(job)
        if version != 1:
            raise RuntimeError(f"lifl's {job} moved past its first round (version {version}) before the bench read it")
        return round_id, model

    def query(self, job: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        response = self.gateway.query(job, body)
        return response, _wire_bytes(body, response)

    def settle(self, job: str, policy: Mapping[str, Any], updates: int) -> None:
        """Wait until the node holds the job's ``updates`` in memory as ``policy`` says: it applies
        a policy in a periodic pass, once they are written behind, and publishes what it holds
        every second (so a policy that drops them has settled once it reports them evicted)."""
        def settled() -> bool:
            stats = self.gateway.retention(job)["stats"]
            if stats["pending_writes"]:  # still writing the round behind: it would compete with the queries
                return False
            if policy.get("updates", 0) > 0:
                return stats["bytes_retained"]["update"] > 0
            return stats["evictions"] >= updates and stats["bytes_retained"]["update"] == 0

        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not settled():
            if time.monotonic() > deadline:
                raise RuntimeError(f"lifl did not apply the retention policy {policy} to {job} in {ROUND_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def set_retention(self, job: str, policy: Mapping[str, Any]) -> dict[str, Any]:
        return self.gateway.set_retention(job, dict(policy))

    def published_stats(self, job: str, lookups: int, timeout: float = 30.0) -> dict[str, Any]:
        """The node's own retention statistics of the job once they count ``lookups`` (they are
        published every second): a cross-check of the hit rate the responses gave."""
        deadline = time.monotonic() + timeout
        while (stats := self.gateway.retention(job)["stats"])["hits"] + stats["misses"] < lookups and time.monotonic() < deadline:
            time.sleep(0.1)
        return stats

    def cpu_seconds(self) -> float:
        return self.node.cpu_seconds()

    def stop(self) -> None:
        self.gateway.close()
        self.node.stop()


class BaselineTarget:
    """A store server and the stateless function server in front of it."""

    def __init__(self, name: str, log: IO[str]) -> None:
        self.name = name
        self.store: StoreServer = S3Proxy() if name == "objstore" else RedisServer()
        self.function: Any = None
        self.connection: http.client.HTTPConnection | None = None
        try:
            endpoint = self.store.start()
            self.objects: Objects = S3Objects(endpoint) if name == "objstore" else RedisObjects(endpoint)
            from lifl.node.supervisor import Child

            self.function = Child(f"{name}-function", [sys.executable, "-m", "lifl.bench.flstore", "serve", "--store",
                                                       "s3" if name == "objstore" else "redis", "--endpoint", endpoint],
                                  "flstore function listening on ", log, pdeathsig=True)
            self.function.start(timeout=STARTUP_TIMEOUT_S)
            self.address = self.function.ready_line.rsplit(" ", 1)[1]
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        assert self.function is not None and self.function.proc is not None
        return [self.function.proc.pid, self.store.pid]

    def prepare(self, job: str, blobs: RoundBlobs, aggregate: bytes | bytearray | None,
                round_id: int = 0) -> tuple[int, bytes | bytearray]:
        aggregate = aggregate if aggregate is not None else fedavg(blobs)
        upload(self.objects, job, blobs.model, round_id, blobs, aggregate)
        return round_id, aggregate

    def query(self, job: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        request = json.dumps(body).encode()
        for attempt in (1, 2):  # a kept-alive connection the server closed is opened again, once
            if self.connection is None:
                host, port = self.address.rsplit(":", 1)
                self.connection = http.client.HTTPConnection(host, int(port), timeout=STARTUP_TIMEOUT_S)
            try:
                self.connection.request("POST", f"{QUERY_PATH_PREFIX}{job}{QUERY_PATH_SUFFIX}", request,
                                        {"Content-Type": "application/json"})
                reply = self.connection.getresponse()
                data = reply.read()
                break
            except (ConnectionError, http.client.HTTPException):
                self.connection.close()
                self.connection = None
                if attempt == 2:
                    raise
        if reply.status != 200:
            raise RuntimeError(f"{self.name} answered {reply.status}: {data[:500]!r}")
        return json.loads(data), len(request) + len(data)

    def cpu_seconds(self) -> float:
        return procstat.cpu_seconds(self.pids())

    def stop(self) -> None:
        if self.connection is not None:
            self.connection.close()
        if self.function is not None:
            self.function.stop()
        self.store.stop()


# -- measuring -----------------------------------------------------------------------------------------


def query_body(workload: str, round_id: int, inputs: list[Any]) -> dict[str, Any]:
    if workload == "inference":
        return {"workload": workload, "version": 1, "inputs": inputs}
    if workload == "cluster":
        return {"workload": workload, "round": round_id, "k": 2}
    if workload == "reputation":  # over every retained round
        return {"workload": workload}
    return {"workload": workload, "round": round_id}


def measure(target: Target, job: str, body: dict[str, Any], requests: int) -> dict[str, Any]:
    """``requests`` timed queries after the warm-up: latency percentiles at the client, the
    system's CPU-seconds, bytes moved and memory hits per request."""
    t0 = time.perf_counter()
    for _ in range(WARMUP_REQUESTS):
        target.query(job, body)
    first_ms = (time.perf_counter() - t0) * 1e3 / WARMUP_REQUESTS
    latencies, moved, hits, misses = [], 0, 0, 0
    cpu0 = target.cpu_seconds()
    for _ in range(requests):
        t0 = time.perf_counter()
        response, wire = target.query(job, body)
        latencies.append((time.perf_counter() - t0) * 1e3)
        data = response["data"]
        moved += data["bytes_fetched"] + wire
        hits += data["memory"]
        misses += data["store"]
    cpu = (target.cpu_seconds() - cpu0) / requests
    return {"first_ms": round(first_ms, 2),
            "p50_ms": round(float(np.percentile(latencies, 50)), 2), "p95_ms": round(float(np.percentile(latencies, 95)), 2),
            "cpu_s": round(cpu, 4), "bytes_moved": moved // requests,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}


def run_trace(lifl: LiflTarget, blobs: RoundBlobs, inference: int, filtering: int, inputs: list[Any], *,
              adaptive: bool, job: str) -> dict[str, Any]:
    """Inference then filtering on a fresh job with the static policy; ``adaptive`` switches it at
    the workload change so the round's updates are kept in memory from then on."""
    round_id, _ = lifl.prepare(job, blobs, retention=STATIC_POLICY)
    lifl.settle(job, STATIC_POLICY, len(blobs.updates))
    requests = []
    for i in range(inference + filtering):
        if i == inference and adaptive:
            lifl.set_retention(job, ADAPTIVE_POLICY)
        body = query_body("inference" if i < inference else "filter", round_id, inputs)
        t0 = time.perf_counter()
        response, wire = lifl.query(job, body)
        data = response["data"]
        requests.append({"workload": body["workload"], "ms": round((time.perf_counter() - t0) * 1e3, 3), "memory": data["memory"],
                         "store": data["store"], "bytes_fetched": data["bytes_fetched"]})
    hits, misses = sum(r["memory"] for r in requests), sum(r["store"] for r in requests)
    filter_ms = [r["ms"] for r in requests[inference:]]
    return {"policy": STATIC_POLICY, "switched_to": ADAPTIVE_POLICY if adaptive else None,
            "mean_ms": round(float(np.mean([r["ms"] for r in requests])), 3),
            "mean_filter_ms": round(float(np.mean(filter_ms)), 3) if filter_ms else None,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "bytes_fetched": sum(r["bytes_fetched"] for r in requests),
            "node_stats": lifl.published_stats(job, hits + misses), "requests": requests}


def ratios(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and model, each baseline's p50 over lifl's, against the target (none for
    model compute)."""
    p50 = {(r["system"], r["workload"], r["model"]): r["p50_ms"] for r in runs}
    out = []
    for (system, workload, model), ours in p50.items():
        if system != "lifl":
            continue
        for baseline, at_least in TARGETS.items():
            theirs = p50.get((baseline, workload, model))
            if theirs is None:
                continue
            ratio = round(theirs / ours, 2) if ours else None
            row: dict[str, Any] = {"workload": workload, "model": model, "ratio": f"{baseline}_p50/lifl_p50", "value": ratio}
            if workload in MODEL_COMPUTE:
                row.update(target=None, met=None, note="model compute: no target")
            else:
                row.update(target=at_least, met=ratio is not None and ratio >= at_least)
            out.append(row)
    return out


def environment() -> dict[str, Any]:
    def version(argv: list[str]) -> str:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            return (done.stdout + done.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unavailable"

    import boto3
    import torch

    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "boto3": boto3.__version__, "s3proxy": S3PROXY_VERSION,
            "java": version(["java", "-version"]), "redis": version(["redis-server", "--version"]),
            "stores": "loopback TCP on this machine"}


# -- the report -----------------------------------------------------------------------------------------


def tables(result: Mapping[str, Any]) -> str:
    lines = ["side by side                         first ms      p50 ms      p95 ms     CPU-s/req   MB moved/req   hit rate"]
    for r in result["runs"]:
        lines.append(f"  {r['model']:<9} {r['workload']:<11} {r['system']:<9}{r['first_ms']:>10.1f}{r['p50_ms']:>12.1f} "
                     f"{r['p95_ms']:>11.1f} "
                     f"{r['cpu_s']:>12.3f} {r['bytes_moved'] / 1e6:>14.2f} {r['hit_rate']!s:>10}")
    if result["ratios"]:
        lines.append("ratios (baseline p50 / lifl p50)")
        for r in result["ratios"]:
            verdict = r.get("note") or f"target >= {r['target']}  {'met' if r['met'] else 'NOT met'}"
            lines.append(f"  {r['model']:<9} {r['workload']:<11} {r['ratio']:<20} {r['value']!s:>8}  {verdict}")
    trace = result.get("trace")
    if trace:
        lines.append(f"trace ({trace['model']}: {trace['inference']} inference, then {trace['filter']} filter)"
                     "   mean ms   filter mean ms   hit rate   MB fetched")
        for mode in ("static", "adaptive"):
            t = trace[mode]
            lines.append(f"  {mode:<9}{t['mean_ms']:>60.2f} {t['mean_filter_ms']!s:>16} {t['hit_rate']!s:>10} "
                         f"{t['bytes_fetched'] / 1e6:>12.2f}")
        lines.append(f"  adaptive hit rate target >= {trace['target_hit_rate']}: {'met' if trace['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(directory: Path, result: Mapping[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    runs = result["runs"]
    models = list(dict.fromkeys(r["model"] for r in runs))
    if runs:
        systems = list(dict.fromkeys(r["system"] for r in runs))
        fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            workloads = list(dict.fromkeys(r["workload"] for r in runs if r["model"] == model))
            width = 0.8 / len(systems)
            for i, system in enumerate(systems):
                values = [next((r["p50_ms"] for r in runs if (r["system"], r["workload"], r["model"]) == (system, w, model)), 0)
                          for w in workloads]
                ax.bar(np.arange(len(workloads)) + i * width, values, width, label=system)
            ax.set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
            ax.set_yscale("log")
            ax.set_ylabel("p50 latency (ms)")
            ax.set_title(model)
            ax.grid(alpha=0.3, axis="y")
        axes[0][0].legend()
        fig.suptitle("non-training workloads: p50 per request (log scale)")
        fig.tight_layout()
        paths.append(str(directory / "p50.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    trace = result.get("trace")
    if trace:
        fig, ax = plt.subplots(figsize=(8, 4))
        for mode in ("static", "adaptive"):
            ax.plot([r["ms"] for r in trace[mode]["requests"]], label=f"{mode} (hit rate {trace[mode]['hit_rate']})")
        ax.axvline(trace["inference"] - 0.5, color="grey", linestyle="--", label="inference -> filter")
        ax.set_yscale("log")
        ax.set_xlabel("request")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"lifl, {trace['model']}: static vs adaptive retention")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        paths.append(str(directory / "trace.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# -- the command ------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", nargs="+", choices=MODELS, default=["resnet18", "cnn"], metavar="MODEL",
                   help=f"models to run, of {', '.join(MODELS)} (default resnet18 cnn)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--clients", type=int, default=20, help=f"client updates in the round ({MIN_CLIENTS}-{MAX_CLIENTS}, default 20)")
    p.add_argument("--requests", type=int, default=3, help="timed requests per system, workload and model (default 3)")
    p.add_argument("--trace", default="30,60", metavar="INFERENCE,FILTER",
                   help="lifl's trace: inference requests, then filtering requests (default 30,60; 0,0 skips it)")
    p.add_argument("--trace-model", choices=MODELS, default="cnn", help="the trace's model (default cnn)")
    p.add_argument("--out", type=Path, default=Path("results/flstore"), help="JSON, tables and plots go here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _parse(args: argparse.Namespace) -> tuple[list[str], tuple[int, int]]:
    def fail(message: str) -> SystemExit:
        return SystemExit(f"lifl bench flstore: {message}")

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise fail(f"unknown system {', '.join(unknown) or '(none)'}; choose from {', '.join(SYSTEMS)}")
    if not MIN_CLIENTS <= args.clients <= MAX_CLIENTS:
        raise fail(f"--clients must be between {MIN_CLIENTS} and {MAX_CLIENTS}, got {args.clients}")
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise fail(f"--requests must be between 1 and {MAX_REQUESTS}, got {args.requests}")
    try:
        inference, filtering = (int(n) for n in args.trace.split(","))
    except ValueError:
        raise fail(f"--trace takes two counts, INFERENCE,FILTER (e.g. 30,60), not {args.trace!r}") from None
    if not (0 <= inference <= MAX_TRACE_REQUESTS and 0 <= filtering <= MAX_TRACE_REQUESTS) or (inference == 0) != (filtering == 0):
        raise fail(f"--trace counts must be between 1 and {MAX_TRACE_REQUESTS} each (or 0,0 to skip the trace)")
    if inference and "lifl" not in systems:
        raise fail("the trace runs on lifl: add lifl to --systems, or skip it with --trace 0,0")
    return list(dict.fromkeys(systems)), (inference, filtering)


_job_numbers = itertools.count()


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    systems, (trace_inference, trace_filter) = _parse(args)
    models = list(dict.fromkeys(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    inputs = digits_inputs()
    runs: list[dict[str, Any]] = []
    trace: dict[str, Any] | None = None
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="lifl-flstore-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    try:
        with open(args.out / "systems.log", "w") as log, ExitStack() as stack:
            targets: dict[str, Any] = {}
            for system in systems:
                target = LiflTarget(tmp, log) if system == "lifl" else BaselineTarget(system, log)
                stack.callback(target.stop)
                targets[system] = target
                say(f"{system} is up")
            for model in models:
                blobs = make_round(model, args.clients)
                job = f"fl-{model}-{next(_job_numbers)}"
                round_id, aggregate = targets["lifl"].prepare(job, blobs) if "lifl" in targets else (0, None)
                for system in BASELINES:
                    if system in targets:
                        targets[system].prepare(job, blobs, aggregate, round_id)
                if "lifl" in targets:
                    targets["lifl"].settle(job, BENCH_POLICY, args.clients)
                say(f"{model}: {len(blobs.updates)} updates of {len(blobs.base) / 1e6:.1f} MB in every system")
                for system in systems:
                    for i, workload in enumerate(WORKLOADS):
                        target_job = job
                        if system == "lifl" and i:  # a round of its own: its first query derives every statistic anew
                            target_job = f"{job}-{workload}"
                            targets["lifl"].prepare(target_job, blobs)
                            targets["lifl"].settle(target_job, BENCH_POLICY, args.clients)
                        figures = measure(targets[system], target_job, query_body(workload, round_id, inputs), args.requests)
                        runs.append({"system": system, "workload": workload, "model": model, **figures})
                        say(f"{model} {workload} {system}: first {figures['first_ms']:.1f} ms, p50 {figures['p50_ms']:.1f} ms, "
                            f"{figures['cpu_s']:.3f} CPU-s, "
                            f"{figures['bytes_moved'] / 1e6:.1f} MB, hit rate {figures['hit_rate']}")
            if trace_inference:
                blobs = make_round(args.trace_model, args.clients)
                trace = {"model": args.trace_model, "clients": args.clients, "inference": trace_inference, "filter": trace_filter}
                for mode in ("static", "adaptive"):
                    trace[mode] = run_trace(targets["lifl"], blobs, trace_inference, trace_filter, inputs,
                                            adaptive=mode == "adaptive", job=f"trace-{mode}-{next(_job_numbers)}")
                    say(f"trace {mode}: mean {trace[mode]['mean_ms']:.1f} ms, hit rate {trace[mode]['hit_rate']}, "
                        f"{trace[mode]['bytes_fetched'] / 1e6:.1f} MB fetched")
                trace["target_hit_rate"] = TRACE_TARGET_HIT_RATE
                trace["met"] = (trace["adaptive"]["hit_rate"] or 0.0) >= TRACE_TARGET_HIT_RATE
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"runs": runs, "trace": trace, "ratios": ratios(runs),
                              "setup": {"models": models, "clients": args.clients, "requests": args.requests,
                                        "warmup_requests": WARMUP_REQUESTS, "inference_rows": INFERENCE_ROWS,
                                        "retention": BENCH_POLICY, "seconds": round(time.monotonic() - t_start, 1)},
                              "environment": environment()}
    result["plots"] = plot(args.out, result)
    (args.out / "flstore.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "tables.txt").write_text(tables(result) + "\n")
    return result


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args, say=(lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True)))
    except MissingTool as e:
        raise SystemExit(f"lifl bench flstore: {e}") from None
    print(json.dumps(result) if args.json else tables(result))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve_main(sys.argv[2:])
