"""`lifl bench knative`: lifl's autoscaler class against Knative's own (KPA), on the real test bed.

The same aggregator Service is deployed twice on scripts/k8s-testenv.sh's cluster: once with
stock KPA (its default concurrency target and windows) and once with lifl's class, and the same
arrival trace is replayed into both at once:

- ``demo``: the updates a `lifl demo` run received, every half second (lifl/bench/traces/demo.json,
  recorded with `lifl demo`, which writes results/arrivals.json);
- ``bursty``: the paper's pattern, bursts of updates with idle gaps between them.

Every update is a request that occupies an aggregator for ``SERVICE_S``. Both Services declare
``containerConcurrency`` = the job's leaf fan-in (an aggregator takes that many updates at once,
and a pod's CPU is no larger for KPA than for lifl), so KPA's default target follows from it
(70 % of it) and a pod holds no more requests than that: the rest wait, as queue-proxy and the
activator would make them. Knative's real autoscaler decides for KPA from the metrics it scrapes from each pod (served here on the pod's
IP, port 9090, in Knative's own protobuf ``Stat`` format, as queue-proxy would) and from what an
activator reports while there are no pods (requests it holds, over the autoscaler's websocket).
lifl's operator decides from its agents' metrics: a real lifl node (named as the kwok node it
stands for) gets each client's assignment when its training starts and its update when it
arrives. Reported per autoscaler and trace: pods over time, pod-seconds, scale-up latency to the
first burst (from its first update to the most pods the autoscaler gives it), cold starts (pods
created) and time at zero; a PNG of both timelines per trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TESTENV = ROOT / "scripts" / "k8s-testenv.sh"
INSIDE_ENV = "LIFL_BENCH_INSIDE_TESTBED"
TRACES = ("demo", "bursty")
AUTOSCALERS = ("kpa", "lifl")
SAMPLE_S = 0.5  # how often pods are counted
SERVICE_S = 2.0  # how long one update occupies an aggregator (its upload and its folds)
LEAF_FAN_IN = 2  # updates an aggregator takes at once: the job's leaf fan-in, the Service's containerConcurrency
TRAINING_S = 8.0  # how long before its update a client is assigned (it trains meanwhile)
ACTIVATOR_PERIOD_S = 1.0  # how often the emulated activator reports what it holds
SETTLE_S = 90.0  # after the trace: time for both to scale down (KPA: 60 s window + grace)
NAMESPACE = "default"
NODE = "kwok1"  # the lifl node: its id is the kwok node its metrics stand for
AUTOSCALER_STATS = "http://10.200.0.1:8080/"  # Knative autoscaler's stat server (the test bed's address)
DEMO_TRACE = Path(__file__).resolve().parent / "traces" / "demo.json"


# -- Knative's stat.proto, encoded by hand (proto3: fields by number and wire type) ------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _double(number: int, value: float) -> bytes:
    return _varint(number << 3 | 1) + struct.pack("<d", value)


def encode_stat(pod: str, concurrency: float, requests: float, uptime: float, timestamp: int) -> bytes:
    """metrics.Stat: pod_name 1, average_concurrent_requests 2, request_count 4, process_uptime 6, timestamp 7."""
    return (_bytes(1, pod.encode()) + _double(2, concurrency) + _double(4, requests) + _double(6, uptime)
            + _varint(7 << 3) + _varint(timestamp))


def encode_wire(namespace: str, revision: str, stat: bytes) -> bytes:
    """metrics.WireStatMessages{messages: [WireStatMessage{namespace 1, name 2, stat 3}]}."""
    return _bytes(1, _bytes(1, namespace.encode()) + _bytes(2, revision.encode()) + _bytes(3, stat))


# -- traces -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    name: str
    arrivals: list[float]  # seconds from the start at which each update arrives
    goal: int  # updates per round
    first_burst_s: float  # when the first burst is over (the next one starts): scale-up is measured within it

    @property
    def duration(self) -> float:
        return max(self.arrivals, default=0.0) + SERVICE_S


def bursty(bursts: int = 4, size: int = 40, spread_s: float = 3.0, gap_s: float = 25.0) -> Trace:
    """The paper's bursty arrivals: ``size`` updates within ``spread_s``, then nothing for ``gap_s``."""
    start = TRAINING_S  # the first clients are assigned at 0 and train first
    arrivals = [start + b * gap_s + spread_s * i / size for b in range(bursts) for i in range(size)]
    return Trace("bursty", arrivals, size, start + gap_s)


