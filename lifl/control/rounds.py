"""What a round needs next, cluster-wide: a pure function of the job, its shard and which nodes live.

Every agent runs these duties for the jobs it takes part in (and the controller for all
jobs): close at the deadline, abandon a round that cannot complete, declare a dead node's
updates lost, place the top once the final counts are known. Each duty is carried out by one
Redis script that checks the round first, so any number of nodes may try the same duty at
once and it happens exactly once.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from lifl.cluster_types import NO_MODEL, Job, SecureRound, Shard
from lifl.control.planner import choose_top
from lifl.secagg_round import ABANDONED, CONSISTENCY, DONE, UNMASK


@dataclass(frozen=True)
class CloseAtDeadline:
    round: int
    min_updates: int


@dataclass(frozen=True)
class AbandonRound:
    round: int
    outcome: str  # "abandoned" or "interrupted"
    reason: str


@dataclass(frozen=True)
class DeclareLost:
    round: int
    node: str


@dataclass(frozen=True)
class PlaceTop:
    round: int
    epoch: int
    node: str


@dataclass(frozen=True)
class AdvanceSecureStage:
    """A secure round's stage passed its deadline: it moves on with the clients that acted, or
    is abandoned (``lifl.secure_state.SecureRounds.close_due``)."""

    round: int


Duty = CloseAtDeadline | AbandonRound | DeclareLost | PlaceTop | AdvanceSecureStage


def duties(job: Job, shard: Shard, now: float, live: Set[str], secure: SecureRound | None = None) -> list[Duty]:
    """The duties round ``job.round`` needs now (``now`` on the Redis clock); ``secure``: a
    secure job's round (its stages close it, not ``round_deadline_s``)."""
    if job.version == NO_MODEL or shard.round != job.round:
        return []  # no model yet, or a next round is being opened
    if job.parts:
        return _split_duties(job, shard, now, live)
    involved = {n for n, c in shard.counts.items() if c > 0} | {n for n, c in shard.inflight.items() if c > 0}
    if shard.top:
        involved.add(shard.top)
    lost = [DeclareLost(job.round, n) for n in sorted(involved - shard.dead) if n not in live]
    if lost:
        return list(lost)  # the rest is decided on the counts that remain
    if job.spec.secure_aggregation:
        if secure is None or secure.round != job.round:
            return []  # nobody advertised keys for this round yet
        if secure.stage == ABANDONED:
            return [AbandonRound(job.round, "abandoned", secure.why)]
        if secure.stage != DONE and now * 1000 >= secure.deadline_ms:
            return [AdvanceSecureStage(job.round)]
        if secure.stage in (CONSISTENCY, UNMASK, DONE) and not job.closed:  # its collect stage ended at the deadline
            return [CloseAtDeadline(job.round, secure.threshold)]
        if job.closed and not shard.finalized:
            return [AbandonRound(job.round, "abandoned", f"{job.accepted} masked inputs arrived, fewer than the "
                                 f"threshold of {secure.threshold}")]
    else:
        deadline = job.spec.round_deadline_s
        if not job.closed and deadline and now >= job.round_opened + deadline:
            return [CloseAtDeadline(job.round, job.spec.min_updates)]
        if job.closed and not shard.finalized:
            return [AbandonRound(job.round, "abandoned",
                                 f"deadline passed with {job.accepted} of the {job.spec.min_updates} updates needed")]
    if shard.finalized and shard.total == 0:
        return [AbandonRound(job.round, "abandoned", f"every update of the round was lost with node(s) {_names(shard.lost)}")]
    if shard.finalized and shard.top is None:
        planned = (shard.plan or {}).get("top")
        top = choose_top(shard.participants, planned)
        return [PlaceTop(job.round, shard.epoch, top)] if top else []
    if not job.closed and job.accepted == 0 and job.reserved == 0 and shard.lost:
        return [AbandonRound(job.round, "interrupted",
                             f"its updates were lost with node(s) {_names(shard.lost)}")]
    return []


def _names(nodes: dict[str, int]) -> str:
    return ", ".join(sorted(nodes)) or "none"


def _split_duties(job: Job, shard: Shard, now: float, live: Set[str]) -> list[Duty]:
    """A job split across nodes (lifl.shards.split_record): every node holds a part of every
    update and aggregates its own shards, so there is no top to place, and a round with a part
    missing (given up after others were acknowledged, or on a node that died) can only be
    abandoned: a version is the same round's on every node or none."""
    split = job.split
    nodes = [p.node for p in split[1]] if split else []
    if job.parts_lost:
        return [AbandonRound(job.round, "interrupted", job.parts_lost)]
    started = job.reserved > 0 or shard.total > 0
    dead = [n for n in nodes if n not in live]
    if dead and started and not shard.installed >= set(dead):
        return [AbandonRound(job.round, "interrupted", f"node(s) {', '.join(dead)} holding shards of the round died")]
    deadline = job.spec.round_deadline_s
    if not job.closed and deadline and now >= job.round_opened + deadline:
        return [CloseAtDeadline(job.round, job.spec.min_updates)]
    if job.closed and not shard.finalized:
        return [AbandonRound(job.round, "abandoned", f"deadline passed with {job.accepted} whole updates of the "
                             f"{job.spec.min_updates} needed, or with parts of updates missing")]
    return []
