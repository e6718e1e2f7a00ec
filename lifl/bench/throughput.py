"""`lifl bench throughput`: what one update costs a system, measured with many small updates.

For each update size (4 KB, 40 KB, 400 KB of float32), round goal and protocol, client
processes (``lifl.bench.loadgen``: one thread, several keep-alive connections each, one update
in flight per connection) push updates to a system for a number of rounds; every update names
its own client, as FL clients do. Systems:

- ``lifl``: a node (``lifl up``: gateway, agent, aggregator instances, Redis);
- ``sf`` (SF-mono) and, on request, ``sf-micro`` and ``sl`` (``lifl.baselines``), which serve
  HTTP only: their gRPC figures are not measured;
- ``reference``: the smallest server there is (``lifl.bench.requestsink``), answering the same
  requests with 202 and doing nothing else: what answering a request costs at all on this
  machine, in this run, with these clients.

Each (system, size, goal, protocol) runs on a fresh job: a warm-up round first (cold starts
and caches are not what is measured), then ``rounds`` rounds, from the moment clients are told
the round's version until the version after the last round is visible. Clients that find a
round full wait until the parent, which watches the job's version in the system's Redis only
while a client waits, tells them the next version.

Figures per system, size and protocol (the JSON's ``results``):
- ``updates_per_s``: acknowledged updates per second of the measured window (round closes
  included: a user's rate);
- ``cpu_ms_per_update``: CPU time (user + system) of every process of the system, Redis
  included, over the window, per update; ``cpu_ms_per_update_by_role``: gateway, agent,
  aggregators, redis, other (the baselines: their frontend as gateway, SF-mono's frontend also
  being its leaf; top and leaves as aggregators; SL's dispatcher and sidecars as other);
- ``ack_ms_p50``, ``ack_ms_p99``: from a request's first byte sent until its answer is in;
- ``close_ms``: from a round's last acknowledgement until the next version is visible (median
  over the rounds whose next version was seen appear; ``close_ms_max`` the longest);
- ``exact``: the last round's model equals the FedAvg of the updates its clients were told were
  acknowledged (each client process knows which of its blobs and sample counts were taken).

``--big-round`` adds one round of ``BIG_ROUND`` updates of 4 KB on lifl (``big_round``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl import procstat
from lifl.bench import loadgen
from lifl.bench.compare import BaselineUnderTest, LiflUnderTest, running
from lifl.client import Gateway, from_blob

SIZES = {"4k": 4 << 10, "40k": 40 << 10, "400k": 400 << 10}  # float32 data bytes of an update
TENSORS = {"4k": 4, "40k": 8, "400k": 16}
SYSTEMS = ("lifl", "sf", "sf-micro", "sl")
REFERENCE = "reference"
PROTOCOLS = ("http", "grpc")
ROLES = ("gateway", "agent", "aggregators", "redis", "other")
MIN_UPDATES = 3000  # measured updates per figure at least (--rounds auto): CPU clocks tick every 10 ms
REFERENCE_MIN_UPDATES = 20_000  # the reference is fast: this many make its CPU time measurable
BIG_ROUND = 10_000
WATCH_INTERVAL_S = 0.0005  # how often the parent reads the version while clients wait
ROUND_TIMEOUT_S = 300.0  # a round that does not close by then fails the run
# (figure, size, at most this ratio of lifl to the named system) and (figure, at least)
CPU_TARGETS = {"4k": 0.5, "40k": 0.5, "400k": 0.7}
RATE_TARGET = 1.5
REFERENCE_CPU_STRETCH = {"4k": 6.0, "40k": 6.0}
BIG_ROUND_CLOSE_MS = 200.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--systems", default="lifl,sf", help=f"of {', '.join(SYSTEMS)} (default lifl,sf); the reference always runs")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"update sizes, of {', '.join(SIZES)}")
    p.add_argument("--goals", default="100,1000", help="round goals (default 100,1000)")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="http, grpc or both (default both)")
    p.add_argument("--rounds", type=int, default=0,
                   help=f"measured rounds per figure (default: 6, or more for at least {MIN_UPDATES} updates)")
    p.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--connections", type=int, default=4, help="keep-alive connections per client process (default 4)")
    p.add_argument("--big-round", action="store_true", help=f"also one round of {BIG_ROUND} updates of 4 KB on lifl")


@dataclass(frozen=True)
class Case:
    size: str
    goal: int
    protocol: str
    rounds: int

    @property
    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The update's float32 tensors: a weight matrix taking half the bytes, vectors the rest."""
        values, n = SIZES[self.size] // 4, TENSORS[self.size]
        rows = values // 2 // 16
        vector = (values - rows * 16) // (n - 1)
        return [("weight", (rows, 16))] + [(f"bias{i}", (vector,)) for i in range(n - 1)]


