"""`lifl bench orchestration`: the paper's Fig. 8, side by side on emulated nodes.

For each load (updates arriving at once) and each system, a fresh cluster of ``--nodes``
namespaced nodes (lifl.node.cluster) aggregates one round; the systems differ only in the
control plane's switches (paper §6.1):

- SL-H: Knative's least-connection load balancing, lazy aggregation, no reuse (every task on a
  new instance: cold starts), no hierarchy planning — on lifl's data plane;
- +1: BestFit placement (§5.1);
- +123: and hierarchy planning (§5.2: instances warmed for the planned tree from the queue,
  which, as in the paper's experiment, equals the known assignments) and reuse (§5.3);
- +1234: and eager aggregation (§5.4).

Clients ask any gateway for their node (the round's placement), then all send their updates at
once. ACT is from that moment until the top has the aggregated model (the installing node's
record, less the time it then spent writing the checkpoint, the same for all); CPU is every
node process's CPU time (agents, gateways, aggregators, including instances that exited) from
just before the clients asked for their nodes (so planning and warming count) until the end;
aggregators created counts cold starts and warmed instances; nodes used are the nodes that
received updates.

The update size and the links: 230 MB updates need far more memory than one machine has at
100 updates, so the size is scaled down to what fits, and the links between nodes are shaped
(traffic to and from clients is not) so that sending a partial result across nodes costs the
same multiple of aggregating an update as in the paper (``--transfer-ratio``; see
``PAPER_TRANSFER_RATIO``). Both our aggregation time and our cold start are measured in the
same run and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.bench.dataplane import ShmBuffer, synthetic_shapes
from lifl.client import Gateway
from lifl.control.controller import ControlConfig
from lifl.control.planner import BESTFIT, LEAST_CONNECTION, Counters, NodeLoad, estimate, place
from lifl.kernels import Tensors, fold
from lifl.node import netns
from lifl.node.cluster import Cluster, ClusterConfig
from lifl.procstat import cpu_seconds, meminfo_bytes
from lifl.state import ClusterState

SYSTEMS: dict[str, dict[str, Any]] = {
    "SL-H": {"placement": LEAST_CONNECTION, "prewarm": False, "reuse": False, "lazy": True},
    "+1": {"placement": BESTFIT, "prewarm": False, "reuse": False, "lazy": True},
    "+123": {"placement": BESTFIT, "prewarm": True, "reuse": True, "lazy": True},
    "+1234": {"placement": BESTFIT, "prewarm": True, "reuse": True, "lazy": False},
}
# The paper's ratio of sending an update across nodes to aggregating one, from its own figures:
# ResNet-152 crosses nodes in ~4.2 s (§6.1), and placement alone cuts ACT 2.1x at 20 updates, so
# four crossings into the top cost about as much as the rest of +1's round: a cold-started leaf,
# middle and top plus about 13 sequential lazy folds (10 leaves' pairs in parallel, the middle's
# 10 inputs, the top's one) come to ~15 s, i.e. ~0.7 s per fold: 4.2 / 0.7 = 6.
PAPER_TRANSFER_RATIO = 6.0
PAPER = {"act_sl_h_over_1_at_20": 2.1, "act_1_over_123": 1.22, "act_123_over_1234": 1.2,
         "bestfit_nodes": {20: 1, 60: 3, 100: 5}, "placement_10k_ms": 17.0, "ewma_estimate_ms": 0.2}
PLACEMENT_TARGET_MS = 5.0
PREFIX, SUBNET = "liflb", "10.80.0.0/24"
MAX_UPDATE_MB = 230.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--nodes", type=int, default=5, help="emulated nodes (default 5, as the paper)")
    p.add_argument("--capacity", type=float, default=20.0, help="MC of every node (default 20, as the paper)")
    p.add_argument("--loads", default="20,60,100", help="updates arriving at once, comma-separated (default 20,60,100)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--update-mb", type=float, help=f"update size (default: the largest up to {MAX_UPDATE_MB:g} that fits)")
    p.add_argument("--transfer-ratio", type=float, default=PAPER_TRANSFER_RATIO,
                   help=f"a partial crossing nodes costs this many update aggregations (default {PAPER_TRANSFER_RATIO:g}, the paper's)")
    p.add_argument("--link-rate", help="shape the links between nodes at this tc rate instead (e.g. 1gbit)")
    p.add_argument("--repeat", type=int, default=1, help="runs per system and load; medians are reported (default 1)")
    p.add_argument("--results", type=Path, default=Path("results"), help="where the plots go (default results/)")


def main(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("lifl bench orchestration: needs root (it emulates nodes in network namespaces)", file=sys.stderr)
        return 2
    loads = [int(x) for x in args.loads.split(",")]
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown or any(n < 1 for n in loads) or args.nodes < 1 or args.repeat < 1:
        print(f"lifl bench orchestration: bad --systems/--loads/--nodes/--repeat ({', '.join(sorted(unknown))})", file=sys.stderr)
        return 2
    result = run(args, loads, systems, log=True)  # progress on stderr, results on stdout
    result["plots"] = plot(args.results, result)
    print(json.dumps(result) if args.json else summary_table(result))
    return 0


# -- references measured in this run ---------------------------------------------------------------
def placement_ms(clients: int = 10_000, nodes: int = 5, capacity: float = 20.0, repeat: int = 50) -> float:
    """Median time to place ``clients`` updates on ``nodes`` with BestFit."""
    loads = [NodeLoad(f"n{i}", capacity * clients / nodes, 0.0) for i in range(nodes)]
    demands = [1.0] * clients
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        place(demands, loads, BESTFIT)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ewma_ms(repeat: int = 1000) -> float:
    """Median time of one EWMA estimate of a node's queue."""
    prev = estimate(None, Counters(0.0, 0, 0, 0.0))
    times = []
    for i in range(1, repeat + 1):
        now = Counters(float(i), 10 * i, 9 * i, 0.05 * i)
        t0 = time.perf_counter()
        prev = estimate(prev, now)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def aggregation_ms(update: bytes, reps: int = 5) -> float:
    """Our cost to aggregate one update: a leaf's fused fold of two, per update (as lifl does)."""
    layout = fmt.parse_layout(update)
    spec = layout.spec()
    a, b = ShmBuffer(len(update)), ShmBuffer(len(update))
    a.array[:] = b.array[:] = np.frombuffer(update, np.uint8)
    header = fmt.spec_header(spec.partial())
    acc = ShmBuffer(len(header) + spec.partial().data_bytes)
    acc.array[: len(header)] = np.frombuffer(header, np.uint8)
    acc_layout = fmt.parse_layout(acc.mm, allow_partial=True)
    ta, tb, tacc = Tensors.of(a.mm, layout, spec), Tensors.of(b.mm, layout, spec), Tensors.of(acc.mm, acc_layout, spec)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fold(tacc, [(ta, 1), (tb, 2)], init=True)
        times.append((time.perf_counter() - t0) * 1e3 / 2)
    for t in (ta, tb, tacc):
        t.release()
    for buf in (a, b, acc):
        buf.close()
    return statistics.median(times[1:])


