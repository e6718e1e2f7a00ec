"""The FL job of `lifl bench compare`: the same clients, data, model and training against any
system that serves the client SDK's calls (lifl's gateway, or a baseline's frontend).

It is `lifl demo`'s workload (``lifl.workload``: digits split by Dirichlet label skew, the small
CNN, one local epoch of SGD) with a client loop every system can serve: no leases, which the
baselines do not have. A client takes the current model, trains, and pushes its update trained
from that version; if the round moved on (``version_conflict``) or is full (``round_full``) it
waits for the next version and trains again. Worker processes (``python -m lifl.bench.fljob``)
each run some client slots and print one line per accepted update, which the driver counts as
arrivals.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


from lifl.errors import Conflict
from lifl.models import MODELS, make_model
from lifl.workload import evaluate, load_digits_split, client_turn, slot_clients, train_local, wait_ready, worker_shares

JOB = "digits"
SAMPLE_INTERVAL_S = 0.5
CLIENT_WAIT_S = 2.0  # the longest a client's wait for the next version is held by the system


@dataclass
class JobSetup:
    clients: int = 100
    active: int = 20
    goal: int = 10
    alpha: float = 0.5
    hibernate_s: float = 1.0
    model: str = "cnn"
    target: float = 0.9
    max_minutes: float = 5.0
    workers: int = 2
    seed: int = 0
    rounds: int = 0  # > 0: run this many rounds, unevaluated (system load), instead of to the target

    def done(self, version: int, accuracy: float) -> bool:
        return version >= self.rounds if self.rounds else accuracy >= self.target


@dataclass
class Sample:
    t: float
    arrivals: int
    aggregators: int
    cpu_s: float


@dataclass
class Run:
    evaluations: list[tuple[float, int, float, float]] = field(default_factory=list)  # (t, version, accuracy, system CPU-s)
    samples: list[Sample] = field(default_factory=list)
    arrivals: list[tuple[float, float, int]] = field(default_factory=list)  # (sent, acknowledged, version it counted towards)

    def tails_ms(self, installed: dict[int, float]) -> list[float]:
        """Per round, from when its last update began to be sent until its result was installed
        (``installed``: wall clock by new version): the last upload and the aggregation the clients
        wait for. (Not from the acknowledgement: with eager aggregation the version may be
        installed before the last client has read its answer.)"""
        last: dict[int, float] = {}
        for sent, _, version in self.arrivals:
            last[version] = max(sent, last.get(version, sent))
        return [(installed[v + 1] - at) * 1e3 for v, at in sorted(last.items()) if v + 1 in installed]

    def reached(self, target: float) -> tuple[float, int, float] | None:
        """(time, version, system CPU-s) of the first version at or above the target accuracy."""
        return next(((t, v, c) for t, v, a, c in self.evaluations if a >= target), None)


# -- the clients --------------------------------------------------------------------------------


def wait_for_version(gateway: Any, after: int, stop: threading.Event) -> int:
    """Wait for a version past ``after`` as the SDK does (``Participant.wait_for_version``: the
    system holds each call until there is one), a call at most CLIENT_WAIT_S long so that a
    stopped run ends soon."""
    while not stop.is_set():
        version = gateway.wait_for_version(JOB, after, CLIENT_WAIT_S)["version"]
        if version > after:
            return version
    return after


def run_slot(slot: int, args: argparse.Namespace, data: Any, taken: set[int], lock: threading.Lock, stop: threading.Event,
             report: Callable[[str], None]) -> None:
    from lifl.client import Gateway, from_blob, to_blob

    model = make_model(args.model)
    gateway = Gateway(args.http, token=args.token or None)
    cached: tuple[int, Any] = (-1, None)
    for client, rng in slot_clients(slot, args, data, taken, lock, stop):
        with client_turn(client, stop):
            while not stop.is_set():
                version = gateway.wait_for_version(JOB)["version"]
                if version != cached[0]:
                    version, blob = gateway.model(JOB)
                    cached = (version, from_blob(blob, as_torch=True))
                model.load_state_dict(cached[1])
                samples = train_local(model, data.clients[client], rng)
                blob = to_blob(model.state_dict())
                try:
                    sent = time.time()
                    counted = gateway.push(JOB, blob, samples=samples, base_version=version, client=f"client-{client}")["version"]
                    report(f"accepted {sent!r} {time.time()!r} {counted}")
                    break
                except Conflict as e:
                    if e.code not in ("version_conflict", "round_full"):
                        raise
                    wait_for_version(gateway, version, stop)


def worker_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-compare-clients")
    p.add_argument("--http", required=True)
    p.add_argument("--token", default="", help="the operator's token (lifl); the baselines take none")
    p.add_argument("--model", default="cnn", choices=MODELS)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--first-client", type=int, required=True)
    p.add_argument("--n-clients", type=int, required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--alpha", type=float, required=True)
    p.add_argument("--hibernate", type=float, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--worker", type=int, required=True)
    args = p.parse_args(argv)
    import torch

    from lifl.procs import die_with_parent, on_signals

    torch.set_num_threads(1)
    die_with_parent()
    data = load_digits_split(args.clients, args.alpha, args.seed)
    stop = threading.Event()
    on_signals(stop.set)
    out = threading.Lock()

    def report(line: str) -> None:
        with out:
            print(line, flush=True)

    taken: set[int] = set()
    lock = threading.Lock()
    threads = [threading.Thread(target=run_slot, args=(i, args, data, taken, lock, stop, report), daemon=True)
               for i in range(args.slots)]
    for t in threads:
        t.start()
    report("clients ready")
    stop.wait()
    for t in threads:
        t.join(timeout=5)


# -- the driver ---------------------------------------------------------------------------------


def start_workers(setup: JobSetup, http: str, token: str) -> list[subprocess.Popen]:
    workers = []
    for w, (first, count, slots) in enumerate(worker_shares(setup.clients, setup.active, setup.workers)):
        workers.append(subprocess.Popen([
            sys.executable, "-m", "lifl.bench.fljob", "--http", http, f"--token={token}", "--model", setup.model,
            "--clients", str(setup.clients), "--first-client", str(first), "--n-clients", str(count), "--slots", str(slots),
            "--alpha", str(setup.alpha), "--hibernate", str(setup.hibernate_s), "--seed", str(setup.seed), "--worker", str(w),
        ], stdout=subprocess.PIPE, text=True))
    wait_ready(workers)
    return workers


def _count_arrivals(proc: subprocess.Popen, run: Run, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("accepted "):
            _, sent, acknowledged, version = line.split()
            with lock:
                run.arrivals.append((float(sent), float(acknowledged), int(version)))


def run_job(http: str, token: str, setup: JobSetup, cpu_seconds: Callable[[], float], aggregators: Callable[[], int],
            log: Callable[[str], None] = lambda _: None) -> Run:
    """Create the job on the system at ``http``, train until the target or the time limit, and
    sample arrivals, active aggregators and the system's cumulative CPU every half second."""
    from lifl.client import Gateway, from_blob, to_blob

    gateway = Gateway(http, token=token or None)
    gateway.create_job(JOB, setup.goal)
    model = make_model(setup.model, setup.seed)
    gateway.set_model(JOB, to_blob(model.state_dict()))
    test = load_digits_split(setup.clients, setup.alpha, setup.seed).test
    run = Run()
    lock = threading.Lock()
    workers = start_workers(setup, http, token)
    readers = [threading.Thread(target=_count_arrivals, args=(w, run, lock), daemon=True) for w in workers]
    for r in readers:
        r.start()
    t0 = time.monotonic()
    wall0 = time.time()
    cpu0 = cpu_seconds()
    run.evaluations.append((0.0, 0, evaluate(model, test), 0.0))
    next_sample = t0
    try:
        while not setup.done(*run.evaluations[-1][1:3]) and time.monotonic() < t0 + setup.max_minutes * 60:
            now = time.monotonic()
            if now >= next_sample:
                with lock:
                    arrived = sum(1 for _, at, _ in run.arrivals if at >= wall0)
                run.samples.append(Sample(now - t0, arrived, aggregators(), cpu_seconds() - cpu0))
                next_sample += SAMPLE_INTERVAL_S
            last = run.evaluations[-1][1]
            version = gateway.wait_for_version(JOB, last, max(0.0, next_sample - time.monotonic()))["version"]
            if version > last and setup.rounds:
                run.evaluations.append((time.monotonic() - t0, version, math.nan, cpu_seconds() - cpu0))
            elif version > last:
                version, blob = gateway.model(JOB)
                model.load_state_dict(from_blob(blob, as_torch=True))
                run.evaluations.append((time.monotonic() - t0, version, evaluate(model, test), cpu_seconds() - cpu0))
                log(f"version {version}: accuracy {run.evaluations[-1][2]:.3f} at {run.evaluations[-1][0]:.1f} s")
        run.samples.append(Sample(time.monotonic() - t0, len(run.arrivals), aggregators(), cpu_seconds() - cpu0))
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(15)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        gateway.close()
    return run


if __name__ == "__main__":
    worker_main()