class Clients:
    """The client processes of one figure, and the parent's side of their control lines."""

    def __init__(self, case: Case, address: str, job: str, token: str, count: int, connections: int, seed: int) -> None:
        self.procs = []
        for s in range(seed, seed + count):
            config = loadgen.Config(case.protocol, address, job, token, case.shapes, s, connections, f"p{s}")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "lifl.bench.loadgen", json.dumps(asdict(config))],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        self.selector = selectors.DefaultSelector()
        self._lines: dict[int, bytearray] = {}
        for p in self.procs:
            assert p.stdout is not None
            os.set_blocking(p.stdout.fileno(), False)
            self.selector.register(p.stdout.fileno(), selectors.EVENT_READ, p)
            self._lines[p.stdout.fileno()] = bytearray()

    def wait_ready(self) -> None:
        ready, deadline = 0, time.monotonic() + 120
        while ready < len(self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("client processes did not connect")
            ready += sum(1 for m in self.messages(1.0) if m.get("ready"))

    def tell(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message) + "\n").encode()
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line)
            p.stdin.flush()

    def messages(self, timeout: float) -> Iterator[dict[str, Any]]:
        """What the clients said within ``timeout`` seconds (returns at the first that said anything)."""
        for key, _ in self.selector.select(timeout):
            data = os.read(key.fd, 1 << 20)
            if not data:
                raise RuntimeError(f"a client process exited (status {key.data.wait()})")
            buf = self._lines[key.fd]
            buf += data
            while (end := buf.find(b"\n")) >= 0:
                line = bytes(buf[:end])
                del buf[: end + 1]
                yield json.loads(line)

    def stop(self) -> list[dict[str, Any]]:
        """Stop the clients; their reports."""
        self.tell({"stop": True})
        reports: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while len(reports) < len(self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("client processes did not report")
            reports += [m["report"] for m in self.messages(1.0) if "report" in m]
        for p in self.procs:
            p.wait(10)
        return reports

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Watched:
    """The job's version, read from the system's Redis only while clients wait for the next."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.appeared: dict[int, float] = {}  # version -> when it was first seen (monotonic)

    def wait_past(self, clients: Clients, version: int) -> int:
        """Watch until the version is past ``version``; the new version."""
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while True:
            current = self.read()
            if current > version:
                self.appeared.setdefault(current, time.monotonic())
                return current
            if time.monotonic() > deadline:
                raise RuntimeError(f"version {version} was not followed by another within {ROUND_TIMEOUT_S:g} s")
            list(clients.messages(WATCH_INTERVAL_S))  # "waiting" lines: we are watching already


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


class System:
    """One system under test and how to read its CPU time and versions."""

    def __init__(self, name: str, sut: LiflUnderTest | BaselineUnderTest) -> None:
        self.name, self.sut = name, sut

    def address(self, protocol: str) -> str:
        return self.sut.grpc if protocol == "grpc" else self.sut.http

    def cpu_by_role(self) -> dict[str, float]:
        raw = self.sut.cpu_by_role()
        if isinstance(self.sut, LiflUnderTest):
            return {role: raw.get(role, 0.0) for role in ROLES}
        return {"gateway": raw.get("frontend", 0.0), "agent": 0.0, "aggregators": raw.get("aggregators", 0.0),
                "redis": raw.get("broker", 0.0), "other": raw.get("sidecars", 0.0)}


def measure(system: System, case: Case, clients_n: int, connections: int, seed: int) -> dict[str, Any]:
    """One figure: a fresh job, a warm-up round, then ``case.rounds`` measured rounds."""
    job = f"tp-{system.name}-{case.size}-{case.goal}-{case.protocol}-{seed}"
    sut = system.sut
    gateway = Gateway(sut.http, token=sut.token)
    try:
        gateway.create_job(job, case.goal)
        gateway.set_model(job, fmt.encode({n: np.zeros(s, np.float32) for n, s in case.shapes}))
    finally:
        gateway.close()
    watched = Watched(lambda: sut.version(job))
    clients = Clients(case, system.address(case.protocol), job, sut.token, clients_n, connections, seed)
    try:
        clients.wait_ready()
        version = watched.wait_past(clients, -1)
        clients.tell({"version": version})
        version = _next_version(clients, watched, version)  # the warm-up round
        before, started = system.cpu_by_role(), time.monotonic()
        first = version
        clients.tell({"version": version})
        for measured_round in range(case.rounds):
            version = _next_version(clients, watched, version)
            if measured_round < case.rounds - 1:  # not past the last: another round would replace the model checked
                clients.tell({"version": version})
        ended, after = time.monotonic(), system.cpu_by_role()
        reports = clients.stop()
    finally:
        clients.kill()
    # Clients that hear of a newer version from the server move to it by themselves, so on a
    # loaded machine a round can fill and close between two looks at the version: the rounds
    # measured are every one from ``first`` to the last version seen, and a round's close time
    # is known only when the version after it was seen appear.
    measured = range(first, version)
    acks = [r["rounds"].get(str(v), {}) for r in reports for v in measured]
    updates = sum(a.get("count", 0) for a in acks)
    closes = [(watched.appeared[v + 1] - max(r["rounds"][str(v)]["last_ack"] for r in reports if str(v) in r["rounds"])) * 1e3
              for v in measured if v + 1 in watched.appeared and any(str(v) in r["rounds"] for r in reports)]
    latencies = [ms for r in reports for ms in r["latencies_ms"]]
    cpu = {role: (after[role] - before[role]) * 1e3 / max(updates, 1) for role in ROLES}
    return {
        "system": system.name, "size": case.size, "goal": case.goal, "protocol": case.protocol, "rounds": len(measured),
        "updates": updates, "expected_updates": len(measured) * case.goal,
        "updates_per_s": round(updates / (ended - started), 1),
        "cpu_ms_per_update": round(sum(cpu.values()), 4),
        "cpu_ms_per_update_by_role": {role: round(v, 4) for role, v in cpu.items()},
        "ack_ms_p50": _percentile(latencies, 50), "ack_ms_p99": _percentile(latencies, 99),
        "close_ms": _percentile(closes, 50), "close_ms_max": round(max(closes), 3) if closes else None,
        "refused": _merged([r["refused"] for r in reports]),
        "exact": _exact(sut, job, case, reports),
    }


def _next_version(clients: Clients, watched: Watched, version: int) -> int:
    """Wait for a client to find round ``version`` full, then for the next version."""
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while not any(m.get("waiting", -2) >= version for m in clients.messages(1.0)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no client found round {version} full within {ROUND_TIMEOUT_S:g} s")
    return watched.wait_past(clients, version)


def _merged(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _exact(sut: LiflUnderTest | BaselineUnderTest, job: str, case: Case, reports: list[dict[str, Any]]) -> bool:
    """Whether the current model is the FedAvg of the updates that the clients were told were
    acknowledged in the round that made it (clients that heard of a newer version move on by
    themselves, so on a fast round they may have filled one past the last measured before they
    stopped)."""
    gateway = Gateway(sut.http, token=sut.token)
    try:
        version, model_blob = gateway.model(job)
    finally:
        gateway.close()
    total: dict[str, np.ndarray] = {n: np.zeros(s, np.float64) for n, s in case.shapes}
    samples = 0
    for report in reports:
        acks = report["rounds"].get(str(version - 1))
        if not acks:
            continue
        for blob, weight in zip(loadgen.variant_blobs(case.shapes, report["seed"]), acks["samples"]):
            if weight:
                for name, array in from_blob(blob).items():
                    total[name] += weight * array.astype(np.float64)
                samples += weight
    model = from_blob(model_blob)
    return samples > 0 and all(np.allclose(model[n], total[n] / samples, rtol=1e-5, atol=1e-7) for n in total)


@contextlib.contextmanager
def reference_sink(protocol: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    proc = subprocess.Popen([sys.executable, "-m", "lifl.bench.requestsink", protocol], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{int(proc.stdout.readline())}", proc
    finally:
        proc.kill()
        proc.wait()


def measure_reference(case: Case, clients_n: int, connections: int, seed: int) -> dict[str, Any]:
    """The reference sink answering as many updates as a system's figure has, with the same clients."""
    with reference_sink(case.protocol) as (address, proc):
        clients = Clients(case, address, "reference", "", clients_n, connections, seed)
        try:
            clients.wait_ready()
            before, started = procstat.cpu_seconds([proc.pid]), time.monotonic()
            clients.tell({"version": 0, "limit": math.ceil(max(case.rounds * case.goal, REFERENCE_MIN_UPDATES) / clients_n)})
            finished = 0
            deadline = started + ROUND_TIMEOUT_S
            while finished < clients_n:
                if time.monotonic() > deadline:
                    raise RuntimeError("the reference's clients did not finish")
                finished += sum(1 for m in clients.messages(1.0) if m.get("finished"))
            ended, after = time.monotonic(), procstat.cpu_seconds([proc.pid])
            reports = clients.stop()
        finally:
            clients.kill()
    updates = sum(r["rounds"].get("0", {}).get("count", 0) for r in reports)
    latencies = [ms for r in reports for ms in r["latencies_ms"]]
    return {"system": REFERENCE, "size": case.size, "goal": case.goal, "protocol": case.protocol, "updates": updates,
            "updates_per_s": round(updates / (ended - started), 1),
            "cpu_ms_per_update": round((after - before) * 1e3 / max(updates, 1), 4),
            "ack_ms_p50": _percentile(latencies, 50), "ack_ms_p99": _percentile(latencies, 99)}


def targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures it compares and whether it is met."""
    out: list[dict[str, Any]] = []
    by_key = {(r["system"], r["size"], r["goal"], r["protocol"]): r for r in results}
    for (system, size, goal, protocol), r in by_key.items():
        if system != "lifl":
            continue
        sf = by_key.get(("sf", size, goal, "http"))
        if sf is not None:
            ratio = r["cpu_ms_per_update"] / sf["cpu_ms_per_update"]
            out.append({"target": "cpu_vs_sf", "size": size, "goal": goal, "protocol": protocol, "ratio": round(ratio, 3),
                        "at_most": CPU_TARGETS[size], "met": ratio <= CPU_TARGETS[size]})
            rate = r["updates_per_s"] / sf["updates_per_s"]
            out.append({"target": "rate_vs_sf", "size": size, "goal": goal, "protocol": protocol, "ratio": round(rate, 3),
                        "at_least": RATE_TARGET, "met": rate >= RATE_TARGET})
        ref = by_key.get((REFERENCE, size, goal, protocol))
        if ref is not None and size in REFERENCE_CPU_STRETCH:
            ratio = r["cpu_ms_per_update"] / ref["cpu_ms_per_update"]
            out.append({"target": "cpu_vs_reference (stretch)", "size": size, "goal": goal, "protocol": protocol,
                        "ratio": round(ratio, 3), "at_most": REFERENCE_CPU_STRETCH[size],
                        "met": ratio <= REFERENCE_CPU_STRETCH[size]})
    return out


def big_round_target(big: dict[str, Any]) -> dict[str, Any]:
    return {"target": "big_round_close_ms", "size": big["size"], "goal": big["goal"], "protocol": big["protocol"],
            "close_ms": big["close_ms"], "at_most": BIG_ROUND_CLOSE_MS, "exact": big["exact"],
            "met": big["exact"] and big["updates"] == big["expected_updates"] and big["close_ms"] <= BIG_ROUND_CLOSE_MS}


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"lifl bench throughput: unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return names


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    systems = _names(args.systems, SYSTEMS, "system")
    sizes = _names(args.sizes, tuple(SIZES), "size")
    protocols = _names(args.protocols, PROTOCOLS, "protocol")
    try:
        goals = [int(g) for g in args.goals.split(",")]
    except ValueError:
        raise SystemExit(f"lifl bench throughput: --goals takes integers, got {args.goals!r}") from None
    if args.clients < 1 or args.connections < 1 or args.rounds < 0 or not goals or min(goals) < 1:
        raise SystemExit("lifl bench throughput: clients, connections and goals must be positive")
    if args.big_round and "lifl" not in systems:
        raise SystemExit("lifl bench throughput: --big-round runs on lifl: include it in --systems")
    results: list[dict[str, Any]] = []
    big: dict[str, Any] | None = None
    seeds = itertools.count(1000, 100)
    tmp = Path(tempfile.mkdtemp(prefix="lifl-throughput-", dir="/tmp"))
    os.chmod(tmp, 0o755)  # the node's service user reaches its directories through it
    with open(tmp / "systems.log", "w") as log, contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        up = {name: System(name, stack.enter_context(running(name, tmp, log))) for name in systems}
        for i, (size, goal, protocol) in enumerate(itertools.product(sizes, goals, protocols)):
            case = Case(size, goal, protocol, args.rounds or max(6, math.ceil(MIN_UPDATES / goal)))
            for name in systems if i % 2 == 0 else systems[::-1]:  # alternating order: drift hits both alike
                if name != "lifl" and protocol != "http":
                    continue
                say(f"{name}: {case.rounds} rounds of {goal} updates of {size} over {protocol}")
                results.append(measure(up[name], case, args.clients, args.connections, next(seeds)))
            say(f"reference: {case.rounds * goal} updates of {size} over {protocol}")
            results.append(measure_reference(case, args.clients, args.connections, next(seeds)))
        if args.big_round:
            say(f"lifl: one round of {BIG_ROUND} updates of 4k over http")
            big = measure(up["lifl"], Case("4k", BIG_ROUND, "http", 1), args.clients, args.connections, next(seeds))
    checks = targets(results) + ([big_round_target(big)] if big is not None else [])
    return {
        "config": {"systems": systems, "sizes": sizes, "goals": goals, "protocols": protocols, "clients": args.clients,
                   "connections": args.connections, "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "results": results,
        "big_round": big,
        "targets": checks,
        "all_targets_met": all(t["met"] for t in checks),
    }


def tables(result: dict[str, Any]) -> str:
    lines = ["system     size  goal  proto  updates/s  cpu ms/update  (gateway agent aggregators redis other)  "
             "ack p50/p99 ms   close ms"]
    for r in result["results"]:
        roles = r.get("cpu_ms_per_update_by_role", {})
        split = " ".join(f"{roles.get(role, 0):.3f}" for role in ROLES) if roles else "-"
        close = f"{r['close_ms']}" if r.get("close_ms") is not None else "-"
        lines.append(f"{r['system']:<10} {r['size']:<5} {r['goal']:<5} {r['protocol']:<6} {r['updates_per_s']:>9} "
                     f"{r['cpu_ms_per_update']:>14.3f}  ({split})  {r['ack_ms_p50']}/{r['ack_ms_p99']}  {close}"
                     + ("" if r.get("exact", True) else "  NOT EXACT"))
    if result["big_round"]:
        b = result["big_round"]
        lines.append(f"big round: {b['updates']} updates of {b['size']}, close {b['close_ms']} ms, exact: {b['exact']}")
    for t in result["targets"]:
        lines.append(f"target {t['target']} {t['size']} goal {t['goal']} {t['protocol']}: "
                     f"{t.get('ratio', t.get('close_ms'))} ({'met' if t['met'] else 'MISSED'})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args, say=(lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True)))
    print(json.dumps(result) if args.json else tables(result))
    return 0
