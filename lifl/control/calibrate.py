"""`lifl calibrate`: measure a node's maximum service capacity MC_i (paper appendix E).

Raise the arrival rate k of updates to the node step by step and watch its mean aggregation
time E; at the first step where E rises significantly over what it was at low load, the node
is becoming overloaded: MC_i = k' × E' at that step (updates it aggregates at once). The
result is stored in Redis, where placement reads it (nodes never measured use ``--capacity``).

The knee is a pure function of the steps (``find_capacity``); the rest drives a real node
through its gateway and reads the agent's counters from Redis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from lifl import format as fmt
from lifl.client import NO_RETRY, TOKEN_ENV, Gateway
from lifl.errors import LiflError
from lifl.protocol import PlannerCounts
from lifl.state import ClusterState

DEFAULT_RISE = 1.5  # E this many times its low-load value counts as a significant increase
MAX_CLIENTS = 8  # connections a step sends its updates over
PUBLISH_LAG = 1.2  # seconds for the agent's counters (published every second) to include a step


@dataclass(frozen=True)
class Step:
    target_rate: float  # updates/s offered
    rate: float  # k: updates/s the node acknowledged
    e: float  # E: mean aggregation seconds per update at that rate


@dataclass(frozen=True)
class Capacity:
    capacity: float  # MC_i = k' × E'
    rate: float  # k'
    e: float  # E'
    saturated: bool  # False: E never rose within the rates tried (MC is then a lower bound)


def find_capacity(steps: list[Step], rise: float = DEFAULT_RISE) -> Capacity:
    """The knee of E over increasing rates: the first step whose E is ``rise`` times the lowest
    E before it, or whose achieved rate fell short of the offered one (the node could not keep up)."""
    measured = [s for s in steps if s.e > 0]
    if not measured:
        raise ValueError("no step aggregated anything: nothing to calibrate from")
    base = measured[0].e
    for s in measured[1:]:
        if s.e >= rise * base or s.rate < 0.8 * s.target_rate:
            return Capacity(s.rate * s.e, s.rate, s.e, True)
        base = min(base, s.e)
    last = max(measured, key=lambda s: s.rate * s.e)
    return Capacity(last.rate * last.e, last.rate, last.e, False)


def counters(state: ClusterState, node: str, job: str) -> tuple[float, int, int, float]:
    """(time, arrivals, aggregated, agg_seconds) as the node's agent last published them (the
    step's aggregation time comes from here; its rate from what the node acknowledged)."""
    status = state.nodes().get(node)
    if status is None:
        raise SystemExit(f"lifl calibrate: node {node} is not up")
    c = status.counters.get(job, PlannerCounts())
    return status.time, c.arrivals, c.aggregated, c.agg_seconds


def offer(gateway: str, job: str, blob: bytes, rate: float, seconds: float, clients: int) -> int:
    """Send updates at ``rate`` per second for ``seconds``, spread over ``clients`` connections;
    returns how many the node acknowledged (refusals count as the node not keeping up)."""
    stop = time.monotonic() + seconds
    gap = clients / rate
    acknowledged = [0] * clients

    def client(i: int) -> None:
        gw = Gateway(gateway, retry=NO_RETRY)  # a refusal is the measurement, not something to wait out
        try:
            t = time.monotonic() + i * gap / clients
            n = 0
            while t < stop:
                time.sleep(max(0.0, t - time.monotonic()))
                try:
                    gw.push(job, blob, client=f"cal{i}-{n}", samples=1, base_version=0)
                    acknowledged[i] += 1
                except LiflError:
                    pass
                n += 1
                t += gap
        finally:
            gw.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(acknowledged)