def cold_start_ms(reps: int = 3) -> float:
    """A new aggregator instance's start: the runtime's interpreter and imports."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import lifl.runtime, lifl.functions.aggregator.handler"], check=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def update_size_mb(loads: list[int]) -> float:
    """The largest update (up to 230 MB) for which the biggest load, its accumulators (twice the
    update, one per two updates) and the pooled buffers fit in half the available memory."""
    available = meminfo_bytes("MemAvailable")
    return min(MAX_UPDATE_MB, float(int(available * 0.5 / (2.5 * max(loads)) / 1e6)))


# -- one round --------------------------------------------------------------------------------------
class Round:
    """One system aggregating one round of ``updates`` updates on a fresh cluster."""

    def __init__(self, args: argparse.Namespace, system: str, updates: int, blobs: list[bytes], model: bytes,
                 link_rate: str, base: Path) -> None:
        self.args, self.system, self.updates, self.blobs, self.model = args, system, updates, blobs, model
        switches = SYSTEMS[system]
        self.prewarm = switches["prewarm"]
        control = ControlConfig(placement=switches["placement"], capacity=args.capacity, period=0.2,
                                prewarm=switches["prewarm"])
        shm = int(2.6 * updates * len(blobs[0]) / max(1, args.nodes)) + (1 << 30)
        self.cluster = Cluster(ClusterConfig(
            nodes=args.nodes, node_stem="b", prefix=PREFIX, subnet=SUBNET, run_dir=base / "run", data_dir=base / "data",
            shm_capacity=max(shm, int(2.6 * min(updates, args.capacity) * len(blobs[0])) + (1 << 30)),
            max_instances=max(16, int(args.capacity) + 4), keep_warm=120.0, reuse=switches["reuse"],
            lazy=switches["lazy"], control=control, internode_rate=link_rate,
        ), log=open(os.devnull, "w"))

    def run(self) -> dict[str, Any]:
        addresses = self.cluster.start()
        try:
            return self._measure(addresses)
        finally:
            self.cluster.stop()

    def _pids(self) -> list[int]:
        return [pid for n in self.cluster.config.node_configs for pid in netns.namespace_pids(self.cluster.network.namespace(n))]

    def _created(self, gateways: list[Gateway]) -> float:
        return sum(sum(float(line.rsplit(" ", 1)[1]) for line in g.metrics().splitlines()
                       if line.startswith("lifl_aggregator_instances_created_total")) for g in gateways)

    def _measure(self, addresses: Any) -> dict[str, Any]:
        state = ClusterState(addresses.redis)
        token = self.cluster.operator_token
        gateways = [Gateway(a.http, token=token) for a in addresses.nodes.values()]
        gw = gateways[0]
        job = "bench"
        gw.create_job(job, self.updates, leaf_fan_in=2, over_selection=1.0, max_inflight=self.updates,
                      max_update_bytes=2 * len(self.blobs[0]))
        gw.set_model(job, self.model)
        cpu0, created0 = cpu_seconds(self._pids(), reaped_children=True), self._created(gateways)
        assigned = [gw.assignment(job, f"c{i}")["http"] for i in range(self.updates)]
        if self.prewarm:
            self._wait_warm(state)
        start = threading.Barrier(self.updates + 1)
        errors: list[BaseException] = []

        def client(i: int) -> None:
            g = Gateway(assigned[i], token=token)
            try:
                start.wait()
                g.push(job, self.blobs[i % len(self.blobs)], client=f"c{i}", samples=1 + i % 7, base_version=0)
            except BaseException as e:  # reported below
                errors.append(e)
            finally:
                g.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(self.updates)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.time()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} updates were refused: {errors[0]}")
        deadline = time.monotonic() + 900
        while gw.job(job)["version"] != 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.system}: the round did not complete: {gw.job(job)['round']}")
            time.sleep(0.02)
        last = gw.job(job)["last_round"]
        time.sleep(0.3)  # let the agents reap exited instances, so their CPU time is counted
        cpu = cpu_seconds(self._pids(), reaped_children=True) - cpu0
        created = self._created(gateways) - created0
        for g in gateways:
            g.close()
        return {
            "system": self.system, "updates": self.updates, "act_s": round(last["closed"] - last["checkpoint_s"] - t0, 3),
            "cpu_s": round(cpu, 2), "aggregators_created": int(created),
            "nodes_used": sum(1 for c in last["nodes"].values() if c > 0),
            "per_node": last["nodes"], "top": last["top"],
        }

    def _wait_warm(self, state: ClusterState, timeout: float = 300.0) -> None:
        """Until every node has the instances the planner asked it to keep warm, loaded and waiting."""
        deadline = time.monotonic() + timeout
        while True:
            plan = state.warm_plan()
            nodes = state.nodes()
            if plan and all(n in nodes and nodes[n].instances.ready >= sum(want.values()) for n, want in plan.items()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances were not warmed as planned: {plan}")
            time.sleep(0.05)


# -- the whole benchmark ----------------------------------------------------------------------------
def run(args: argparse.Namespace, loads: list[int], systems: list[str], log: bool) -> dict[str, Any]:
    size_mb = args.update_mb or update_size_mb(loads)
    rng = np.random.default_rng(152)
    shapes = synthetic_shapes(size_mb * 1e6, 64, rng)
    blobs = [bytes(fmt.encode({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes})) for _ in range(4)]
    model = bytes(fmt.encode({n: np.zeros(s, np.float32) for n, s in shapes}))
    agg = aggregation_ms(blobs[0])
    partial_bytes = len(fmt.spec_header(fmt.parse_layout(blobs[0]).spec().partial())) + 2 * len(blobs[0])
    link_rate = args.link_rate or f"{max(1, round(partial_bytes * 8 / (args.transfer_ratio * agg / 1e3) / 1e6))}mbit"
    refs = {"aggregate_ms": round(agg, 2), "cold_start_ms": round(cold_start_ms(), 1),
            "transfer_ms": round(partial_bytes * 8 / netns.parse_rate(link_rate) * 1e3, 1)}
    if log:
        print(f"lifl bench orchestration: {len(blobs[0]) / 1e6:.1f} MB updates, aggregation {refs['aggregate_ms']} ms/update, "
              f"links between nodes at {link_rate} (a partial crosses in {refs['transfer_ms']} ms), "
              f"cold start {refs['cold_start_ms']} ms", file=sys.stderr)
    runs = []
    for load in loads:
        for system in systems:
            samples = []
            for _ in range(args.repeat):
                base = Path(tempfile.mkdtemp(prefix="lifl-bench-", dir="/tmp"))
                os.chmod(base, 0o755)
                samples.append(Round(args, system, load, blobs, model, link_rate, base).run())
            r = _median_run(samples)
            runs.append(r)
            if log:
                print(f"  {load:>4} updates  {system:<6} ACT {r['act_s']:7.3f} s  CPU {r['cpu_s']:7.2f} s  "
                      f"aggregators {r['aggregators_created']:>3}  nodes {r['nodes_used']}  {r['per_node']}", file=sys.stderr)
    result = {
        "benchmark": "orchestration",
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "nodes": args.nodes, "capacity": args.capacity, "update_mb": round(len(blobs[0]) / 1e6, 1),
        "link_rate": link_rate, "transfer_ratio": args.transfer_ratio, "references": refs, "repeat": args.repeat,
        "placement_10k_ms": round(placement_ms(), 3), "ewma_estimate_ms": round(ewma_ms(), 5), "runs": runs,
    }
    result["improvements"] = improvements(runs)
    result["targets"] = targets(result)
    return result


def _median_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(min(samples, key=lambda s: abs(s["act_s"] - statistics.median(x["act_s"] for x in samples))))
    for key in ("act_s", "cpu_s"):
        out[key] = round(statistics.median(s[key] for s in samples), 3)
    return out


def improvements(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """ACT and CPU ratios between successive systems, per load."""
    by = {(r["system"], r["updates"]): r for r in runs}
    out: dict[str, dict[str, float]] = {}
    steps = (("SL-H", "+1"), ("+1", "+123"), ("+123", "+1234"), ("SL-H", "+1234"))
    for before, after in steps:
        for load in sorted({r["updates"] for r in runs}):
            a, b = by.get((before, load)), by.get((after, load))
            if a and b:
                out.setdefault(f"{before} -> {after}", {})[str(load)] = round(a["act_s"] / b["act_s"], 2)
                out.setdefault(f"{before} -> {after} cpu", {})[str(load)] = round(a["cpu_s"] / max(b["cpu_s"], 1e-9), 2)
    return out


def targets(result: dict[str, Any]) -> dict[str, bool]:
    imp = result["improvements"]
    out = {"placement_10k_ms <= 5": result["placement_10k_ms"] <= PLACEMENT_TARGET_MS}
    if "20" in imp.get("SL-H -> +1", {}):
        out["ACT SL-H / +1 at 20 >= 2.1"] = imp["SL-H -> +1"]["20"] >= PAPER["act_sl_h_over_1_at_20"]
    if "20" in imp.get("+1 -> +123", {}):
        out["ACT +1 / +123 at 20 >= 1.2"] = imp["+1 -> +123"]["20"] >= 1.2
    if "20" in imp.get("+123 -> +1234", {}):
        out["ACT +123 / +1234 at 20 >= 1.2"] = imp["+123 -> +1234"]["20"] >= 1.2
    for r in result["runs"]:
        if r["system"] == "+1" and r["updates"] in PAPER["bestfit_nodes"]:
            out[f"BestFit uses {PAPER['bestfit_nodes'][r['updates']]} nodes at {r['updates']}"] = (
                r["nodes_used"] == PAPER["bestfit_nodes"][r["updates"]])
    return out


def summary_table(result: dict[str, Any]) -> str:
    lines = [f"{result['update_mb']} MB updates, {result['nodes']} nodes of capacity {result['capacity']:g}, "
             f"links between nodes at {result['link_rate']}; references {result['references']}",
             f"{'updates':>8} {'system':<7} {'ACT s':>8} {'CPU s':>8} {'aggregators':>12} {'nodes':>6}"]
    for r in result["runs"]:
        lines.append(f"{r['updates']:>8} {r['system']:<7} {r['act_s']:>8.3f} {r['cpu_s']:>8.2f} "
                     f"{r['aggregators_created']:>12} {r['nodes_used']:>6}")
    lines.append(f"placing 10,000 clients: {result['placement_10k_ms']} ms; one EWMA estimate: {result['ewma_estimate_ms']} ms")
    lines.append(f"improvements (ACT ratios, >1 is better): {json.dumps(result['improvements'])}")
    lines.append(f"targets: {json.dumps(result['targets'])}")
    return "\n".join(lines)


def plot(directory: Path, result: dict[str, Any]) -> list[str]:
    """The four panels of the paper's Fig. 8: ACT, CPU, aggregators created, nodes used."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    loads = sorted({r["updates"] for r in runs})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in runs)]
    by = {(r["system"], r["updates"]): r for r in runs}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = (("act_s", "ACT (s)"), ("cpu_s", "CPU (s)"), ("aggregators_created", "aggregators created"),
              ("nodes_used", "nodes used"))
    width = 0.8 / len(systems)
    for ax, (key, label) in zip(axes, panels):
        for i, system in enumerate(systems):
            xs = [j + i * width for j in range(len(loads))]
            ax.bar(xs, [by[(system, n)][key] if (system, n) in by else 0 for n in loads], width, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(loads))], [str(n) for n in loads])
        ax.set_xlabel("updates arriving at once")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"lifl bench orchestration: {result['nodes']} nodes, {result['update_mb']} MB updates, "
                 f"links between nodes {result['link_rate']}")
    fig.tight_layout()
    path = directory / "orchestration.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
