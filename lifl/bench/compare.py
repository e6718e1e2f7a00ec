"""`lifl bench compare`: lifl against the systems the LIFL paper compares with (§6, Fig. 2 and
Fig. 5), measured side by side in one run on this machine.

Systems: ``lifl`` (a real node: gateway, agent, aggregators, shared memory); ``sf`` (SF-mono),
``sf-micro`` and ``sl`` (``lifl.baselines``: real processes, the same update format, FedAvg
code and client SDK); and, for time to accuracy, ``flower`` on its own deployment engine
(``lifl.bench.flower``).

1. ``transfer`` (Fig. 7): one leaf -> top transfer of a 44.7 / 83.3 / 230 MB update on one node,
   from the moment the leaf's result exists until the top can read it.
   - lifl: the leaf's result is in shared memory; its 64-byte key message goes to the top's
     process over a unix socket (the top idle until then, as a real one waits for its
     children), which maps the object afresh (``MappingCache.open``), reads its last page and
     answers. (A real leaf also tells its agent, off the data path.)
   - sf, sf-micro: the leaf streams the bytes to the always-on top over its gRPC channel, until
     the top has them all in its buffer and acknowledges.
   - sl: the leaf function answers its invocation with the result, through its sidecar, to the
     dispatcher; the dispatcher puts it in the broker (Redis streams) and reads it back, then
     invokes the top function through the top's sidecar, until the top has the body. Shares:
     ``sidecar_ms`` (both sidecar hops) and ``broker_ms``. CPU: the leaf's invocation minus a
     receive-only invocation of the same size (the leaf's sending half), the dispatcher's and
     the broker's, and the top's receiving invocation.
   CPU is every process's user + system time on the path (the leaf side included).
2. ``queuing`` (Fig. 13, appendix F): one client -> aggregator update on a fresh system, after a
   tiny warm-up round (so SL's function instance exists: a cold start is not queuing): memory
   held along the pipeline (the growth of every system process's peak RSS, shared memory
   included), CPU time of the system's processes, and the delay from the client's first byte
   until the aggregator holds the update (lifl: the gateway acknowledged it in shared memory,
   where the aggregator maps it; the baselines: their aggregator took it). The client side is
   excluded, as in the paper.
3. ``tta`` (Fig. 9 / 10): the digits FL job (``lifl.bench.fljob``) on each system to the target
   accuracy: time to accuracy, the system's CPU-seconds until then (every process of the
   system, Redis included, and instances that exited), and the time series of arrivals,
   active aggregators and cumulative CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

from lifl import procstat
from lifl.baselines import serverless
from lifl.baselines.aggregate import Input, frame, unframe
from lifl.baselines.broker import PARTIALS, Broker
from lifl.baselines.jobs import Jobs
from lifl.baselines.serverful import TopClient
from lifl.baselines.system import SYSTEMS, BaselineConfig, BaselineSystem
from lifl.bench.dataplane import MODELS, make_blob, synthetic_shapes
from lifl.bench.fljob import JOB, JobSetup, run_job
from lifl.models import MODELS as MODELS_FL
from lifl.keys.record import KeyMessage, now_ns
from lifl.client import Gateway, to_blob
from lifl.net.limits import ConnectionLimits
from lifl.node.supervisor import Node, NodeConfig
from lifl.state import ClusterState
from lifl.store import MappingCache, object_name

SIZES = {name: size for name, size, _ in MODELS}  # resnet18 44.7 MB, resnet34 83.3 MB, resnet152 230 MB
TRANSFER_SYSTEMS = SYSTEMS
TTA_SYSTEMS = (*SYSTEMS, "flower")
LIFL_HANDOFF_REPS = 100  # key hand-offs are microseconds: many, for CPU time above the clock's resolution
LIFL_HANDOFF_IDLE_S = 0.02  # the top sits idle between inputs, as a real one waits for its children
_CPU_REPLY = struct.Struct("<dd")  # the top's (CPU seconds, wall clock) for one hand-off
# The paper's ratios, the targets: (section, figure, baseline, at least)
TARGETS = [
    ("transfer", "latency_ms", "sf", 3.0), ("transfer", "latency_ms", "sl", 5.8),
    ("queuing", "cpu_ms", "sl", 1.5), ("queuing", "memory_mb", "sl", 3.0),
    ("tta", "time_to_accuracy_s", "sf", 1.6), ("tta", "time_to_accuracy_s", "sl", 2.7),
    ("tta", "aggregation_cpu_s", "sf", 1.8), ("tta", "aggregation_cpu_s", "sl", 5.0),
]


_node_numbers = itertools.count()


# -- systems under test: one small surface over a lifl node and the baselines ------------------------


class LiflUnderTest:
    def __init__(self, tmp: Path, log: Any, gateway_limits: ConnectionLimits | None = None) -> None:
        name = f"c{os.getpid() % 100000}n{next(_node_numbers)}"  # a fresh node (and state) each time
        self.node = Node(NodeConfig(node=name, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=tmp / name / "run",
                                    data_dir=tmp / name / "data", shm_capacity=8 << 30, pool_limit=4 << 30,
                                    gateway_limits=gateway_limits or ConnectionLimits()), log=log)
        addresses = self.node.start()
        self.http, self.grpc = addresses.http, addresses.grpc
        self.token = self.node.operator_token
        self.state = ClusterState(addresses.redis)

    def version(self, job: str) -> int:
        return self.state.version(job)

    def pids(self) -> list[int]:
        groups = self.node.pids()
        redis = self.node.children["redis"].proc
        return groups["agent"] + groups["gateway"] + groups["aggregators"] + ([redis.pid] if redis else [])

    def cpu_seconds(self) -> float:
        groups = self.node.pids()
        redis = self.node.children["redis"].proc
        return (procstat.cpu_seconds(groups["agent"], reaped_children=True)
                + procstat.cpu_seconds(groups["gateway"] + groups["aggregators"] + ([redis.pid] if redis else [])))

    def aggregators(self) -> int:
        return len(self.node.pids()["aggregators"])

    def installed(self, job: str) -> dict[int, float]:
        """Wall clock at which each version was installed (its round's record)."""
        return {r["new_version"]: r["closed"] for r in self._rounds(job)}

    def checkpoints_ms(self, job: str) -> list[float]:
        """lifl makes a version visible once its checkpoint is durable; the baselines write none."""
        return [r["checkpoint_s"] * 1e3 for r in self._rounds(job)]

    def _rounds(self, job: str) -> list[dict[str, Any]]:
        gateway = Gateway(self.http, token=self.token)
        try:
            return [r for r in gateway.rounds(job, 10_000) if r["outcome"] in ("complete", "partial")]
        finally:
            gateway.close()

    def cpu_by_role(self) -> dict[str, float]:
        groups = self.node.pids()
        redis = self.node.children["redis"].proc
        return {"gateway": procstat.cpu_seconds(groups["gateway"]),
                "agent": procstat.cpu_seconds(groups["agent"]),
                "aggregators": procstat.cpu_seconds(groups["aggregators"])
                + procstat.cpu_seconds(groups["agent"], reaped_children=True) - procstat.cpu_seconds(groups["agent"]),
                "redis": procstat.cpu_seconds([redis.pid] if redis else [])}

    def stop(self) -> None:
        self.node.stop()


class BaselineUnderTest:
    def __init__(self, config: BaselineConfig, log: Any) -> None:
        self.system = BaselineSystem(config, log)
        self.http = self.system.start()
        self.grpc = ""  # the baselines serve HTTP only
        self.token = ""
        self.jobs = Jobs(self.system.redis_url)

    def version(self, job: str) -> int:
        return self.jobs.status(job).version

    def pids(self) -> list[int]:
        return self.system.all_pids()

    def cpu_seconds(self) -> float:
        return procstat.cpu_seconds(self.system.all_pids(), reaped_children=True)

    def aggregators(self) -> int:
        return len(self.system.pids()["aggregators"])

    def installed(self, job: str) -> dict[int, float]:
        return {r["version"]: r["installed_at"] for r in self.jobs.rounds(job)}

    def checkpoints_ms(self, job: str) -> list[float]:
        return []

    def cpu_by_role(self) -> dict[str, float]:
        """SL's exited instances count with the dispatcher, which started them."""
        groups = self.system.pids()
        out = {role: procstat.cpu_seconds(pids) for role, pids in groups.items() if role != "broker"}
        out["broker"] = procstat.cpu_seconds(groups["broker"], reaped_children=True)
        if self.system.config.system == "sf":
            out["frontend"] = 0.0  # SF-mono's frontend is its leaf: counted with the aggregators
        return out

    def taken(self, job: str) -> tuple[int, float]:
        return self.jobs.taken(job)

    def stop(self) -> None:
        self.system.stop()


SystemUnderTest = LiflUnderTest | BaselineUnderTest


@contextmanager
def running(system: str, tmp: Path, log: Any, **options: Any) -> Iterator[SystemUnderTest]:
    sut: SystemUnderTest = LiflUnderTest(tmp, log) if system == "lifl" else \
        BaselineUnderTest(BaselineConfig(system, http="127.0.0.1:0", **options), log)
    try:
        yield sut
    finally:
        sut.stop()


def _ticks(pids: list[int]) -> dict[int, float]:
    return {pid: procstat.cpu_seconds([pid]) for pid in pids}


def _cpu_delta(before: dict[int, float], pids: list[int]) -> float:
    return sum(procstat.cpu_seconds([pid]) - before.get(pid, 0.0) for pid in pids)


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- 1. transfer ----------------------------------------------------------------------------


def lifl_transfer(blob: bytes, reps: int) -> dict[str, Any]:
    """The leaf's result in shared memory; its key to the top's process, which maps it."""
    node, tenant, key = f"cmp{os.getpid() % 100000}", "bench", os.urandom(16)
    name = object_name(node, tenant, key)
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=len(blob))
    try:
        with mmap.mmap(shm.fd, len(blob)) as mm:
            mm[:] = blob
        shm.close_fd()
        with tempfile.TemporaryDirectory(prefix="lifl-cmp-") as d:
            path = os.path.join(d, "top.sock")
            top = subprocess.Popen([sys.executable, "-m", "lifl.bench.compare", "map-keys", path, node, tenant],
                                   stdout=subprocess.PIPE, text=True)
            try:
                assert top.stdout is not None
                top.stdout.readline()
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.connect(path)
                latencies, cpu = [], 0.0
                for _ in range(reps):
                    t_cpu = time.thread_time()
                    t0 = time.perf_counter()
                    sock.send(KeyMessage(dest=1, task=1, key=key, samples=1, count=1, sent_ns=now_ns()).pack())
                    top_cpu, _ = _CPU_REPLY.unpack(sock.recv(_CPU_REPLY.size))
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    cpu += time.thread_time() - t_cpu + top_cpu
                    time.sleep(LIFL_HANDOFF_IDLE_S)  # waking an idle receiver is part of a real hand-off
                sock.close()
            finally:
                top.terminate()
                top.wait(10)
    finally:
        shm.unlink()
    return {"latency_ms": float(np.median(latencies)), "cpu_ms": cpu / reps * 1e3}


