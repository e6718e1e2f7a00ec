"""A node's aggregation tree for each round of its jobs, as a pure state machine.

Within a node a round is a two-level tree (LIFL §5.2): leaves of fan-in I, created as client
updates arrive, fold into one middle; the middle's result goes to the round's top, on this
node or another one (appendix A, inter-node routing), which installs the new model.

Events come in (an update acknowledged here, the round's shard as Redis holds it, a task's
result, a partial result from another node) and effects go out (start a task, deliver an
input, resize a fan-in, forward a result to a node, install, cancel, release); the agent
applies them. Nothing here does I/O, so every transition is tested with tables.

The tree's size follows the round's global life: while the round is open, the middle's
fan-in is open (this node does not know how many updates it will get); once the round is
closed and its counts are final, the last leaf and the middle learn their fan-ins; once
the shard names the top's node, the middle's result is routed there. The top's fan-in is
the number of nodes that took part; it shrinks when a node dies before its result arrived.

A job with tensor shards (``lifl.shards``) has one such tree per shard in each round, its
*lanes*: every update goes to a leaf of each lane (which folds only its shard's slice of
it), and each lane's top writes its slice of the next model into one object, installed
once every lane's top is done. Lanes of a round run on the node hosting all its tops; a job
whose shards are split across nodes has the lanes of its own shards on each node, each node
its own tops (``sync``'s ``own_top``), and every node's count is every update's part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lifl.cluster_types import Shard
from lifl.protocol import LEAF, MIDDLE, TOP

OPEN = 0  # a fan-in not known yet (it becomes known when the round closes)


@dataclass(frozen=True)
class Input:
    """An object on its way into a task: a client update or a partial sum."""

    key: bytes
    samples: int
    updates: int  # client updates it stands for
    partial: bool  # True: a partial sum in accumulator dtypes


@dataclass(eq=False)
class Task:
    id: int
    job: str
    round: int
    version: int  # the global version whose updates the round aggregates
    role: str
    fan_in: int  # OPEN until known
    inputs: int = 0  # inputs delivered so far
    shard: int = 0  # the tensor shard (lane) it aggregates


# -- effects ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """A new task: run it on an instance once it has an input."""

    task: Task


@dataclass(frozen=True)
class Deliver:
    """Hand ``input`` to a local task (its object now belongs to the task; ``shared``: the task
    takes a reference of its own, the object being delivered to a leaf of each shard)."""

    task: int
    input: Input
    shared: bool = False


@dataclass(frozen=True)
class Resize:
    """The task's final fan-in is now known."""

    task: int
    fan_in: int


@dataclass(frozen=True)
class Forward:
    """Send this node's result of the round to the top on ``node`` (kept until the round ends,
    in case the top moves and it must be sent again)."""

    job: str
    round: int
    node: str
    epoch: int
    input: Input


@dataclass(frozen=True)
class Install:
    """The top has the round's sum: make it version ``version + 1``."""

    job: str
    round: int
    version: int
    input: Input


@dataclass(frozen=True)
class Cancel:
    """Call a task off (its instance is told; what it holds is released)."""

    task: int
    reason: str


@dataclass(frozen=True)
class Drop:
    """An object nobody will use (a duplicate, or an update of a round already over here)."""

    key: bytes


@dataclass(frozen=True)
class Release:
    """The round is over on this node: release what it kept (a forwarded result)."""

    job: str
    round: int


Effect = Start | Deliver | Resize | Forward | Install | Cancel | Drop | Release


class NotTheTop(Exception):
    """A partial result arrived for a round whose top is not (or no longer) on this node."""


@dataclass(eq=False)
class Lane:
    """One shard's tree in a round (a job without shards has one)."""

    middle: Task
    leaves: list[Task] = field(default_factory=list)
    top: Task | None = None
    result: Input | None = None  # the middle's result while it is kept here
    sent: tuple[str, int] | None = None  # (node, epoch) the result was forwarded to
    received_from: set[str] = field(default_factory=set)  # nodes whose partials the top got
    written: Input | None = None  # sharded: the top wrote its slice of the next model

    @property
    def tasks(self) -> list[Task]:
        return [*self.leaves, self.middle, *([self.top] if self.top else [])]


