"""Memory admission for one node: say 202 only with the memory to aggregate what was admitted.

An update acknowledged with 202 must be aggregated, so admission reserves, before it answers,
every byte that aggregating the admitted updates will need on this node (``round_extra``):

- the update's own object;
- a leaf accumulator when the update is a leaf's second input (a lone input is held, not
  copied: ``lifl.fedavg``), the middle's accumulator when it starts the second leaf, and the
  next model (written by the top, if the top is here) with the round's first update;
- a second accumulator for each task that folds more than once (a leaf's third input, the
  third leaf's result for the middle): every fold writes a fresh accumulator from the previous
  one (so a crashed task runs again from the latest), and both exist while it runs;
- for a partial result forwarded by another node to the top hosted here: its own bytes, the
  top's accumulators as for the middle, and the next model if no update reserved it.

Leaf results may wait for the middle (say every instance is busy), so the reservation covers
all of them: it is the round's peak however its tasks are scheduled (the next model too,
though the top may turn out to be on another node: where it goes is decided when the round
closes). Creating an object for the round consumes the reservation; an accumulator freed
before its round ends (folded into the next, or its task crashed) goes back to it, since a
later fold or the re-run allocates again; what is left is released when the round ends on
this node.

Fair shares: a job may hold (live objects plus reservations plus the request) at most
``(capacity - pinned) / N`` bytes, N being the jobs holding memory here plus those refused
within ``WANTING_SECONDS``, the requester included. A job alone may use everything; once a
second job wants memory the first is capped at half and the second gets its half as the
first's round frees memory. A round that needs more than a share at once (its *floor*: its
accumulators and next model, and the inputs of the leaf taking the update) may still grow to
its floor, one leaf at a time, so that it finishes and frees its memory instead of holding it
until the other jobs stop wanting. Models and replicas are *pinned*: inside capacity, outside
the shares. Partial results are exempt from the shares (they finish a round, which frees its
memory) but not from capacity. A job whose round needs more memory at once than the node
has for jobs at all is told so (``shm_too_small``) instead of being asked to retry in vain.

Refusals are ``Overloaded`` (HTTP 503 with Retry-After, gRPC RESOURCE_EXHAUSTED) with codes
``shm_too_small``, ``fair_share`` and ``shm_exhausted``. Pure: no I/O, the clock is an argument.
The object store (``lifl.store``) keeps a node's ledger and creates objects through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from lifl import format as fmt
from lifl.fixedpoint import FixedPoint, partial_spec
from lifl.errors import Overloaded

WANTING_SECONDS = 5.0  # a refused job counts for the fair shares this long (longer than its Retry-After)
RETRY_AFTER_SECONDS = 1.0  # what a refused upload is told to wait

UPDATE = "update"  # a client update, admitted through the job's fair share
PARTIAL = "partial"  # another node's result of the round, for the top hosted here


class RoundOf(NamedTuple):
    """The round an object or a reservation belongs to."""

    job: str
    round: int


@dataclass(frozen=True)
class JobSizes:
    """The sizes that aggregating a job's updates allocates on a node."""

    accumulator: int  # a partial sum: header and tensors in accumulator dtypes
    model: int  # what the top writes: the next model (header and tensors in model dtypes), and a strategy's objects
    leaf_fan_in: int

    @classmethod
    def of(cls, spec: fmt.ModelSpec, leaf_fan_in: int, strategy_bytes: int = 0,
           fixed_point: FixedPoint | None = None) -> JobSizes:
        """The objects the aggregator function allocates (``functions/aggregator/handler``);
        ``strategy_bytes``: what a strategy step allocates besides the model (``functions/aggregator/top``);
        ``fixed_point``: partial sums are integers (``lifl.fixedpoint``)."""
        partial = partial_spec(spec, fixed_point)
        return cls(len(fmt.spec_header(partial)) + partial.data_bytes,
                   len(fmt.spec_header(spec)) + spec.data_bytes + strategy_bytes, leaf_fan_in)


