"""`lifl demo`: federated learning end to end on this machine, through a real lifl node.

It starts a node (agent, gateway, its own redis-server), or with ``--gateway`` uses a running
one (a lifl node pod on Kubernetes, say), creates a job with a fresh model,
and starts worker processes that simulate a population of clients (``lifl.workload``), which
train on non-IID splits of the digits data and send their updates over HTTP and gRPC. Every
new global version is evaluated on the held-out test split until the target accuracy is
reached. It then prints a summary (rounds, aggregation completion time per round, time to
accuracy, aggregation CPU-seconds, peak memory) and writes plots to the results directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lifl import procstat
from lifl.client import Gateway, from_blob, to_blob
from lifl.node.supervisor import Node, NodeConfig
from lifl.protocol import ROLES
from lifl.state import ClusterState
from lifl.models import MODELS, make_model
from lifl.workload import evaluate, load_digits_split, wait_ready, worker_shares

JOB = "digits"
TENANT = "demo"
CLIENT_TOKEN_TTL_S = 86400.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=100, help="client population (default 100)")
    p.add_argument("--active", type=int, default=20, help="clients training at a time (default 20)")
    p.add_argument("--goal", type=int, default=10, help="updates aggregated per round (default 10)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew; smaller is less IID (default 0.5)")
    p.add_argument("--model", choices=MODELS, default="cnn", help="default: a small CNN")
    p.add_argument("--target", type=float, default=0.9, help="test accuracy to reach (default 0.9)")
    p.add_argument("--hibernate", type=float, default=1.0,
                   help="the most seconds a client rests between rounds: the paper's 60 s scaled (default 1)")
    p.add_argument("--deadline", type=float, default=0.0, help="round deadline in seconds (default: none)")
    p.add_argument("--workers", type=int, default=2, help="client worker processes (default 2)")
    p.add_argument("--protocol", choices=("http", "grpc", "mixed"), default="mixed")
    p.add_argument("--max-minutes", type=float, default=9.0, help="give up after this long (default 9)")
    p.add_argument("--results", type=Path, default=Path("results"), help="directory for plots and the summary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--gateway", metavar="HOST:PORT",
                   help="train through this running node's HTTP gateway instead of starting one; the operator's token "
                        "comes from $LIFL_OPERATOR_TOKEN (aggregation CPU is then not measured: it is the node's)")
    p.add_argument("--grpc", metavar="HOST:PORT", help="with --gateway: its gRPC address (default: its host, port 50051)")


MONITOR_INTERVAL_S = 0.5


@dataclass
class Sample:
    t: float
    arrivals: float
    aggregators: int  # instances working on a task
    instances: int  # instances alive (working or warm)
    cpu_s: float
    memory_mb: float


@dataclass
class Evaluation:
    t: float
    version: int
    accuracy: float
    cpu_s: float


@dataclass
class Monitor:
    """Samples the node every half second: arrivals, aggregators, CPU and memory."""

    node: Node | None  # None: a node elsewhere (--gateway), whose processes are not ours to measure
    gateway_http: str
    operator_token: str  # metrics are the operator's
    state: ClusterState | None  # None with node None
    t0: float
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_seconds(self) -> float:
        """Aggregation CPU: gateway, agent, and the aggregators (live, and exited ones); NaN for a
        node elsewhere."""
        if self.node is None:
            return float("nan")
        pids = self.node.pids()
        return (procstat.cpu_seconds(pids["agent"], reaped_children=True)
                + procstat.cpu_seconds(pids["gateway"] + pids["aggregators"]))

    def _run(self) -> None:
        gateway = Gateway(self.gateway_http, token=self.operator_token)
        try:
            while not self._stop.wait(MONITOR_INTERVAL_S):
                self.samples.append(self._sample(gateway))
        finally:
            gateway.close()

    def _sample(self, gateway: Gateway) -> Sample:
        text = gateway.metrics()
        arrivals = sum(float(m) for m in re.findall(r'^lifl_update_arrivals_total\{[^}]*\} (\S+)$', text, re.M))
        if self.node is None:
            roles = dict(re.findall(r'^lifl_aggregator_instances\{role="(\w+)"\} (\S+)$', text, re.M))
            alive = sum(float(n) for n in roles.values())
            busy = alive - float(roles.get("idle", 0))
            return Sample(time.monotonic() - self.t0, arrivals, int(busy), int(alive), float("nan"), float("nan"))
        assert self.state is not None
        status = self.state.nodes().get(self.node.config.node)
        job = status.jobs.get(JOB) if status is not None else None
        busy = sum(job.at_work(role) for role in ROLES) if job is not None else 0
        pids = self.node.pids()
        return Sample(time.monotonic() - self.t0, arrivals, busy, status.instances.total if status is not None else 0,
                      self.cpu_seconds(), procstat.pss_mb(pids["agent"] + pids["gateway"] + pids["aggregators"]))


class Progress:
    """One line that redraws itself on a terminal; a line every few seconds otherwise."""

    def __init__(self, target: float, quiet: bool) -> None:
        self.target, self.quiet = target, quiet
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, t: float, version: int, accuracy: float, updates_per_s: float, aggregators: int) -> None:
        if self.quiet or not self.tty and t - self._last < 5:
            return
        self._last = t
        width = 24
        filled = min(width, int(width * accuracy / self.target))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] accuracy {accuracy:.3f}/{self.target:.2f}  version {version}"
                f"  {updates_per_s:5.1f} updates/s  {aggregators} aggregators  {t:6.1f} s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def enrol_clients(tenant: Gateway, clients: int, path: Path) -> None:
    """A client token for each client of the population, written 0600 to ``path`` for the workers
    (each client authenticates as itself, as on a real deployment)."""
    tokens = {f"client-{c}": tenant.create_token("client", TENANT, job=JOB, client=f"client-{c}", ttl_s=CLIENT_TOKEN_TTL_S)["token"]
              for c in range(clients)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tokens, f)


def start_workers(args: argparse.Namespace, http: str, grpc: str, tokens: Path) -> list[subprocess.Popen]:
    workers = []
    for w, (first, count, slots) in enumerate(worker_shares(args.clients, args.active, args.workers)):
        workers.append(subprocess.Popen([
            sys.executable, "-m", "lifl.workload", "--http", http, "--grpc", grpc, "--job", JOB, "--model", args.model,
            "--clients", str(args.clients), "--first-client", str(first), "--n-clients", str(count), "--slots", str(slots),
            "--alpha", str(args.alpha), "--hibernate", str(args.hibernate), "--protocol", args.protocol,
            "--seed", str(args.seed), "--worker", str(w), "--tokens", str(tokens),
        ], stdout=subprocess.PIPE, text=True))
    wait_ready(workers)
    return workers


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.active > args.clients or args.goal > args.active:
        raise SystemExit("lifl demo: need goal <= active <= clients")
    tmp = Path(tempfile.mkdtemp(prefix="lifl-demo-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    args.results.mkdir(parents=True, exist_ok=True)
    log = open(args.results / "node.log", "w")
    node = None if args.gateway else Node(NodeConfig(
        node=f"demo{os.getpid() % 10000}", http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=tmp / "run", data_dir=tmp / "data"),
        log=log)
    workers: list[subprocess.Popen] = []
    try:
        if node is None:
            http, grpc, operator_token = args.gateway, args.grpc or f"{args.gateway.rsplit(':', 1)[0]}:50051", \
                os.environ.get("LIFL_OPERATOR_TOKEN", "")
            if not operator_token:
                raise SystemExit("lifl demo --gateway: set LIFL_OPERATOR_TOKEN to the node's operator token")
            state = None
        else:
            addresses = node.start()
            http, grpc, operator_token = addresses.http, addresses.grpc, node.operator_token
            state = ClusterState(addresses.redis)
        # as a platform's users would: the operator makes a tenant, which makes the job and its clients' tokens
        operator = Gateway(http, token=operator_token)
        gateway = Gateway(http, token=operator.create_token("tenant", TENANT, ttl_s=CLIENT_TOKEN_TTL_S)["token"])
        operator.close()
        gateway.create_job(JOB, args.goal, lease_ttl_s=10.0, round_deadline_s=args.deadline, min_updates=1)
        model = make_model(args.model, args.seed)
        gateway.set_model(JOB, to_blob(model.state_dict()))
        test = load_digits_split(args.clients, args.alpha, args.seed).test
        enrol_clients(gateway, args.clients, tmp / "client-tokens.json")
        workers = start_workers(args, http, grpc, tmp / "client-tokens.json")
        t0 = time.monotonic()
        monitor = Monitor(node, http, operator_token, state, t0)
        monitor.start()
        evaluations = train_until_target(args, gateway, model, test, monitor, t0)
        wall = time.monotonic() - t0
        for w in workers:
            w.terminate()
        monitor.stop()
        rounds = gateway.rounds(JOB, 10000)
        cpu = monitor.cpu_seconds()
        gateway.close()
    finally:
        for w in workers:
            w.terminate()
            w.wait(10)
        if node is not None:
            node.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarize(args, evaluations, rounds, monitor.samples, wall, cpu)
    summary["plots"] = plot(args.results, args.target, evaluations, monitor.samples)
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # the arrival trace (updates received so far, every half second): what `lifl bench knative` replays
    (args.results / "arrivals.json").write_text(json.dumps({
        "interval_s": MONITOR_INTERVAL_S, "goal": args.goal, "active": args.active,
        "arrivals": [round(s.arrivals) for s in monitor.samples]}) + "\n")
    return summary


def train_until_target(args: argparse.Namespace, gateway: Gateway, model: Any, test: Any, monitor: Monitor, t0: float) -> list[Evaluation]:
    progress = Progress(args.target, quiet=args.json)
    evaluations = [Evaluation(0.0, 0, evaluate(model, test), 0.0)]
    limit = t0 + args.max_minutes * 60
    try:
        while evaluations[-1].accuracy < args.target and time.monotonic() < limit:
            version = gateway.job(JOB)["version"]
            if version > evaluations[-1].version:
                version, blob = gateway.model(JOB)
                model.load_state_dict(from_blob(blob, as_torch=True))
                evaluations.append(Evaluation(time.monotonic() - t0, version, evaluate(model, test), monitor.cpu_seconds()))
            s = monitor.samples[-2:]
            rate = (s[-1].arrivals - s[0].arrivals) / max(1e-9, s[-1].t - s[0].t) if len(s) == 2 else 0.0
            e = evaluations[-1]
            progress.show(time.monotonic() - t0, e.version, e.accuracy, rate, s[-1].aggregators if s else 0)
            time.sleep(0.05)
    finally:
        progress.end()
    return evaluations


def summarize(args: argparse.Namespace, evaluations: list[Evaluation], rounds: list[dict[str, Any]], samples: list[Sample],
              wall: float, cpu: float) -> dict[str, Any]:
    done = [r for r in rounds if r["outcome"] in ("complete", "partial")]
    act = np.array([r["seconds"] for r in done]) * 1e3 if done else np.array([np.nan])
    reached = next((e for e in evaluations if e.accuracy >= args.target), None)
    outcomes: dict[str, int] = {}
    for r in rounds:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "rounds": len(done),
        "rounds_by_outcome": outcomes,
        "final_accuracy": round(evaluations[-1].accuracy, 4),
        "target_accuracy": args.target,
        "reached_target": reached is not None,
        "time_to_accuracy_s": round(reached.t, 2) if reached else None,
        "cpu_to_accuracy_s": _measured(reached.cpu_s) if reached else None,
        "act_p50_ms": round(float(np.percentile(act, 50)), 1),
        "act_p95_ms": round(float(np.percentile(act, 95)), 1),
        "aggregation_cpu_s": _measured(cpu),
        "peak_memory_mb": _measured(max((s.memory_mb for s in samples), default=0.0), 1),
        "wall_s": round(wall, 2),
        "versions": evaluations[-1].version,
        "setup": {"model": args.model, "clients": args.clients, "active": args.active, "goal": args.goal, "alpha": args.alpha,
                  "hibernate_s": args.hibernate, "deadline_s": args.deadline or None, "protocol": args.protocol},
    }


def _measured(value: float, digits: int = 2) -> float | None:
    """None for what was not measured (NaN: the node's processes are elsewhere)."""
    return None if math.isnan(value) else round(value, digits)


def plot(results: Path, target: float, evaluations: list[Evaluation], samples: list[Sample]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, x, label in (("accuracy_vs_time.png", [e.t for e in evaluations], "wall time (s)"),
                           ("accuracy_vs_cpu.png", [e.cpu_s for e in evaluations], "aggregation CPU time (s)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(x, [e.accuracy for e in evaluations], marker=".")
        ax.axhline(target, color="grey", linestyle="--", label=f"target {target:.0%}")
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(results / name, dpi=110)
        plt.close(fig)
        paths.append(str(results / name))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    t = [s.t for s in samples]
    rate = [0.0] + [(b.arrivals - a.arrivals) / (b.t - a.t) for a, b in zip(samples, samples[1:])]
    top.plot(t, rate)
    top.set_ylabel("updates / s")
    top.grid(alpha=0.3)
    bottom.plot(t, [s.aggregators for s in samples], label="working")
    bottom.plot(t, [s.instances for s in samples], label="alive (incl. warm)", linestyle="--")
    bottom.set_ylabel("aggregators")
    bottom.set_xlabel("wall time (s)")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(results / "arrivals_and_aggregators.png", dpi=110)
    plt.close(fig)
    paths.append(str(results / "arrivals_and_aggregators.png"))
    return paths


def print_summary(s: dict[str, Any]) -> None:
    setup = s["setup"]
    rows = [
        ("rounds", f"{s['rounds']}  ({', '.join(f'{n} {k}' for k, n in s['rounds_by_outcome'].items())})"),
        ("final accuracy", f"{s['final_accuracy']:.3f}  (target {s['target_accuracy']:.2f}, version {s['versions']})"),
        ("time to accuracy", f"{s['time_to_accuracy_s']} s" if s["reached_target"] else "not reached"),
        ("aggregation completion", f"p50 {s['act_p50_ms']} ms, p95 {s['act_p95_ms']} ms per round"),
        ("aggregation CPU", f"{s['aggregation_cpu_s']} CPU-s  ({s['cpu_to_accuracy_s']} CPU-s to accuracy)"
                            if s["aggregation_cpu_s"] is not None else "not measured (the node runs elsewhere)"),
        ("peak memory", f"{s['peak_memory_mb']} MB  (gateway + agent + aggregators, PSS)"
                        if s["peak_memory_mb"] is not None else "not measured (the node runs elsewhere)"),
        ("plots", ", ".join(s["plots"])),
    ]
    print(f"lifl demo: digits, {setup['model']}, {setup['clients']} clients ({setup['active']} active), goal {setup['goal']} per round")
    for k, v in rows:
        print(f"  {k:<24}{v}")


def main(args: argparse.Namespace) -> int:
    summary = run(args)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0 if summary["reached_target"] else 1