def demo(path: Path = DEMO_TRACE) -> Trace:
    """A `lifl demo` run's arrivals (cumulative, every ``interval_s``), each spread over its interval."""
    recorded = json.loads(path.read_text())
    step, counts = float(recorded["interval_s"]), recorded["arrivals"]
    arrivals: list[float] = []
    for i, (before, after) in enumerate(zip([0, *counts], counts)):
        n = max(0, int(after) - int(before))
        arrivals += [TRAINING_S + (i + k / max(n, 1)) * step for k in range(n)]
    return Trace("demo", arrivals, int(recorded["goal"]), max(arrivals, default=0.0) + SERVICE_S)


def trace(name: str) -> Trace:
    return {"demo": demo, "bursty": bursty}[name]()


# -- figures ------------------------------------------------------------------------------------------
@dataclass
class Timeline:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds from start, running pods)
    created: set[str] = field(default_factory=set)  # every pod seen

    def figures(self, first_arrival: float, first_burst_end: float) -> dict[str, Any]:
        """Scale-up: from the first update to the most pods the autoscaler gives the first burst
        (0 if it had them before the update came)."""
        pod_seconds = sum(pods * SAMPLE_S for _, pods in self.samples)
        zero_s = sum(SAMPLE_S for _, pods in self.samples if pods == 0)
        burst = [(t, pods) for t, pods in self.samples if t < first_burst_end]
        peak = max((pods for _, pods in burst if pods > 0), default=0)
        reached = next((t for t, pods in burst if pods == peak), None) if peak else None
        scale_up = None if reached is None else max(0.0, reached - first_arrival)
        return {"pod_seconds": round(pod_seconds, 1), "scale_up_s": None if scale_up is None else round(scale_up, 1),
                "cold_starts": len(self.created), "zero_s": round(zero_s, 1),
                "timeline": [[round(t, 1), pods] for t, pods in self.samples]}