def calibrate_node(state: ClusterState, node: str, *, update_mb: float, step_seconds: float, max_rate: float,
                   rise: float, log: bool) -> tuple[Capacity, list[Step]]:
    gateway = state.gateway(node)
    if gateway is None:
        raise SystemExit(f"lifl calibrate: node {node} has no gateway registered")
    job = f"calibrate-{node}-{int(time.time())}"
    n = max(1, int(update_mb * (1 << 20) / 4))
    steps: list[Step] = []
    rates = []
    r = 1.0
    while r <= max_rate:
        rates.append(r)
        r *= 2
    # one round that never fills (its goal is more than the steps offer), abandoned under its
    # minimum (everything released) once calibration is over; a round whose goal the node's
    # memory could not hold is refused when the model is set (round_too_large): fewer steps
    deadline = len(rates) * (step_seconds + 2) + 10
    never_filled = 2 * sum(math.ceil(rate * step_seconds) + MAX_CLIENTS for rate in rates)
    gw = Gateway(gateway["http"])
    # leaves of two (the paper's I): each pair's fold is reported within the step that sent it
    gw.create_job(job, never_filled, tenant="calibrate", round_deadline_s=deadline, min_updates=never_filled,
                  max_inflight=never_filled, over_selection=1.0, leaf_fan_in=2)
    gw.set_model(job, fmt.encode({"w": np.zeros(n, np.float32)}))
    blob = bytes(fmt.encode({"w": np.ones(n, np.float32)}))
    for rate in rates:
        before = counters(state, node, job)
        t0 = time.monotonic()
        acknowledged = offer(gateway["http"], job, blob, rate, step_seconds, clients=max(1, min(MAX_CLIENTS, int(rate))))
        elapsed = time.monotonic() - t0
        time.sleep(PUBLISH_LAG)  # the agent publishes its counters every second
        after = counters(state, node, job)
        done = after[2] - before[2]
        step = Step(rate, acknowledged / max(elapsed, step_seconds), (after[3] - before[3]) / done if done else 0.0)
        steps.append(step)
        if log:
            print(f"  {node}: offered {rate:g}/s, acknowledged {step.rate:.1f}/s, E = {step.e * 1e3:.2f} ms", file=sys.stderr)
        if len([s for s in steps if s.e > 0]) > 1 and find_capacity(steps, rise).saturated:
            break
    gw.close()
    return find_capacity(steps, rise), steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = f"Runs as the operator: ${TOKEN_ENV} must hold the operator's token."
    p.add_argument("--redis", required=True, metavar="URL", help="the cluster's Redis (as printed by `lifl up`)")
    p.add_argument("--node", action="append", help="node to calibrate (repeatable; default: every node that is up)")
    p.add_argument("--update-mb", type=float, default=4.0, help="size of the updates sent (default 4 MB)")
    p.add_argument("--step-seconds", type=float, default=3.0, help="seconds per arrival rate (default 3)")
    p.add_argument("--max-rate", type=float, default=512.0, help="highest arrival rate tried, updates/s (default 512)")
    p.add_argument("--rise", type=float, default=DEFAULT_RISE, help="E this many times its low-load value is the knee (default 1.5)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def main(args: argparse.Namespace) -> int:
    if not os.environ.get(TOKEN_ENV):  # it creates a job of its own and sends updates as several clients
        raise SystemExit(f"lifl calibrate: set ${TOKEN_ENV} to the operator's token")
    state = ClusterState(args.redis)
    nodes = args.node or sorted(state.gateways())
    if not nodes:
        raise SystemExit("lifl calibrate: no node is up")
    results = {}
    for node in nodes:
        cap, steps = calibrate_node(state, node, update_mb=args.update_mb, step_seconds=args.step_seconds,
                                    max_rate=args.max_rate, rise=args.rise, log=not args.json)
        state.set_capacity(node, cap.capacity, {"rate": cap.rate, "e": cap.e, "saturated": cap.saturated,
                                                "update_mb": args.update_mb, "measured_at": time.time()})
        results[node] = {**asdict(cap), "steps": [asdict(s) for s in steps]}
        if not args.json:
            bound = "" if cap.saturated else " (a lower bound: E never rose)"
            print(f"{node}: MC = {cap.capacity:.2f} updates at once (k' = {cap.rate:.1f}/s, E' = {cap.e * 1e3:.2f} ms){bound}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
