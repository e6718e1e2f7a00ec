"""The cluster's state as values: a job (``Job``), its round's shard plan and accounting
(``Shard``), and what declaring a node lost did (``Loss``).

``lifl.state`` reads them from Redis; the pure cores (the round duties in ``lifl.control.rounds``,
the node's task trees in ``lifl.node.tree``) decide from them without importing Redis. The
meaning of every field is in ``lifl.state``'s module docstring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lifl import secagg, shards
from lifl.errors import Unprocessable
from lifl.format import ModelSpec
from lifl.jobs import JobSpec

NO_MODEL = -1  # a job's version before its first model


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    version: int
    round: int
    round_opened: float  # seconds since the epoch
    closed: bool
    model_key: str
    model_node: str
    model_spec: ModelSpec | None
    reserved: int
    accepted: int
    aggregated: int
    rejected: dict[str, int]
    last_round: dict[str, Any] | None
    checkpoint: int  # latest version durably checkpointed, -1 if none
    checkpoint_error: str = ""  # why the next version's checkpoint is not written yet ("" when none failed)
    parts: str = ""  # the model's shards split across nodes (lifl.shards.split_record); "" when on one node
    parts_lost: str = ""  # why the round of a split job cannot complete (a part of an acknowledged update was lost)

    @property
    def split(self) -> tuple[shards.ShardPlan, tuple[shards.NodePart, ...]] | None:
        """The plan and the nodes' parts of a job whose shards are split across nodes."""
        if not self.parts or self.model_spec is None:
            return None
        return shards.parts_of(self.model_spec, self.parts)

    def part_of(self, node: str) -> shards.NodePart | None:
        """What ``node`` holds of the job's model (None: nothing, or the job is not split)."""
        split = self.split
        return next((p for p in split[1] if p.node == node), None) if split else None

    def blob_spec(self, node: str) -> ModelSpec | None:
        """What ``node``'s blobs of the job hold (updates, partial sums' layout, versions): its
        part of the model when the job is split across nodes, else the whole model. A node that
        holds no part of a split job is refused anything of it (``lifl.errors.Unprocessable``)."""
        if self.split is None:
            return self.model_spec
        part = self.part_of(node)
        if part is None:
            raise Unprocessable(f"job {self.spec.job!r} holds its model's shards on nodes {', '.join(p.node for p in self.split[1])}, "
                                f"not on {node}: send each node its part (GET /v1/jobs/{self.spec.job}/parts)",
                                code="not_a_part_node")
        return part.spec

    @property
    def leaf_fan_in(self) -> int:
        """Updates per leaf for the job's current model (``JobSpec.fan_in_for``)."""
        return self.spec.fan_in_for(self.model_spec)


@dataclass(frozen=True)
class SecureRound:
    """A secure job's round (``lifl.secure_state``): its stage, the stage's deadline, the graph's
    degree, threshold and the signatures the consistency check needs once drawn, an abandoned
    round's reason."""

    job: str
    round: int
    stage: str
    seed: bytes
    deadline_ms: int  # on the Redis clock
    capacity: int
    k: int
    threshold: int
    signatures: int
    why: str

    @classmethod
    def parse(cls, job: str, h: dict[str, str]) -> SecureRound | None:
        if not h:
            return None
        return cls(job, int(h["round"]), h["stage"], bytes.fromhex(h["seed"]), int(h["deadline"]), int(h["capacity"]),
                   int(h.get("k", 0)), int(h.get("t", 0)), int(h.get("s", 0)), h.get("why", ""))

    @property
    def context(self) -> bytes:
        return secagg.round_context(self.job, self.round, self.seed)


@dataclass(frozen=True)
class Shard:
    """A round's shard plan and its accounting (see the module docstring)."""

    round: int
    finalized: bool  # closed with its final counts known
    counts: dict[str, int]  # acknowledged updates per node (final once finalized)
    top: str | None  # node hosting the top aggregator (set once finalized)
    epoch: int  # bumped each time the top moves
    delivered: frozenset[str]  # nodes whose partial reached the top of this epoch
    dead: frozenset[str]
    lost: dict[str, int]  # updates lost with dead nodes
    plan: dict[str, Any] | None  # {"policy", "quotas": [[node, n], ...], "top"}
    assigned: dict[str, int] = field(default_factory=dict)  # clients sent to each node
    inflight: dict[str, int] = field(default_factory=dict)  # uploads in progress on each node
    first_update: float | None = None  # when its first update was acknowledged (Redis clock, s)
    installed: frozenset[str] = frozenset()  # split jobs: nodes that have their part of the next version

    @property
    def participants(self) -> dict[str, int]:
        """Nodes whose results the top waits for, with their update counts."""
        return {n: c for n, c in self.counts.items() if c > 0}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @classmethod
    def parse(cls, h: dict[str, str]) -> Shard:
        final = {k[6:]: int(v) for k, v in h.items() if k.startswith("final.")}
        counts = final if h.get("finalized") == "1" else {k[6:]: int(v) for k, v in h.items() if k.startswith("count.")}
        epoch = int(h.get("epoch", 0))
        return cls(
            round=int(h.get("round", -1)),
            finalized=h.get("finalized") == "1",
            counts=counts,
            top=h.get("top") or None,
            epoch=epoch,
            delivered=frozenset(k[10:] for k, v in h.items() if k.startswith("delivered.") and int(v) == epoch),
            dead=frozenset(k[5:] for k in h if k.startswith("dead.")),
            lost={k[5:]: int(v) for k, v in h.items() if k.startswith("lost.")},
            plan=json.loads(h["plan"]) if h.get("plan") else None,
            assigned={k[9:]: int(v) for k, v in h.items() if k.startswith("assigned.")},
            inflight={k[9:]: int(v) for k, v in h.items() if k.startswith("inflight.")},
            first_update=int(h["first_ms"]) / 1000 if "first_ms" in h else None,
            installed=frozenset(k[10:] for k in h if k.startswith("installed.")),
        )


@dataclass(frozen=True)
class Loss:
    """What ``node_lost`` did."""

    handled: bool  # False: another round, or the node was handled already
    remaining: int  # acknowledged updates the round still holds
    closed: bool
    top_lost: bool