def map_keys(path: str, node: str, tenant: str) -> None:
    """The lifl top's side of ``lifl_transfer``: take each key and map its object, readable."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    print("ready", flush=True)
    conn, _ = server.accept()
    cache = MappingCache()
    while data := conn.recv(256):
        t_cpu = time.thread_time()
        msg = KeyMessage.unpack(data)
        cache.clear()  # a fresh mapping each time, as a new top instance would make it
        view = np.frombuffer(cache.open(object_name(node, tenant, msg.key)), np.uint8)
        view[-1]  # readable: the last page faults in
        del view
        conn.send(_CPU_REPLY.pack(time.thread_time() - t_cpu, time.time()))


def sf_transfer(sut: BaselineUnderTest, blob: bytes, job: str, reps: int) -> dict[str, Any]:
    """The leaf (this process) streams the update to the top over its gRPC channel."""
    top_child = sut.system.children["top"]
    assert top_child.proc is not None
    top = TopClient(top_child.ready_line.rsplit(" ", 1)[1])
    latencies, cpu = [], 0.0
    try:
        for rep in range(reps):
            before = _ticks([top_child.proc.pid])
            t_cpu = time.process_time()  # gRPC's own threads work for the leaf too
            t0 = time.perf_counter()
            top.send(job, rep, Input(blob, 1, 1, False), fan_in=2)  # fan-in 2: the top holds it, no aggregation
            latencies.append((time.perf_counter() - t0) * 1e3)
            cpu += time.process_time() - t_cpu + _cpu_delta(before, [top_child.proc.pid])
    finally:
        top.close()
    return {"latency_ms": float(np.median(latencies)), "cpu_ms": cpu / reps * 1e3}


def _invoked(address: str, path: str, items: list[Input]) -> serverless.Reply:
    reply = serverless.post(address, path, frame(items))
    if reply.status != 200:
        raise RuntimeError(f"invocation failed ({reply.status}): {reply.body[:300]!r}")
    return reply


def sl_transfer(sut: BaselineUnderTest, blob: bytes, job: str, reps: int) -> dict[str, Any]:
    """Leaf function -> its sidecar -> dispatcher (this process) -> broker -> top's sidecar -> top."""
    log = open(os.devnull, "w")
    leaf = serverless.Instance(1001, sut.system.redis_url, log)
    top = serverless.Instance(1002, sut.system.redis_url, log)
    broker = Broker(sut.system.redis_url)
    redis_pid = sut.system.children["redis"].proc.pid  # type: ignore[union-attr]
    rows = []
    try:
        for rep in range(reps):
            leaf_before = _ticks(leaf.pids())
            reply = _invoked(leaf.address, f"/invoke?job={job}&version=0&role=leaf", [Input(blob, 1, 1, False)])
            sent_at, t1, recv_cpu = float(reply.headers["X-Lifl-Sent-At"]), reply.received_at, reply.receive_cpu_s
            leaf_cpu = _cpu_delta(leaf_before, leaf.pids())
            leaf_sidecar_cpu = _cpu_delta(leaf_before, [leaf.pids()[-1]])
            broker_before = _ticks([redis_pid])
            t_cpu = time.thread_time()
            partial = next(unframe(reply.body))
            broker.publish(PARTIALS, job, 1000 + rep, partial)
            (_, item), = broker.read(PARTIALS, job, 1000 + rep, "0-0", 1)
            broker_cpu = time.thread_time() - t_cpu + _cpu_delta(broker_before, [redis_pid])
            t3 = time.time()
            broker.drop(PARTIALS, job, 1000 + rep)
            top_before = _ticks(top.pids())
            # a stale version: the top takes the bytes and installs nothing (receiving is what it does)
            reply = _invoked(top.address, f"/invoke?job={job}&version=999999&role=top", [item])
            send_cpu, t4 = reply.send_cpu_s, float(reply.headers["X-Lifl-Received-At"])
            top_cpu = _cpu_delta(top_before, top.pids())
            top_sidecar_cpu = _cpu_delta(top_before, [top.pids()[-1]])
            # the leaf's invocation received the update and sent it: its sending half is the
            # invocation less one that only receives the same bytes (the top's)
            rows.append({
                "latency_ms": (t4 - sent_at) * 1e3, "sidecar_ms": ((t1 - sent_at) + (t4 - t3)) * 1e3,
                "broker_ms": (t3 - t1) * 1e3,
                "cpu_ms": (max(leaf_cpu - top_cpu, 0.0) + recv_cpu + broker_cpu + send_cpu + top_cpu) * 1e3,
                "sidecar_cpu_ms": (max(leaf_sidecar_cpu - top_sidecar_cpu, 0.0) + top_sidecar_cpu) * 1e3,
                "broker_cpu_ms": broker_cpu * 1e3,
            })
    finally:
        leaf.stop()
        top.stop()
        log.close()
    out = {k: float(np.median([r[k] for r in rows])) for k in ("latency_ms", "sidecar_ms", "broker_ms")}
    out.update({k: float(np.mean([r[k] for r in rows])) for k in ("cpu_ms", "sidecar_cpu_ms", "broker_cpu_ms")})
    return out