# -- the KPA side: queue-proxy's metrics and the activator, emulated ----------------------------------------
class KpaLoad:
    """Requests of the trace for the KPA Service: each goes to its least-busy running pod with a
    free slot (of ``concurrency``) and occupies it for SERVICE_S, or waits (at the activator, which
    reports it) until one frees. Each pod's load is served as queue-proxy serves it, on the pod's
    IP, port ``port``."""

    def __init__(self, revision: str, concurrency: int = LEAF_FAN_IN, port: int = 9090,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.revision, self.concurrency, self.port, self.clock = revision, concurrency, port, clock
        self.lock = threading.Lock()
        self.pods: dict[str, str] = {}  # running pod -> its IP
        self.busy: dict[str, list[float]] = {}  # pod -> end times of its requests
        self.held: list[float] = []  # arrival times of requests waiting for a pod
        self.counted: dict[str, int] = {}  # requests per pod since its last scrape
        self.started: dict[str, float] = {}
        self.servers: dict[str, ThreadingHTTPServer] = {}

    def arrive(self, now: float) -> None:
        with self.lock:
            self.held.append(now)
            self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        for pod in self.busy:
            self.busy[pod] = [end for end in self.busy[pod] if end > now]
        while self.held:
            free = [p for p in self.pods if len(self.busy[p]) < self.concurrency]
            if not free:
                return
            pod = min(free, key=lambda p: len(self.busy[p]))
            self.held.pop(0)
            self.busy[pod].append(now + SERVICE_S)
            self.counted[pod] = self.counted.get(pod, 0) + 1

    def set_pods(self, running: dict[str, str], now: float) -> None:
        with self.lock:
            for pod in set(self.pods) - set(running):
                self.pods.pop(pod)
                self.busy.pop(pod, None)
                server = self.servers.pop(pod, None)
                if server is not None:
                    threading.Thread(target=server.shutdown, daemon=True).start()
            for pod, ip in running.items():
                if pod not in self.pods and ip:
                    self.pods[pod], self.busy[pod], self.started[pod] = ip, [], now
                    self.servers[pod] = self._serve(pod, ip)
            self._dispatch(now)

    def stat(self, pod: str) -> bytes:
        now = self.clock()
        with self.lock:
            self._dispatch(now)
            concurrency = float(len(self.busy.get(pod, [])))
            requests = float(self.counted.pop(pod, 0))
            uptime = now - self.started.get(pod, now)
        return encode_stat(pod, concurrency, requests, uptime, int(time.time()))

    def activator_stat(self) -> bytes | None:
        """What the activator holds for the revision (None: nothing to report)."""
        with self.lock:
            self._dispatch(self.clock())
            if not self.held:
                return None
            stat = encode_stat("activator", float(len(self.held)), float(len(self.held)), 0.0, int(time.time()))
        return encode_wire(NAMESPACE, self.revision, stat)

    def _serve(self, pod: str, ip: str) -> ThreadingHTTPServer:
        load = self

        class Metrics(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = load.stat(pod)
                self.send_response(200)
                self.send_header("Content-Type", "application/protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper gave up on this pod (its timeout): it scrapes again next tick

            def log_message(self, *_: Any) -> None:
                pass

        server = ThreadingHTTPServer((ip, self.port), Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def close(self) -> None:
        self.set_pods({}, self.clock())


def report_activator(load: KpaLoad, stop: threading.Event) -> None:
    """The activator's side: while requests wait for a pod, say so to the autoscaler (which is
    what scales a KPA revision from zero)."""
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                try:
                    async with session.ws_connect(AUTOSCALER_STATS) as ws:
                        while not stop.is_set():
                            message = load.activator_stat()
                            if message is not None:
                                await ws.send_bytes(message)
                            await asyncio.sleep(ACTIVATOR_PERIOD_S)
                except aiohttp.ClientError:
                    await asyncio.sleep(ACTIVATOR_PERIOD_S)

    asyncio.run(run())


# -- the lifl side: clients of the trace, in lifl's rounds -----------------------------------------------
class LiflClients:
    """The trace's clients as lifl sees them. A client is assigned to the round when its training
    starts, at most the round's goal of them (the others wait for the next round, as
    over-selected clients are told to); it sends its update when the trace says it arrives. An
    update a round no longer takes (full, or closed on the version it was trained from) goes
    again in the next round, as its client would after pulling the new model."""

    def __init__(self, gateway: Any, job: str, goal: int, blob: bytes) -> None:
        self.gateway, self.job, self.goal, self.blob = gateway, job, goal, blob
        self.to_assign: deque[str] = deque()
        self.to_send: deque[str] = deque()
        self.version, self.assigned, self.blocked = 0, 0, False

    def progress(self) -> None:
        from lifl.errors import LiflError

        if not (self.to_assign or self.to_send):
            return
        version = self.gateway.job(self.job)["version"]
        if version != self.version:
            self.version, self.assigned, self.blocked = version, 0, False
        if self.blocked:  # the round refused an update: wait for the next one
            return
        while self.to_assign and self.assigned < self.goal:
            self.gateway.assignment(self.job, client=self.to_assign.popleft())
            self.assigned += 1
        while self.to_send:
            try:
                self.gateway.push(self.job, self.blob, client=self.to_send[0], samples=1, base_version=self.version)
            except LiflError as e:
                if e.code in ("round_full", "version_conflict"):
                    self.blocked = True  # this round takes no more: these go in the next one
                    return
                if e.code != "already_acknowledged":
                    raise
            self.to_send.popleft()


# -- one run ------------------------------------------------------------------------------------------------
def _service(name: str, tenant: str, klass: str) -> dict[str, Any]:
    annotations = {"autoscaling.knative.dev/class": klass}
    labels = {"lifl.dev/tenant": tenant}
    spec: dict[str, Any] = {"containerConcurrency": LEAF_FAN_IN,
                            "containers": [{"image": "dev.local/lifl/lifl:0.1.0", "ports": [{"containerPort": 8080}]}]}
    if klass == "hierarchy.lifl.dev":
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": f"aggregators.lifl.dev/{tenant}", "operator": "In", "values": ["true"]}]}]}}}
    return {"apiVersion": "serving.knative.dev/v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}}}


class Run:
    def __init__(self, tr: Trace, redis_url: str, gateway: Any, log: bool) -> None:
        from kubernetes import client, config

        config.load_kube_config()
        self.core, self.custom = client.CoreV1Api(), client.CustomObjectsApi()
        self.trace, self.gateway, self.log = tr, gateway, log
        self.tenant = f"b{tr.name}"
        self.names = {"kpa": f"kpa-{tr.name}", "lifl": f"lifl-{tr.name}"}
        self.timelines = {a: Timeline() for a in AUTOSCALERS}
        self.redis_url = redis_url

    def say(self, text: str) -> None:
        if self.log:
            print(f"lifl bench knative: {text}", file=sys.stderr, flush=True)

    def running(self, service: str) -> dict[str, str]:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"serving.knative.dev/service={service}").items
        return {p.metadata.name: p.status.pod_ip or "" for p in pods
                if p.status.phase == "Running" and p.metadata.deletion_timestamp is None}

    def all_pods(self, service: str) -> set[str]:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"serving.knative.dev/service={service}").items
        return {p.metadata.name for p in pods}

    def revision(self, service: str) -> str:
        while True:
            svc = self.custom.get_namespaced_custom_object("serving.knative.dev", "v1", NAMESPACE, "services", service)
            name = (svc.get("status") or {}).get("latestCreatedRevisionName")
            if name:
                return name
            time.sleep(0.2)

    def execute(self) -> dict[str, dict[str, Any]]:
        tr, gw, job = self.trace, self.gateway, f"bench-{self.trace.name}"
        from lifl import format as fmt

        self.custom.create_namespaced_custom_object("lifl.dev", "v1alpha1", NAMESPACE, "fljobs", {
            "apiVersion": "lifl.dev/v1alpha1", "kind": "FLJob", "metadata": {"name": job},
            "spec": {"tenant": self.tenant, "goal": tr.goal, "leafFanIn": LEAF_FAN_IN, "roundDeadlineSeconds": 30, "minUpdates": 1}})
        while True:
            try:
                gw.job(job)
                break
            except Exception:  # the operator creates it
                time.sleep(0.2)
        blob = fmt.encode({"w": np.zeros(256, np.float32)})
        gw.set_model(job, blob)
        for autoscaler, klass in (("kpa", "kpa.autoscaling.knative.dev"), ("lifl", "hierarchy.lifl.dev")):
            self.custom.create_namespaced_custom_object("serving.knative.dev", "v1", NAMESPACE, "services",
                                                        _service(self.names[autoscaler], self.tenant, klass))
        kpa = KpaLoad(self.revision(self.names["kpa"]))
        stop = threading.Event()
        activator = threading.Thread(target=report_activator, args=(kpa, stop), daemon=True)
        activator.start()
        events = sorted([(t - TRAINING_S, "assign", i) for i, t in enumerate(tr.arrivals)]
                        + [(t, "arrive", i) for i, t in enumerate(tr.arrivals)])
        t0 = time.monotonic()
        end = tr.duration + SETTLE_S
        self.say(f"{tr.name}: {len(tr.arrivals)} updates over {tr.duration:.0f} s, then {SETTLE_S:.0f} s to settle")
        next_sample = 0.0
        pending = list(events)
        clients = LiflClients(gw, job, tr.goal, blob)
        try:
            while (now := time.monotonic() - t0) < end:
                while pending and pending[0][0] <= now:
                    _, what, i = pending.pop(0)
                    if what == "assign":
                        clients.to_assign.append(f"c{i}")
                    else:
                        kpa.arrive(time.monotonic())
                        clients.to_send.append(f"c{i}")
                clients.progress()
                if now >= next_sample:
                    for autoscaler in AUTOSCALERS:
                        running = self.running(self.names[autoscaler])
                        self.timelines[autoscaler].samples.append((now, len(running)))
                        self.timelines[autoscaler].created |= self.all_pods(self.names[autoscaler])
                        if autoscaler == "kpa":
                            kpa.set_pods(running, time.monotonic())
                    next_sample += SAMPLE_S
                time.sleep(0.05)
        finally:
            stop.set()
            kpa.close()
            for autoscaler in AUTOSCALERS:
                self.custom.delete_namespaced_custom_object("serving.knative.dev", "v1", NAMESPACE, "services",
                                                            self.names[autoscaler])
            self.custom.delete_namespaced_custom_object("lifl.dev", "v1alpha1", NAMESPACE, "fljobs", job)
        return {a: self.timelines[a].figures(tr.arrivals[0], tr.first_burst_s) for a in AUTOSCALERS}


def plot(results: Path, name: str, figures: dict[str, dict[str, Any]], tr: Trace) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for autoscaler, f in figures.items():
        t, pods = zip(*f["timeline"]) if f["timeline"] else ((), ())
        ax.step(t, pods, where="post", label=f"{autoscaler} ({f['pod_seconds']} pod-s)")
    ax.eventplot([tr.arrivals], lineoffsets=-0.5, linelengths=0.4, colors="grey")
    ax.set_xlabel("seconds")
    ax.set_ylabel("aggregator pods")
    ax.set_title(f"{name} trace: KPA against lifl's autoscaler (grey: update arrivals)")
    ax.legend()
    path = results / f"knative_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated subset of {', '.join(TRACES)}")
    p.add_argument("--results", type=Path, default=Path("results"), help="where the plots go (default results/)")


def trace_names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(TRACES))
    if unknown or not names:
        raise SystemExit(f"lifl bench knative: unknown trace(s) {', '.join(unknown) or '(none given)'}: "
                         f"choose from {', '.join(TRACES)}")
    return names


def inside(args: argparse.Namespace) -> dict[str, Any]:
    """The bench proper, inside the test bed's network namespace."""
    from lifl.client import Gateway
    from lifl.node.supervisor import Node, NodeConfig

    names = trace_names(args.traces)
    args.results.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lifl-bench-knative-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    node = Node(NodeConfig(node=NODE, http="127.0.0.1:0", grpc="127.0.0.1:0", run_dir=tmp / "run", data_dir=tmp / "data",
                           keep_warm=30), log=sys.stderr)
    addresses = node.start()
    subprocess.run(["kubectl", "apply", "-k", str(ROOT / "manifests")], check=True, capture_output=True)
    helpers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "k8s" / "kingress_standin.py")], stderr=subprocess.DEVNULL),
               subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "lifl.autoscaler.handlers"],
                                env={**os.environ, "LIFL_REDIS": addresses.redis}, stderr=subprocess.DEVNULL)]
    gw = Gateway(addresses.http, token=node.operator_token)
    runs, plots = [], []
    try:
        for name in names:
            tr = trace(name)
            figures = Run(tr, addresses.redis, gw, log=True).execute()
            for autoscaler, f in figures.items():
                runs.append({"autoscaler": autoscaler, "trace": name, **{k: v for k, v in f.items()}})
            plots.append(plot(args.results, name, figures, tr))
    finally:
        gw.close()
        for helper in helpers:
            helper.terminate()
            helper.wait(30)
        node.stop()
    by = {(r["trace"], r["autoscaler"]): r for r in runs}
    met = {name: {"fewer_pod_seconds": by[(name, "lifl")]["pod_seconds"] < by[(name, "kpa")]["pod_seconds"],
                  "scale_up_no_slower": (by[(name, "lifl")]["scale_up_s"] or 0) <= (by[(name, "kpa")]["scale_up_s"] or float("inf"))}
           for name in names}
    return {"benchmark": "knative", "service_s": SERVICE_S, "training_s": TRAINING_S,
            "container_concurrency": LEAF_FAN_IN, "runs": runs, "plots": plots,
            "targets_met": met, "all_targets_met": all(all(m.values()) for m in met.values())}