@dataclass(eq=False)
class LocalRound:
    job: str
    round: int
    version: int
    leaf_fan_in: int
    lanes: list[Lane]
    count: int = 0  # client updates acknowledged here
    final: int | None = None  # this node's count once the round closed
    tree_closed: bool = False  # the last leaf and the middle know their fan-ins
    top_node: str | None = None
    epoch: int = -1

    @property
    def tasks(self) -> list[Task]:
        return [t for lane in self.lanes for t in lane.tasks]

    @property
    def top(self) -> Task | None:
        """The first lane's top: every lane has one once this node hosts the round's top."""
        return self.lanes[0].top

    @property
    def sent(self) -> tuple[str, int] | None:
        return self.lanes[0].sent


class Trees:
    """Every round this node takes part in, one per job (a job's rounds are sequential)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.rounds: dict[str, LocalRound] = {}
        self.tasks: dict[int, Task] = {}
        self._next_id = 0

    def _task(self, job: str, round_id: int, version: int, role: str, fan_in: int, shard: int) -> Task:
        self._next_id += 1
        task = Task(self._next_id, job, round_id, version, role, fan_in, shard=shard)
        self.tasks[task.id] = task
        return task

    def round_of(self, job: str) -> LocalRound | None:
        return self.rounds.get(job)

    # -- events ---------------------------------------------------------------------------------
    def accepted(self, job: str, round_id: int, version: int, leaf_fan_in: int, update: Input, shards: int = 1
                 ) -> list[Effect]:
        """A client update of round ``round_id`` was acknowledged on this node (``shards``: the
        lanes of a round of the job)."""
        effects: list[Effect] = []
        r = self.rounds.get(job)
        if r is not None and r.round < round_id:
            effects += self._end(r, f"round {r.round} is over")
            r = None
        if r is not None and r.round > round_id:
            return [Drop(update.key)]  # the round ended here already (this node was fenced)
        if r is None:
            lanes = [Lane(self._task(job, round_id, version, MIDDLE, OPEN, s)) for s in range(shards)]
            r = self.rounds[job] = LocalRound(job, round_id, version, leaf_fan_in, lanes)
            effects += [Start(lane.middle) for lane in lanes]
        index = r.count // r.leaf_fan_in
        r.count += 1
        for s, lane in enumerate(r.lanes):
            if index == len(lane.leaves):
                leaf = self._task(job, round_id, version, LEAF, r.leaf_fan_in, s)
                lane.leaves.append(leaf)
                effects.append(Start(leaf))
            effects.append(self._deliver(lane.leaves[index], update, shared=s > 0))
        return effects + self._close_tree(r)

    def sync(self, job: str, shard: Shard, own_top: bool = False) -> list[Effect]:
        """Bring the tree in line with the round's shard (level-based: safe to repeat).
        ``own_top``: the job's shards are split across nodes, each node aggregating its own to
        the end, so its tops are here whatever the shard says, each fed by this node alone."""
        r = self.rounds.get(job)
        if r is None or shard.round < r.round:
            return []
        if shard.round > r.round:
            return self._end(r, f"round {r.round} is over")
        if self.node in shard.dead:
            return self._end(r, f"node {self.node} was declared dead for round {r.round}")
        if not shard.finalized:
            return []
        effects: list[Effect] = []
        if r.final is None:
            r.final = shard.counts.get(self.node, 0)
            if r.final < r.count:
                raise ValueError(f"round {r.round} of {job!r} closed with {r.final} updates on {self.node}, "
                                 f"which acknowledged {r.count}")
            effects += self._close_tree(r)
        top, epoch = (self.node, 0) if own_top else (shard.top, shard.epoch)
        if top is not None and (top, epoch) != (r.top_node, r.epoch):
            r.top_node, r.epoch = top, epoch
            for s, lane in enumerate(r.lanes):
                if top == self.node and lane.top is None:
                    lane.top = self._task(job, r.round, r.version, TOP, OPEN, s)
                    effects.append(Start(lane.top))
                effects += self._route_result(r, lane)
        wanted = 1 if own_top else len(shard.participants)
        for lane in r.lanes:
            if lane.top is not None and wanted != lane.top.fan_in and wanted >= lane.top.inputs:
                lane.top.fan_in = wanted
                effects.append(Resize(lane.top.id, wanted))
        return effects

    def result(self, task_id: int, output: Input) -> list[Effect]:
        """A task handed off its result: leaves feed the middle, the middle feeds the top
        (here, or on another node), the top's result becomes the next version."""
        task = self.tasks[task_id]
        r = self.rounds[task.job]
        if r.round != task.round:
            raise ValueError(f"task {task_id} belongs to round {task.round}, not the current {r.round}")
        lane = r.lanes[task.shard]
        if task.role == LEAF:
            return [self._deliver(lane.middle, output)]
        if task.role == MIDDLE:
            lane.result = output
            return self._route_result(r, lane)
        if len(r.lanes) == 1:
            return [Install(r.job, r.round, r.version, output)]
        lane.written = output
        written = [other.written for other in r.lanes]
        if any(w is None for w in written):
            return []
        if len({(w.key, w.samples, w.updates) for w in written if w is not None}) != 1:
            raise ValueError(f"the shards of round {r.round} of {r.job!r} wrote different models or sums: "
                             + ", ".join(f"{w.key.hex()} ({w.samples} samples)" for w in written if w is not None))
        return [Install(r.job, r.round, r.version, output)]

    def lanes_writing(self, task_id: int) -> int:
        """A top's round: how many of its shards' tops have not written their slices yet (this
        one among them, until its result is given); 1 for a round without shards."""
        task = self.tasks[task_id]
        r = self.rounds[task.job]
        return sum(lane.written is None for lane in r.lanes) if len(r.lanes) > 1 else 1

    def partial(self, job: str, round_id: int, from_node: str, epoch: int, partial: Input) -> list[Effect]:
        """Another node's result of the round, for the top hosted here."""
        r = self.rounds.get(job)
        if r is None or r.round != round_id or r.top is None or r.epoch != epoch:
            raise NotTheTop(f"node {self.node} does not host the top of round {round_id} (epoch {epoch}) of {job!r}")
        lane = r.lanes[0]
        if from_node in lane.received_from:
            return [Drop(partial.key)]
        lane.received_from.add(from_node)
        assert lane.top is not None
        return [self._deliver(lane.top, partial)]

    def producers(self, task_id: int) -> list[int]:
        """The unfinished tasks here whose results are inputs of ``task_id``: a middle's leaves,
        the top's middle (a leaf's inputs come from clients)."""
        task = self.tasks.get(task_id)
        r = self.rounds.get(task.job) if task is not None else None
        if task is None or r is None or r.round != task.round:
            return []
        lane = r.lanes[task.shard]
        children = {MIDDLE: lane.leaves, TOP: [lane.middle]}.get(task.role, [])
        return [t.id for t in children if t.id in self.tasks]

    def finished(self, task_id: int) -> None:
        """The task is done (its instance reported back)."""
        self.tasks.pop(task_id, None)

    def end(self, job: str, reason: str) -> list[Effect]:
        """Drop the job's round on this node (its aggregation failed, or the job went away)."""
        r = self.rounds.get(job)
        return self._end(r, reason) if r else []

    # -- helpers --------------------------------------------------------------------------------
    def _deliver(self, task: Task, item: Input, *, shared: bool = False) -> Deliver:
        task.inputs += 1
        if task.fan_in != OPEN and task.inputs > task.fan_in:
            raise ValueError(f"task {task.id} ({task.role}) got input {task.inputs} of a fan-in of {task.fan_in}")
        return Deliver(task.id, item, shared)

    def _close_tree(self, r: LocalRound) -> list[Effect]:
        """Once every update of this node has arrived, the last leaf and the middle can finish."""
        if r.tree_closed or r.final is None or r.count < r.final:
            return []
        r.tree_closed = True
        effects: list[Effect] = []
        for lane in r.lanes:
            last = lane.leaves[-1]
            if last.inputs < last.fan_in:
                last.fan_in = last.inputs
                effects.append(Resize(last.id, last.fan_in))
            lane.middle.fan_in = len(lane.leaves)
            effects.append(Resize(lane.middle.id, lane.middle.fan_in))
        return effects

    def _route_result(self, r: LocalRound, lane: Lane) -> list[Effect]:
        """Send the lane's middle's result to its top once both are known (again if the top moved)."""
        if lane.result is None or r.top_node is None:
            return []
        if lane.top is not None:
            item, lane.result = lane.result, None
            lane.received_from.add(self.node)
            return [self._deliver(lane.top, item)]
        if lane.sent == (r.top_node, r.epoch):
            return []
        if len(r.lanes) > 1:  # checked where the job is created; a cluster that grew since refuses here
            raise ValueError(f"round {r.round} of {r.job!r} has tensor shards, which aggregate on one node, "
                             f"but its top is on {r.top_node}")
        lane.sent = (r.top_node, r.epoch)
        return [Forward(r.job, r.round, r.top_node, r.epoch, lane.result)]

    def _end(self, r: LocalRound, reason: str) -> list[Effect]:
        del self.rounds[r.job]
        effects: list[Effect] = [Cancel(t.id, reason) for t in r.tasks if t.id in self.tasks]
        for t in r.tasks:
            self.tasks.pop(t.id, None)
        return effects + [Release(r.job, r.round)]
