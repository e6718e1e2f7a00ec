"""The control loop (paper §5, Fig. 6): re-plans every node's hierarchy from the agents' metrics.

One node's agent at a time holds the controller lease in Redis and, every period, turns the
agents' published counters into smoothed queue estimates (EWMA), adds the demand it already
knows of (clients assigned to a node whose updates have not arrived yet), sizes each node's
hierarchy from that queue and publishes how many instances each node should keep warm per
tenant, and each node's load for placement. Every agent reads its share and warms instances
ahead of the load. The decisions are ``lifl.control.planner``'s; this is only the I/O around
them, so the Kubernetes operator can run the same planner behind another actuator.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass

from lifl.cluster_types import NO_MODEL, Job
from lifl.control.planner import BESTFIT, DEFAULT_ALPHA, POLICIES, Counters, Estimate, estimate, plan_warm
from lifl import shards
from lifl.errors import NotFound
from lifl.protocol import NodeStatus
from lifl.state import ClusterState

DEFAULT_CAPACITY = 20.0  # MC_i of a node `lifl calibrate` has not measured (the paper's testbed value)


@dataclass(frozen=True)
class ControlConfig:
    placement: str = BESTFIT  # how clients are spread over nodes (lifl.control.planner.POLICIES)
    capacity: float = DEFAULT_CAPACITY
    alpha: float = DEFAULT_ALPHA  # EWMA weight of the previous queue estimate
    period: float = 2.0  # seconds between re-plans
    prewarm: bool = True  # False: no hierarchy planning, instances start cold on demand (a baseline)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--placement", choices=POLICIES, default=BESTFIT,
                       help="how clients are assigned to nodes (default bestfit; the others are baselines)")
        p.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY,
                       help="updates a node aggregates at once, where `lifl calibrate` has not measured it (default 20)")
        p.add_argument("--ewma-alpha", type=float, default=DEFAULT_ALPHA, help="EWMA weight of the previous estimate (default 0.7)")
        p.add_argument("--plan-period", type=float, default=2.0, help="seconds between re-plans (default 2)")
        p.add_argument("--no-plan", action="store_true", help="baseline: no hierarchy planning, no instances warmed ahead")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ControlConfig:
        if not 0.0 <= args.ewma_alpha < 1.0:
            raise SystemExit(f"--ewma-alpha must be in [0, 1), got {args.ewma_alpha}")
        if args.capacity <= 0 or args.plan_period <= 0:
            raise SystemExit("--capacity and --plan-period must be positive")
        return cls(args.placement, args.capacity, args.ewma_alpha, args.plan_period, not args.no_plan)

    def argv(self) -> list[str]:
        return ["--placement", self.placement, "--capacity", str(self.capacity), "--ewma-alpha", str(self.alpha),
                "--plan-period", str(self.period)] + ["--no-plan"] * (not self.prewarm)


class Controller:
    def __init__(self, state: ClusterState, node: str, config: ControlConfig, *, reuse: bool = True) -> None:
        self.state = state
        self.node = node
        self.config = config
        self.reuse = reuse
        self.estimates: dict[tuple[str, str], Estimate] = {}  # (node, job)
        self._warm: dict[str, dict[str, int]] = {}  # the plan as last read, by node

    def tick(self, jobs: Collection[str] | None = None) -> bool:
        """Re-plan if this node holds the controller lease, for ``jobs`` (None: every job); returns
        whether it does."""
        if not self.state.lead("controller", self.node, ttl=max(3 * self.config.period, 3.0)):
            self.estimates.clear()  # another node plans; start afresh if the lease comes back
            return False
        if jobs is not None:  # a job whose round just ended keeps a queue the EWMA lets go of slowly
            jobs = set(jobs) | {job for (_, job), e in self.estimates.items() if e.q > 0}
        warm, loads = self.plan(jobs)
        self.state.set_control(warm, loads, ttl=3 * self.config.period + 1)
        return True

    def plan(self, only: Collection[str] | None = None) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
        """(instances to keep warm per node and tenant, each node's queue) for the jobs ``only``
        (None: every job in Redis), from the agents' latest counters; call once a period."""
        statuses = self.state.nodes()
        names = self.state.job_names() if only is None else sorted(only)
        queues = {key: q for key, q in self._estimated_queues(statuses).items() if key[1] in names}
        jobs: dict[str, Job] = {}
        for name in names:
            try:
                job = self.state.job(name)
            except NotFound:  # named by the caller, or deleted since
                continue
            if job.version == NO_MODEL:
                continue
            jobs[name] = job
            shard = self.state.shard(name)
            for node, assigned in shard.assigned.items():  # demand already known: assigned, not yet arrived
                waiting = max(0, assigned - shard.counts.get(node, 0))
                queues[(node, name)] = max(queues.get((node, name), 0.0), float(waiting))
        warm: dict[str, dict[str, int]] = {}
        loads: dict[str, float] = {}
        memory = min((s.shm.capacity for s in statuses.values()), default=0)  # what "shards": "auto" sizes from
        for name, job in jobs.items():
            per_node = {node: q for (node, of), q in queues.items() if of == name}
            for node, q in per_node.items():
                loads[node] = loads.get(node, 0.0) + q
            plan = shards.resolve(job.spec.shards, job.spec.shard_alignment, job.model_spec, memory) if job.model_spec else None
            for node, n in plan_warm(per_node, fan_in=job.leaf_fan_in, reuse=self.reuse,
                                     lanes=len(plan) if plan is not None else 1).items():
                per_tenant = warm.setdefault(node, {})
                per_tenant[job.spec.tenant] = per_tenant.get(job.spec.tenant, 0) + n
        return warm, loads

    def _estimated_queues(self, statuses: dict[str, NodeStatus]) -> dict[tuple[str, str], float]:
        queues: dict[tuple[str, str], float] = {}
        for node, status in statuses.items():
            for job, c in status.counters.items():
                key = (node, job)
                now = Counters(status.time, c.arrivals, c.aggregated, c.agg_seconds)
                est = self.estimates[key] = estimate(self.estimates.get(key), now, self.config.alpha)
                queues[key] = est.q
        return queues

    def read_warm(self, node: str) -> dict[str, int]:
        """The node's share of the latest plan: instances to keep warm, per tenant."""
        self._warm[node] = self.state.warm_plan().get(node, {})
        return dict(self._warm[node])

    def warm_for(self, node: str) -> dict[str, int]:
        """The node's share as last read (no I/O)."""
        return dict(self._warm.get(node, {}))