def main(args: argparse.Namespace) -> int:
    if os.environ.get(INSIDE_ENV):
        report = inside(args)
        if args.json:
            print(json.dumps(report))
        else:
            for r in report["runs"]:
                print(f"{r['trace']:7} {r['autoscaler']:5} pod-s {r['pod_seconds']:7.1f}  scale-up {r['scale_up_s']} s  "
                      f"cold starts {r['cold_starts']:3}  at zero {r['zero_s']:6.1f} s")
            print(f"targets: {report['targets_met']}; plots: {', '.join(report['plots'])}")
        return 0
    trace_names(args.traces)
    if os.geteuid() != 0:
        print("lifl bench knative: needs root (the Kubernetes test bed runs in a network namespace)", file=sys.stderr)
        return 2
    kubeconfig = Path(os.environ.get("LIFL_TESTENV_DIR", "/run/lifl-testenv")) / "kubeconfig"
    started = not kubeconfig.exists()
    if started:
        subprocess.run([str(TESTENV), "up"], check=True, stdout=subprocess.DEVNULL)
    try:
        argv = [sys.executable, "-m", "lifl", "bench", "knative", "--traces", args.traces, "--results", str(args.results.resolve())]
        return subprocess.run([str(TESTENV), "exec", "env", f"{INSIDE_ENV}=1", *argv, *(["--json"] if args.json else [])]).returncode
    finally:
        if started:
            subprocess.run([str(TESTENV), "down"], check=True)
