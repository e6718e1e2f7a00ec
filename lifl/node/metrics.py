"""The node agent's metrics: Prometheus series for operators, cumulative counters for the planner.

The planner's inputs (paper §5.1: each node's arrival rate k and mean aggregation time E)
are published with the node's status as cumulative counters, so that whoever plans can
difference two snapshots however far apart they were taken.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lifl.ledger import MemoryLedger
from lifl.protocol import PlannerCounts


@dataclass
class PlannerCounters:
    """Cumulative since the agent started (published as ``lifl.protocol.PlannerCounts``); see
    ``lifl.control.planner.Counters``."""

    arrivals: int = 0  # client updates acknowledged here
    aggregated: int = 0  # client updates whose leaf aggregation finished here
    agg_seconds: float = 0.0  # seconds leaves spent aggregating them


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.counters: dict[str, PlannerCounters] = {}  # by job
        self.steps = Histogram(
            "lifl_aggregator_step_seconds", "Time per aggregator step (recv waits for keys, agg folds, send hands off)",
            ["role", "step"], registry=r, buckets=(1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
        )
        self.handoff = Histogram(
            "lifl_key_handoff_seconds", "Key delivery until the receiver holds a readable view",
            registry=r, buckets=(25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 5e-3, 0.05, 1),
        )
        self.queue = Gauge("lifl_queue_length", "Updates received but not yet aggregated", ["job"], registry=r)
        self.instances = Gauge("lifl_aggregator_instances", "Aggregator instances by role (idle: warm, unassigned)", ["role"], registry=r)
        self.starts = Counter("lifl_aggregator_starts", "Task starts by instance temperature", ["kind"], registry=r)
        self.reruns = Counter("lifl_task_reruns", "Tasks run again from their inputs after their instance died or failed, by role",
                              ["role"], registry=r)
        self.spawned = Counter("lifl_aggregator_instances_created", "Aggregator instances started (cold starts and pre-warming)",
                               ["reason"], registry=r)
        self.rounds = Counter("lifl_rounds", "Rounds finished, by outcome (complete, partial, abandoned, interrupted)",
                              ["job", "outcome"], registry=r)
        self.round_seconds = Histogram(
            "lifl_round_aggregation_seconds", "Aggregation completion time: a round's first update to its aggregated model",
            ["job"], registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.round_updates = Histogram("lifl_round_updates", "Client updates aggregated per round", ["job"], registry=r,
                                       buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
        self.version = Gauge("lifl_job_version", "Current global model version", ["job"], registry=r)
        self.checkpoint_failures = Counter("lifl_checkpoint_failures", "Checkpoint writes that failed (each is tried again)",
                                           ["job"], registry=r)
        self.models_moved = Counter("lifl_models_moved", "Models (and replicas) leaving shared memory and coming back "
                                    "(lifl.node.spill), by direction: idle, pressure (spilled) or restored",
                                    ["direction"], registry=r)
        self.checkpoint_seconds = Histogram("lifl_checkpoint_seconds", "Time to write a checkpoint durably", registry=r,
                                            buckets=(1e-3, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.shm = Gauge("lifl_shm_bytes", "Shared memory held by objects (used; pinned: of which models and replicas), "
                         "by the recycling pool, and reserved for aggregating admitted updates", ["state"], registry=r)
        self.job_shm = Gauge("lifl_job_shm_bytes", "A job's shared memory: live objects of its rounds (working) and memory "
                             "reserved for aggregating its admitted updates (reserved)", ["job", "state"], registry=r)
        self.refusals = Counter("lifl_admission_refusals", "Uploads refused with 503 by the node, by reason (shm_exhausted, "
                                "fair_share, shm_too_small, inflight_budget)", ["job", "reason"], registry=r)
        self.forwarded = Counter("lifl_partials_forwarded", "Partial results sent to the top on another node, by result",
                                 ["result"], registry=r)
        self.forwarded_bytes = Counter("lifl_partial_bytes_forwarded", "Bytes of partial results sent to other nodes", registry=r)
        self.partials_received = Counter("lifl_partials_received", "Partial results received from other nodes, by result",
                                         ["result"], registry=r)
        self.replicas = Counter("lifl_model_replicas", "Copies of models fetched to serve them here, by source",
                                ["source"], registry=r)
        # retention and queries (lifl.flstore)
        self.retained_bytes = Gauge("lifl_retained_bytes", "Shared memory retained for queries, by job and kind "
                                    "(model, update)", ["job", "kind"], registry=r)
        self.retention_lookups = Counter("lifl_retention_lookups", "Objects queries used, by where they were found "
                                         "(memory: a hit; store: fetched back)", ["job", "source"], registry=r)
        self.evictions = Counter("lifl_retention_evictions", "Retained objects dropped from memory, by reason (policy, "
                                 "budget, pressure)", ["job", "reason"], registry=r)
        self.fetch_backs = Counter("lifl_retention_fetch_back_bytes", "Bytes of retained objects read back from the "
                                   "checkpoint store", ["job"], registry=r)
        self.queries = Counter("lifl_queries", "Queries served, by workload and result (ok, error)",
                               ["job", "workload", "result"], registry=r)
        self.batch_sizes = Histogram("lifl_state_batch_size", "Uploads admitted (reserve) or counted (accept) by one Redis "
                                     "call: what arrives while a job's call is in flight goes in its next",
                                     ["call"], registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.query_seconds = Histogram("lifl_query_seconds", "Time to answer a query", ["workload"], registry=r,
                                       buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))

    # the planner's counters are the agent loop's: bumped and read on its thread
    def arrived(self, job: str) -> None:
        self.counters.setdefault(job, PlannerCounters()).arrivals += 1

    def aggregated(self, job: str, updates: int, seconds: float) -> None:
        c = self.counters.setdefault(job, PlannerCounters())
        c.aggregated += updates
        c.agg_seconds += seconds

    def refused(self, job: str, reason: str) -> None:
        self.refusals.labels(job, reason).inc()

    def publish_memory(self, ledger: MemoryLedger, pooled: int, jobs: Iterable[str]) -> None:
        self.shm.labels("used").set(ledger.used)
        self.shm.labels("pinned").set(ledger.pinned)
        self.shm.labels("reserved").set(ledger.reserved)
        self.shm.labels("pooled").set(pooled)
        for job in jobs:
            usage = ledger.usage(job)
            self.job_shm.labels(job, "working").set(usage.working)
            self.job_shm.labels(job, "reserved").set(usage.reserved)

    def planner_counters(self) -> dict[str, PlannerCounts]:
        return {job: PlannerCounts(c.arrivals, c.aggregated, c.agg_seconds) for job, c in self.counters.items()}

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