def round_extra(sizes: JobSizes, updates: int, partials: int) -> int:
    """Bytes the round allocates on this node, beyond its inputs, once it has ``updates`` client
    updates and ``partials`` results of other nodes: an accumulator for each task with two
    inputs or more, and the next model."""
    fan_in = sizes.leaf_fan_in
    full, last = divmod(updates, fan_in)
    leaf_accumulators = full + (last >= 2) if fan_in >= 2 else 0
    leaf_refolds = full + (last >= 3) if fan_in >= 3 else 0  # leaves past their first fold
    leaves = full + (last > 0)
    top_inputs = partials + (updates > 0)  # this node's own result, and the other nodes'
    accumulators = (leaf_accumulators + leaf_refolds + _folding(leaves) + _folding(top_inputs))
    return accumulators * sizes.accumulator + (top_inputs >= 1) * sizes.model


def _folding(inputs: int) -> int:
    """Accumulators a task of ``inputs`` inputs has at once: none for one (held), one for two,
    two from three on (the fold writing a new one from the previous one)."""
    return min(max(inputs - 1, 0), 2)


def node_peak(sizes: JobSizes, update_bytes: int, updates: int, partials: int) -> int:
    """The most shared memory a node needs at once for its part of a round, ``updates`` client
    updates of ``update_bytes`` and (if it hosts the top) ``partials`` results of other nodes,
    taken one leaf at a time: the floor ``MemoryLedger.reserve`` admits by."""
    fan_in = sizes.leaf_fan_in
    # the floor is largest when a leaf's last input arrives (all its inputs wait together) or
    # at the round's last update (the most accumulators): one of the two is the peak
    peak = round_extra(sizes, updates, partials) + ((updates - 1) % fan_in + 1) * update_bytes if updates else 0
    if full_leaf := updates - updates % fan_in:
        peak = max(peak, round_extra(sizes, full_leaf, partials) + fan_in * update_bytes)
    if partials:
        peak = max(peak, round_extra(sizes, updates, partials) + sizes.accumulator)
    return peak


def round_fit(sizes: JobSizes, update_bytes: int, goal: int, for_jobs: list[int]) -> tuple[bool, int]:
    """Whether a round of ``goal`` updates fits on nodes with ``for_jobs`` bytes each for rounds,
    spread evenly over as many of them as it takes (the top, which also holds the others'
    results, on the largest); and the least the largest node must have for it. A job whose
    round can never fit is refused before any update of it is acknowledged."""
    room = sorted(for_jobs, reverse=True) or [0]
    least = None
    for n in range(1, min(len(room), goal) + 1):
        updates = -(-goal // n)
        top = node_peak(sizes, update_bytes, updates, n - 1)
        least = top if least is None else min(least, top)
        if top <= room[0] and node_peak(sizes, update_bytes, updates, 0) <= room[n - 1]:
            return True, top
    assert least is not None
    return False, least


@dataclass
class RoundReservation:
    """What one round has admitted on this node, and what it reserved and has not allocated yet."""

    sizes: JobSizes
    updates: int = 0
    partials: int = 0
    reserved: int = 0

    def extra(self) -> int:
        return round_extra(self.sizes, self.updates, self.partials)

    def count(self, kind: str, delta: int) -> None:
        if kind == UPDATE:
            self.updates += delta
        else:
            self.partials += delta


@dataclass
class JobMemory:
    working: int = 0  # live objects of the job's rounds
    rounds: dict[int, RoundReservation] = field(default_factory=dict)

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.rounds.values())

    @property
    def held(self) -> int:
        return self.working + self.reserved


@dataclass(frozen=True)
class JobUsage:
    working: int
    reserved: int