def transfer(systems: list[str], sizes: dict[str, float], reps: int, tmp: Path, log: Any, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(0)
    blobs = {name: bytes(make_blob(synthetic_shapes(size, 64, rng), rng)) for name, size in sizes.items()}
    for system in systems:
        if system == "lifl":
            for name in sizes:
                rows.append({"system": "lifl", "size_mb": round(len(blobs[name]) / 1e6, 1),
                             **lifl_transfer(blobs[name], LIFL_HANDOFF_REPS)})
                say(f"transfer lifl {name}: {rows[-1]['latency_ms']:.3f} ms")
            continue
        with running(system, tmp, log) as sut:
            assert isinstance(sut, BaselineUnderTest)
            for name in sizes:
                job = f"transfer-{name}"
                sut.jobs.create(job, 2)
                sut.jobs.set_model(job, blobs[name])
                measure = sl_transfer if system == "sl" else sf_transfer
                rows.append({"system": system, "size_mb": round(len(blobs[name]) / 1e6, 1),
                             **measure(sut, blobs[name], job, reps)})
                say(f"transfer {system} {name}: {rows[-1]['latency_ms']:.1f} ms")
    return rows


# -- 2. queuing -----------------------------------------------------------------------------


def queuing_one(system: str, blob: bytes, tmp: Path, log: Any) -> dict[str, Any]:
    options = {"fan_in": 1} if system == "sl" else {}  # SL invokes a leaf per update: one update reaches one
    with running(system, tmp, log, **options) as sut:
        gateway = Gateway(sut.http, token=sut.token or None)
        try:
            tiny = to_blob({"w": np.zeros(16, np.float32)})
            gateway.create_job("warm", 1)
            gateway.set_model("warm", tiny)
            gateway.push("warm", tiny, samples=1, base_version=0, client="warm")
            _wait(lambda: gateway.job("warm")["version"] == 1, "the warm-up round")
            gateway.create_job("q", 2)  # two: the one update waits at its aggregator
            gateway.set_model("q", blob)
            if isinstance(sut, BaselineUnderTest):
                _wait(lambda: sut.taken("warm")[0] >= 1, "the warm-up update")
            pids = sut.pids()
            rss = {pid: _status_kb(pid, "VmRSS") for pid in pids}
            for pid in pids:  # peak RSS from now on
                try:
                    Path(f"/proc/{pid}/clear_refs").write_text("5")
                except OSError:
                    pass
            before = _ticks(pids)
            t0 = time.time()
            gateway.push("q", blob, samples=1, base_version=0, client="c1")
            if isinstance(sut, BaselineUnderTest):
                _wait(lambda: sut.taken("q")[0] >= 1, "the update at its aggregator", poll=0.001)
                delay_s = sut.taken("q")[1] - t0
            else:  # in shared memory, acknowledged: the aggregator maps it by its key
                delay_s = time.time() - t0
            pids = sut.pids()
            memory_kb = sum(_status_kb(pid, "VmHWM") - rss.get(pid, 0) for pid in pids)
            cpu = _cpu_delta(before, pids)
        finally:
            gateway.close()
    return {"system": system, "size_mb": round(len(blob) / 1e6, 1), "memory_mb": memory_kb / 1024, "cpu_ms": cpu * 1e3,
            "delay_ms": delay_s * 1e3}


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll)


def queuing(systems: list[str], sizes: dict[str, float], tmp: Path, log: Any, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(1)
    for name, size in sizes.items():
        blob = bytes(make_blob(synthetic_shapes(size, 64, rng), rng))
        for system in systems:
            rows.append(queuing_one(system, blob, tmp, log))
            r = rows[-1]
            say(f"queuing {system} {name}: {r['memory_mb']:.0f} MB, {r['cpu_ms']:.0f} ms CPU, {r['delay_ms']:.0f} ms")
    return rows


# -- 3. time to accuracy ---------------------------------------------------------------------


def tta(systems: list[str], setup: JobSetup, tmp: Path, log: Any, say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, series = [], {}
    for system in systems:
        if system == "flower":
            from lifl.bench.flower import run_flower

            result = run_flower(target=setup.target, clients=setup.clients, goal=setup.goal, alpha=setup.alpha, seed=setup.seed,
                                max_minutes=setup.max_minutes, workdir=tmp / "flower")
            series["flower"] = result.pop("series", [])
            rows.append({**result, "system": "flower", "target_accuracy": setup.target})
            say(f"tta flower: {result.get('time_to_accuracy_s')} s, {result.get('aggregation_cpu_s')} CPU-s")
            continue
        with running(system, tmp, log) as sut:
            run = run_job(sut.http, sut.token, setup, sut.cpu_seconds, sut.aggregators)
            figures = _job_figures(sut, run)
        reached = run.reached(setup.target)
        rows.append({"system": system, "target_accuracy": setup.target,
                     "time_to_accuracy_s": round(reached[0], 2) if reached else None,
                     "aggregation_cpu_s": round(reached[2], 2) if reached else None,
                     "rounds": reached[1] if reached else run.evaluations[-1][1],
                     "final_accuracy": round(run.evaluations[-1][2], 4),
                     "total_cpu_s": round(run.samples[-1].cpu_s, 2) if run.samples else None, **figures})
        series[system] = [asdict(s) for s in run.samples]
        say(f"tta {system}: {rows[-1]['time_to_accuracy_s']} s, {rows[-1]['aggregation_cpu_s']} CPU-s, {rows[-1]['rounds']} rounds")
    return rows, series


def _percentiles(name: str, values: list[float]) -> dict[str, float | None]:
    return {f"{name}_p50": round(float(np.percentile(values, 50)), 1) if values else None,
            f"{name}_p95": round(float(np.percentile(values, 95)), 1) if values else None}


def _job_figures(sut: SystemUnderTest, run: Any) -> dict[str, Any]:
    """What every FL-job row reports besides its headline: CPU by role, the aggregation tail
    clients wait for, and (lifl) the checkpoint written before a version is shown."""
    return {"cpu_s_by_role": {role: round(cpu, 2) for role, cpu in sut.cpu_by_role().items()},
            **_percentiles("aggregation_tail_ms", run.tails_ms(sut.installed(JOB))),
            **_percentiles("checkpoint_ms", sut.checkpoints_ms(JOB))}


def load(systems: list[str], setup: JobSetup, tmp: Path, log: Any, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The FL job with a large model for a fixed number of rounds: what the systems cost when
    updates are big (the clients train it, unevaluated)."""
    rows = []
    for system in systems:
        with running(system, tmp, log) as sut:
            run = run_job(sut.http, sut.token, setup, sut.cpu_seconds, sut.aggregators)
            figures = _job_figures(sut, run)
        t, version, _, cpu = run.evaluations[-1]
        rows.append({"system": system, "model": setup.model, "rounds": version, "time_s": round(t, 2),
                     "aggregation_cpu_s": round(cpu, 2), **figures})
        say(f"load {system}: {version} rounds in {t:.1f} s, {cpu:.2f} CPU-s, tail p50 {rows[-1]['aggregation_tail_ms_p50']} ms")
    return rows


# -- the report -------------------------------------------------------------------------------


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Each baseline's figure over lifl's (at the largest size for the per-size sections), and
    whether it meets the issue's target."""
    out = {}
    for section, figure, baseline, at_least in TARGETS:
        rows = result.get(section) or []
        if section != "tta":
            largest = max((r["size_mb"] for r in rows), default=None)
            rows = [r for r in rows if r["size_mb"] == largest]
        ours = next((r.get(figure) for r in rows if r["system"] == "lifl"), None)
        theirs = next((r.get(figure) for r in rows if r["system"] == baseline), None)
        ratio = theirs / ours if ours and theirs is not None else None
        out[f"{section}.{figure}.{baseline}"] = {"ratio": round(ratio, 2) if ratio else None, "target": at_least,
                                                 "met": ratio is not None and ratio >= at_least}
    return out


def tables(result: dict[str, Any]) -> str:
    lines = []
    if result.get("transfer"):
        lines.append("transfer (leaf -> top, one update)       latency ms    CPU ms   (SL: sidecar / broker ms)")
        for r in result["transfer"]:
            extra = f"   {r['sidecar_ms']:.1f} / {r['broker_ms']:.1f}" if "sidecar_ms" in r else ""
            lines.append(f"  {r['system']:<9} {r['size_mb']:>6.1f} MB {r['latency_ms']:>20.3f} {r['cpu_ms']:>9.2f}{extra}")
    if result.get("queuing"):
        lines.append("queuing (client -> aggregator)           memory MB    CPU ms    delay ms")
        for r in result["queuing"]:
            lines.append(f"  {r['system']:<9} {r['size_mb']:>6.1f} MB {r['memory_mb']:>19.0f} {r['cpu_ms']:>9.0f} {r['delay_ms']:>11.0f}")
    if result.get("tta"):
        lines.append("time to accuracy                         seconds   aggregation CPU-s   rounds")
        for r in result["tta"]:
            lines.append(f"  {r['system']:<9} to {r['target_accuracy']:.2f} {r['time_to_accuracy_s']!s:>23} "
                         f"{r['aggregation_cpu_s']!s:>19} {r.get('rounds')!s:>8}")
    if result.get("load"):
        lines.append("load (large updates, fixed rounds)       seconds   system CPU-s   tail p50 / p95 ms")
        for r in result["load"]:
            lines.append(f"  {r['system']:<9} {r['model']} x {r['rounds']:<4} {r['time_s']:>17} {r['aggregation_cpu_s']:>14} "
                         f"   {r['aggregation_tail_ms_p50']} / {r['aggregation_tail_ms_p95']}")
    if result.get("ratios"):
        lines.append("ratios (baseline / lifl)")
        for name, r in result["ratios"].items():
            lines.append(f"  {name:<36} {r['ratio']!s:>6}  target >= {r['target']}  {'met' if r['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(directory: Path, result: dict[str, Any], series: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for section, figures in (("transfer", ("latency_ms", "cpu_ms")), ("queuing", ("memory_mb", "cpu_ms", "delay_ms"))):
        rows = result.get(section) or []
        if not rows:
            continue
        systems = list(dict.fromkeys(r["system"] for r in rows))
        sizes = sorted({r["size_mb"] for r in rows})
        fig, axes = plt.subplots(1, len(figures), figsize=(5 * len(figures), 4))
        for ax, figure in zip(axes, figures):
            width = 0.8 / len(systems)
            for i, system in enumerate(systems):
                values = [next((r[figure] for r in rows if r["system"] == system and r["size_mb"] == s), 0) for s in sizes]
                ax.bar(np.arange(len(sizes)) + i * width, values, width, label=system)
            ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, [f"{s:.0f} MB" for s in sizes])
            ax.set_ylabel(figure.replace("_", " "))
            ax.set_yscale("log")
            ax.grid(alpha=0.3, axis="y")
        axes[0].legend()
        fig.suptitle(f"{section} (log scale)")
        fig.tight_layout()
        path = directory / f"{section}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    if series:
        fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
        for system, samples in series.items():
            if not samples or "arrivals" not in samples[0]:
                continue
            t = [s["t"] for s in samples]
            rate = [0.0] + [(b["arrivals"] - a["arrivals"]) / max(b["t"] - a["t"], 1e-9) for a, b in zip(samples, samples[1:])]
            axes[0].plot(t, rate, label=system)
            axes[1].plot(t, [s["aggregators"] for s in samples], label=system)
            axes[2].plot(t, [s["cpu_s"] for s in samples], label=system)
        for ax, label in zip(axes, ("arrivals / s", "active aggregators", "cumulative CPU s")):
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend()
        axes[2].set_xlabel("wall time (s)")
        fig.tight_layout()
        path = directory / "tta_series.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default="transfer,queuing,tta",
                   help="which to run, of transfer, queuing, tta and load (default the first three)")
    p.add_argument("--systems", default=",".join(TTA_SYSTEMS), help=f"of {', '.join(TTA_SYSTEMS)} (flower: time to accuracy only)")
    p.add_argument("--models", default=",".join(SIZES), help="update sizes by model: " + ", ".join(
        f"{k} ({v / 1e6:.1f} MB)" for k, v in SIZES.items()))
    p.add_argument("--sizes-mb", metavar="MB,...", help="other update sizes instead of --models' (e.g. 2,10)")
    p.add_argument("--reps", type=int, default=3, help="transfers per system and size (default 3)")
    p.add_argument("--target", type=float, default=0.9, help="test accuracy of the FL job (default 0.9)")
    p.add_argument("--tta-model", choices=MODELS_FL, default="cnn",
                   help="the FL job's model: the small CNN (default), or a ResNet for system load (flower: the CNN only)")
    p.add_argument("--load-model", choices=MODELS_FL[1:], default="resnet18", help="the load section's model (default resnet18)")
    p.add_argument("--load-rounds", type=int, default=10, help="rounds of the load section (default 10)")
    p.add_argument("--load-goal", type=int, default=JobSetup.goal,
                   help=f"updates per round of the load section (default {JobSetup.goal}), of twice as many active clients")
    p.add_argument("--load-max-minutes", type=float, default=None,
                   help="the load section's time budget per system (default: --max-minutes); its clients train a ResNet")
    p.add_argument("--max-minutes", type=float, default=5.0, help="per system, for the FL job (default 5)")
    p.add_argument("--results", type=Path, default=Path("results/compare"), help="tables, plots and JSON go here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _names(text: str, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"lifl bench compare: unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return names


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    sections = _names(args.sections, ("transfer", "queuing", "tta", "load"), "section")
    systems = _names(args.systems, TTA_SYSTEMS, "system")
    sizes = {name: SIZES[name] for name in _names(args.models, tuple(SIZES), "model")}
    if args.sizes_mb:
        try:
            sizes = {f"{float(mb):g}mb".replace(".", "-"): float(mb) * 1e6 for mb in args.sizes_mb.split(",")}
        except ValueError:
            raise SystemExit(f"lifl bench compare: --sizes-mb takes sizes in MB separated by commas, not {args.sizes_mb!r}") from None
        if not all(1 <= size / 1e6 <= 1000 for size in sizes.values()):
            raise SystemExit("lifl bench compare: each of --sizes-mb is between 1 and 1000 MB")
    if min(args.reps, args.load_rounds, args.load_goal) < 1:
        raise SystemExit("lifl bench compare: --reps, --load-rounds and --load-goal must be at least 1")
    args.results.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lifl-compare-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release()}}
    series: dict[str, Any] = {}
    try:
        with open(args.results / "systems.log", "w") as log:
            byte_systems = [s for s in systems if s != "flower"]
            if "transfer" in sections:
                result["transfer"] = transfer(byte_systems, sizes, args.reps, tmp, log, say)
            if "queuing" in sections:
                result["queuing"] = queuing(byte_systems, sizes, tmp, log, say)
            if "tta" in sections:
                setup = JobSetup(target=args.target, max_minutes=args.max_minutes, model=args.tta_model)
                if setup.model != "cnn" and "flower" in systems:
                    raise SystemExit("lifl bench compare: Flower's app trains the CNN; leave flower out of --systems for --tta-model")
                result["tta"], series = tta(systems, setup, tmp, log, say)
                result["tta_setup"] = asdict(setup)
            if "load" in sections:
                setup = JobSetup(model=args.load_model, rounds=args.load_rounds, goal=args.load_goal, active=2 * args.load_goal,
                                 max_minutes=args.load_max_minutes or args.max_minutes)
                result["load"] = load(byte_systems, setup, tmp, log, say)
                result["load_setup"] = asdict(setup)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["ratios"] = ratios(result)
    result["plots"] = plot(args.results, result, series)
    (args.results / "compare.json").write_text(json.dumps({**result, "series": series}, indent=1) + "\n")
    (args.results / "tables.txt").write_text(tables(result) + "\n")
    return result


def main(args: argparse.Namespace) -> int:
    result = run(args, say=(lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True)))
    print(json.dumps(result) if args.json else tables(result))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["map-keys"]:
        map_keys(*sys.argv[2:5])