class MemoryLedger:
    """One node's shared memory: pinned models, each job's working bytes and reservations.

    The invariant ``used + reserved <= capacity`` holds after every operation (the store's
    pool of free segments counts as free: it is evicted to make room), so an object that a
    reservation covers can always be created."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pinned = 0  # models, replicas, a model being uploaded
        self.retained = 0  # kept for queries only (lifl.flstore.retention): the first to go under pressure
        self.jobs: dict[str, JobMemory] = {}
        self.wanting: dict[str, float] = {}  # job -> when it was last refused

    # -- reads ------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.pinned + self.retained + sum(j.working for j in self.jobs.values())

    @property
    def reserved(self) -> int:
        return sum(j.reserved for j in self.jobs.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    def usage(self, job: str) -> JobUsage:
        memory = self.jobs.get(job, JobMemory())
        return JobUsage(memory.working, memory.reserved)

    def share(self, job: str, now: float) -> tuple[int, int]:
        """(bytes ``job`` may hold, how many jobs share the unpinned memory)."""
        self.wanting = {j: t for j, t in self.wanting.items() if now - t < WANTING_SECONDS}
        sharing = {j for j, m in self.jobs.items() if m.held > 0} | set(self.wanting) | {job}
        return (self.capacity - self.pinned) // len(sharing), len(sharing)

    # -- admission --------------------------------------------------------------------------
    def reserve(self, owner: RoundOf, kind: str, sizes: JobSizes, nbytes: int, now: float) -> int:
        """Reserve an admitted object of ``nbytes`` and what aggregating it adds to its round,
        all or nothing; returns the bytes reserved, or raises ``Overloaded``."""
        memory = self.jobs.setdefault(owner.job, JobMemory())
        self._release_older_rounds(memory, owner.round)  # the job's rounds are sequential
        r = memory.rounds.get(owner.round) or RoundReservation(sizes)
        before = r.extra()
        r.count(kind, 1)
        after = r.extra()
        r.count(kind, -1)
        need = nbytes + after - before
        # what must coexist for the round to take it: its extra, this input, and the inputs
        # already waiting in the same leaf (held until the leaf folds them)
        siblings = r.updates % sizes.leaf_fan_in * nbytes if kind == UPDATE else 0
        floor, for_jobs = after + nbytes + siblings, self.capacity - self.pinned
        if floor > for_jobs:
            self._forget_if_idle(owner.job)
            raise Overloaded(
                f"job {owner.job!r} cannot take this {kind} here: its round would need {floor} bytes of shared memory "
                f"at once (inputs of {nbytes} bytes, accumulators of {sizes.accumulator}, a model of {sizes.model}, "
                f"leaf fan-in {sizes.leaf_fan_in}) and this node has {for_jobs} bytes for jobs ({self.capacity} less "
                f"{self.pinned} held by models); it needs a larger --shm-limit or fewer updates per round on this node",
                code="shm_too_small", retry_after=RETRY_AFTER_SECONDS)
        if need > self.free:
            self._refused(owner.job, now)
            raise Overloaded(
                f"job {owner.job!r} needs {need} bytes of shared memory and {max(self.free, 0)} of {self.capacity} are "
                f"free; retry after {RETRY_AFTER_SECONDS:g} s", code="shm_exhausted", retry_after=RETRY_AFTER_SECONDS)
        if kind == UPDATE:  # memory is free, but kept for the other jobs that want some
            share, sharing = self.share(owner.job, now)
            # a round larger than a share may still take its updates one leaf at a time (its
            # floor), or it could never finish and free what it holds while others want memory
            if memory.held + need > max(share, floor):
                self._refused(owner.job, now)
                raise Overloaded(
                    f"job {owner.job!r} holds {memory.held} bytes of shared memory and needs {need} more, over its fair "
                    f"share of {share} bytes ({sharing} jobs want memory on this node); "
                    f"retry after {RETRY_AFTER_SECONDS:g} s", code="fair_share", retry_after=RETRY_AFTER_SECONDS)
        r.count(kind, 1)
        r.reserved += need
        memory.rounds[owner.round] = r
        return need

    def withdraw(self, owner: RoundOf, kind: str, unused: int = 0) -> None:
        """An admitted object that will not be aggregated (aborted, or never created): its
        round gives back what it added, and ``unused`` bytes reserved for the object itself."""
        r = self._round(owner)
        if r is None:
            return
        before = r.extra()
        r.count(kind, -1)
        # clamped: a re-run may have drawn more than planned (its excess came from free memory)
        r.reserved -= min(r.reserved, before - r.extra() + unused)
        self._forget_if_idle(owner.job)

    def release_round(self, owner: RoundOf) -> int:
        """The round is over on this node: release what it (and any older round) did not use."""
        memory = self.jobs.get(owner.job)
        if memory is None:
            return 0
        released = self._release_older_rounds(memory, owner.round + 1)
        self._forget_if_idle(owner.job)
        return released

    # -- objects ----------------------------------------------------------------------------
    def check_object(self, owner: RoundOf | None, size: int) -> None:
        """Raise ``Overloaded`` unless an object of ``size`` bytes fits: what its round's
        reservation does not cover must come from free memory."""
        r = self._round(owner)
        uncovered = size - min(size, r.reserved if r else 0)
        if uncovered > self.free:
            raise Overloaded(
                f"shared memory is full: {size} bytes requested for {owner.job if owner else 'a model'!r}, "
                f"{size - uncovered} of them reserved, {max(self.free, 0)} of {self.capacity} free",
                code="shm_exhausted", retry_after=RETRY_AFTER_SECONDS)

    def add_object(self, owner: RoundOf | None, size: int) -> int:
        """Account a created object (call ``check_object`` first); returns the bytes it drew
        from its round's reservation."""
        if owner is None:
            self.pinned += size
            return 0
        memory = self.jobs.setdefault(owner.job, JobMemory())
        memory.working += size
        r = memory.rounds.get(owner.round)
        drawn = min(size, r.reserved) if r else 0
        if r:
            r.reserved -= drawn
        return drawn

    def remove_object(self, owner: RoundOf | None, size: int, refund: int = 0) -> None:
        """An object was freed; ``refund`` bytes go back to its round's reservation if the round
        is still open here (a crashed task's accumulator: its re-run allocates it again)."""
        if owner is None:
            self.pinned -= size
            return
        memory = self.jobs[owner.job]
        memory.working -= size
        r = memory.rounds.get(owner.round)
        if r is not None:
            r.reserved += refund
        self._forget_if_idle(owner.job)

    def pin(self, owner: RoundOf, size: int) -> None:
        """A round's result became the job's model: out of the job's share, still in capacity."""
        self.jobs[owner.job].working -= size
        self.pinned += size
        self._forget_if_idle(owner.job)

    def retain(self, owner: RoundOf | None, size: int) -> None:
        """Only retention holds the object now: out of its job's working memory (or the pinned
        models), into the retained bytes that admission may evict."""
        if owner is None:
            self.pinned -= size
        else:
            self.jobs[owner.job].working -= size
            self._forget_if_idle(owner.job)
        self.retained += size

    def remove_retained(self, size: int) -> None:
        self.retained -= size

    # -- helpers ----------------------------------------------------------------------------
    def _round(self, owner: RoundOf | None) -> RoundReservation | None:
        memory = self.jobs.get(owner.job) if owner else None
        return memory.rounds.get(owner.round) if memory and owner else None

    @staticmethod
    def _release_older_rounds(memory: JobMemory, before: int) -> int:
        """Once a later round admits, no earlier one allocates again (it installed or was abandoned)."""
        return sum(memory.rounds.pop(r).reserved for r in [r for r in memory.rounds if r < before])

    def _refused(self, job: str, now: float) -> None:
        self.wanting[job] = now
        self._forget_if_idle(job)

    def _forget_if_idle(self, job: str) -> None:
        memory = self.jobs.get(job)
        if memory is not None and memory.working == 0 and not any(r.reserved or r.updates or r.partials
                                                                    for r in memory.rounds.values()):
            del self.jobs[job]
