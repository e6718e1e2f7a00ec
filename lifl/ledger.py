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

Memory is attributed to tenants: a job's objects and reservations count against its tenant.
Fair shares have two levels. The memory for jobs (``capacity`` less objects of no job) is split
evenly between the tenants holding memory here or refused within ``WANTING_SECONDS``, the
requester's included; a tenant's share, less its pinned objects, is split evenly between its
jobs with rounds here or refused within ``WANTING_SECONDS``. A tenant or job alone may use
everything; once a second wants memory the first is capped at half and the second gets its
half as the first's rounds free memory, so a tenant with 31 jobs gets half against a tenant
with one, not 31/32. A round that needs more than its share at once (its *floor*: its
accumulators and next model, and the inputs of the leaf taking the update) may still grow to
its floor, one leaf at a time, on top of its tenant's pinned objects, so that it finishes and
frees its memory instead of holding it until the others stop wanting.

Models, replicas and other objects of a job outside its rounds are *pinned* (``Pinned``): no
round frees them, but they count against their tenant's share and quota. A model a client
sends is admitted (``admit_pinned``) only within its tenant's share while other tenants want
memory; models restored or fetched back from checkpoints are created within capacity only (a
job's model must be somewhere). Pinned memory does not drain by itself, so a tenant that filled
the node alone keeps its models when a second tenant arrives: the second is refused
(``shm_exhausted``, counted as wanting), which makes the first over its share; ``over_share``
says by how much, its rounds are refused until it is under, and idle models are spilled to the
checkpoint store to make it so. Partial results are exempt from the shares and the quota (they
finish a round, which frees its memory) but not from capacity. A job whose round needs more
memory at once than its tenant could ever have here is told so (``shm_too_small``) instead of
being asked to retry in vain.

Tenant quotas (``lifl.quotas``, handed over by ``set_quotas``): ``shm_bytes`` bounds a tenant's
pinned objects, working objects and reservations on this node: an update or a model past it is
refused with ``QuotaBusy`` (HTTP 429, ``quota_exceeded`` naming ``shm_bytes``, its limit and the
use), or ``QuotaExceeded`` (403) if its round alone could never fit in it. ``retained_bytes``
bounds what a tenant keeps for queries (``retained_limit``: retention drops its least recently
used past it; never a refusal). Retained bytes count against no share: they are the first to go
when memory is short.

Refusals are ``Overloaded`` (HTTP 503 with Retry-After, gRPC RESOURCE_EXHAUSTED) with codes
``shm_too_small``, ``fair_share`` and ``shm_exhausted``. Pure: no I/O, the clock is an argument.
The object store (``lifl.store``) keeps a node's ledger and creates objects through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from lifl import format as fmt
from lifl.fixedpoint import FixedPoint, partial_spec
from lifl.errors import Overloaded, QuotaBusy, QuotaExceeded
from lifl.quotas import Quota

WANTING_SECONDS = 5.0  # a refused job counts for the fair shares this long (longer than its Retry-After)
RETRY_AFTER_SECONDS = 1.0  # what a refused upload is told to wait

UPDATE = "update"  # a client update, admitted through the job's fair share
PARTIAL = "partial"  # another node's result of the round, for the top hosted here


class RoundOf(NamedTuple):
    """The round an object or a reservation belongs to."""

    job: str
    round: int


class Pinned(NamedTuple):
    """A job's object outside its rounds: its model, a replica, its strategy's state, a copy
    fetched back for a query. No round's reservation covers it and no round's end frees it;
    it counts against the job's tenant."""

    job: str


Owner = RoundOf | Pinned | None  # None: pinned, of no job (counted against no tenant)


@dataclass(frozen=True)
class JobSizes:
    """The sizes that aggregating a job's updates allocates on a node."""

    accumulator: int  # a partial sum: header and tensors in accumulator dtypes
    model: int  # what the top writes: the next model (header and tensors in model dtypes), and a strategy's objects
    leaf_fan_in: int
    max_inflight: int = 0  # updates held here at once (the job's max_inflight); 0: no bound
    secure: bool = False  # a secure round's: each leaf takes its clients' masks off in a copy of its sum

    @property
    def leaf_inputs_held(self) -> int:
        """The most inputs of one leaf held at once: its fan-in, or fewer if the job lets fewer
        updates wait (a leaf folds each as it comes and lets it go)."""
        return min(self.leaf_fan_in, self.max_inflight) if self.max_inflight else self.leaf_fan_in

    @classmethod
    def of(cls, spec: fmt.ModelSpec, leaf_fan_in: int, strategy_bytes: int = 0,
           fixed_point: FixedPoint | None = None, floats: fmt.DType = fmt.F64, max_inflight: int = 0,
           secure: bool = False) -> JobSizes:
        """The objects the aggregator function allocates (``functions/aggregator/handler``);
        ``strategy_bytes``: what a strategy step allocates besides the model (``functions/aggregator/top``);
        ``fixed_point``: partial sums are integers (``lifl.fixedpoint``); ``floats``: else, their dtype."""
        partial = partial_spec(spec, fixed_point, floats)
        return cls(len(fmt.spec_header(partial)) + partial.data_bytes,
                   len(fmt.spec_header(spec)) + spec.data_bytes + strategy_bytes, leaf_fan_in, max_inflight, secure)


def round_extra(sizes: JobSizes, updates: int, partials: int) -> int:
    """Bytes the round allocates on this node, beyond its inputs, once it has ``updates`` client
    updates and ``partials`` results of other nodes: an accumulator for each task with two
    inputs or more (and, in a secure round, each leaf's unmasked copy), and the next model."""
    fan_in = sizes.leaf_fan_in
    full, last = divmod(updates, fan_in)
    leaf_accumulators = full + (last >= 2) if fan_in >= 2 else 0
    leaf_refolds = full + (last >= 3) if fan_in >= 3 else 0  # leaves past their first fold
    leaves = full + (last > 0)
    top_inputs = partials + (updates > 0)  # this node's own result, and the other nodes'
    accumulators = (leaf_accumulators + leaf_refolds + _folding(leaves) + _folding(top_inputs) + sizes.secure * leaves)
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
    held = sizes.leaf_inputs_held
    peak = round_extra(sizes, updates, partials) + min((updates - 1) % fan_in + 1, held) * update_bytes if updates else 0
    if full_leaf := updates - updates % fan_in:
        peak = max(peak, round_extra(sizes, full_leaf, partials) + held * update_bytes)
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
    tenant: str
    working: int = 0  # live objects of the job's rounds
    pinned: int = 0  # its objects outside rounds (``Pinned``)
    rounds: dict[int, RoundReservation] = field(default_factory=dict)

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.rounds.values())

    @property
    def held(self) -> int:
        """The memory of its rounds: what its fair share inside its tenant's bounds."""
        return self.working + self.reserved

    @property
    def in_rounds(self) -> bool:
        return self.working > 0 or any(r.reserved or r.updates or r.partials for r in self.rounds.values())


@dataclass
class TenantMemory:
    pinned: int = 0  # its jobs' models, replicas and other pinned objects
    retained: int = 0  # its objects kept for queries only
    in_rounds: set[str] = field(default_factory=set)  # its jobs with round memory here


@dataclass(frozen=True)
class JobUsage:
    working: int
    reserved: int


class MemoryLedger:
    """One node's shared memory: each job's pinned objects, working bytes and reservations,
    attributed to the job's tenant, and the tenants' quotas (``set_quotas``).

    The invariant ``used + reserved <= capacity`` holds after every operation (the store's
    pool of free segments counts as free: it is evicted to make room), so an object that a
    reservation covers can always be created. Reads cost O(tenants + jobs with rounds here),
    not O(jobs): idle jobs with a model only are never iterated."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.unattributed = 0  # pinned objects of no job (``create`` without an owner)
        self.jobs: dict[str, JobMemory] = {}
        self.tenants: dict[str, TenantMemory] = {}
        self.wanting: dict[str, tuple[str, float]] = {}  # job -> (its tenant, when it was last refused)
        self.quotas: dict[str, Quota] = {}  # tenant -> its quota, as the operator set it (``ClusterState.quotas``)

    # -- reads ------------------------------------------------------------------------------
    @property
    def pinned(self) -> int:
        return self.unattributed + sum(t.pinned for t in self.tenants.values())

    @property
    def retained(self) -> int:
        """Kept for queries only (``lifl.flstore.retention``): the first to go under pressure."""
        return sum(t.retained for t in self.tenants.values())

    @property
    def used(self) -> int:
        return self.pinned + self.retained + sum(self.jobs[j].working for t in self.tenants.values() for j in t.in_rounds)

    @property
    def reserved(self) -> int:
        return sum(self.jobs[j].reserved for t in self.tenants.values() for j in t.in_rounds)

    @property
    def free(self) -> int:
        return self.capacity - self.used - self.reserved

    def usage(self, job: str) -> JobUsage:
        memory = self.jobs.get(job)
        return JobUsage(memory.working, memory.reserved) if memory else JobUsage(0, 0)

    def quota(self, tenant: str) -> Quota:
        return self.quotas.get(tenant) or Quota()

    def tenant_held(self, tenant: str) -> int:
        """What counts against the tenant's share and its ``shm_bytes`` quota: its pinned
        objects, and its rounds' objects and reservations (not what it retains for queries:
        that is evicted first whenever memory is short)."""
        t = self.tenants.get(tenant)
        return t.pinned + self._in_rounds(t) if t else 0

    def for_rounds(self, tenant: str) -> int:
        """The most the tenant's rounds may ever have on this node: capacity less objects of no
        job and the tenant's own pinned objects (other tenants' models beyond their shares are
        refused, spilled or freed: ``over_share``)."""
        t = self.tenants.get(tenant)
        return self.capacity - self.unattributed - (t.pinned if t else 0)

    def quota_room(self, tenant: str) -> int | None:
        """What the tenant's ``shm_bytes`` quota leaves its rounds on a node besides its pinned
        objects here (None: no quota): a round that needs more can never complete."""
        limit = self.quota(tenant).shm_bytes
        t = self.tenants.get(tenant)
        return None if limit is None else limit - (t.pinned if t else 0)

    def tenant_share(self, tenant: str, now: float) -> tuple[int, int]:
        """(bytes ``tenant`` may hold, how many tenants share): the memory for jobs split evenly
        between the tenants holding memory here or refused within ``WANTING_SECONDS``, ``tenant``
        included."""
        self.wanting = {j: (t, when) for j, (t, when) in self.wanting.items() if now - when < WANTING_SECONDS}
        sharing = ({name for name in self.tenants if self.tenant_held(name) > 0}
                   | {t for t, _ in self.wanting.values()} | {tenant})
        return (self.capacity - self.unattributed) // len(sharing), len(sharing)

    def job_share(self, job: str, tenant: str, now: float) -> tuple[int, int]:
        """(bytes ``job``'s rounds may hold, how many of the tenant's jobs share): the tenant's
        share less its pinned objects, split evenly between its jobs with rounds here or refused
        within ``WANTING_SECONDS``, ``job`` included."""
        share, _ = self.tenant_share(tenant, now)
        t = self.tenants.get(tenant)
        sharing = (t.in_rounds if t else set()) | {j for j, (of, _) in self.wanting.items() if of == tenant} | {job}
        return max(share - (t.pinned if t else 0), 0) // len(sharing), len(sharing)

    def over_share(self, now: float) -> dict[str, int]:
        """Bytes each tenant holds beyond its share while another tenant wants memory, or beyond
        its ``shm_bytes`` quota (it lowered): what must leave so that the others get theirs. Its
        rounds are refused until they are under (their memory drains as they end); its models
        only leave if spilled (or their jobs deleted): spilling reads this."""
        over = {}
        for tenant in self.tenants:
            share, sharing = self.tenant_share(tenant, now)
            held, limit = self.tenant_held(tenant), self.quota(tenant).shm_bytes
            excess = max(held - share if sharing > 1 else 0, held - limit if limit is not None else 0)
            if excess > 0:
                over[tenant] = excess
        return over

    def retained_limit(self, tenant: str, node_budget: int) -> int:
        """Bytes the tenant may keep for queries on this node: the node's budget per tenant, or
        its ``retained_bytes`` quota if lower (past it, its least recently used go first)."""
        limit = self.quota(tenant).retained_bytes
        return node_budget if limit is None else min(node_budget, limit)

    # -- quotas -----------------------------------------------------------------------------
    def set_quotas(self, quotas: dict[str, Quota]) -> None:
        """Every quota the operator set, by tenant (others have the defaults: no byte limits)."""
        self.quotas = dict(quotas)

    # -- admission --------------------------------------------------------------------------
    def reserve(self, owner: RoundOf, kind: str, sizes: JobSizes, nbytes: int, now: float,
                tenant: str | None = None) -> int:
        """Reserve an admitted object of ``nbytes`` and what aggregating it adds to its round,
        all or nothing; returns the bytes reserved, or raises ``Overloaded`` (``QuotaBusy``,
        ``QuotaExceeded`` past the tenant's ``shm_bytes``). ``tenant``: the job's (None: the
        job is a tenant of its own)."""
        tenant = tenant or owner.job
        memory = self._job(owner.job, tenant)
        self._release_older_rounds(memory, owner.round)  # the job's rounds are sequential
        r = memory.rounds.get(owner.round) or RoundReservation(sizes)
        before = r.extra()
        r.count(kind, 1)
        after = r.extra()
        r.count(kind, -1)
        need = nbytes + after - before
        # what must coexist for the round to take it: its extra, this input, and the inputs
        # already waiting in the same leaf (held until the leaf folds them)
        siblings = min(r.updates % sizes.leaf_fan_in, sizes.leaf_inputs_held - 1) * nbytes if kind == UPDATE else 0
        floor, for_rounds = after + nbytes + siblings, self.for_rounds(tenant)
        if floor > for_rounds:
            self._settle(owner.job)
            raise Overloaded(
                f"job {owner.job!r} cannot take this {kind} here: its round would need {floor} bytes of shared memory "
                f"at once (inputs of {nbytes} bytes, accumulators of {sizes.accumulator}, a model of {sizes.model}, "
                f"leaf fan-in {sizes.leaf_fan_in}) and this node has {for_rounds} bytes for the rounds of tenant "
                f"{tenant!r} ({self.capacity} less {self.capacity - for_rounds} held by its models and objects of no "
                f"job); it needs a larger --shm-limit or fewer updates per round on this node",
                code="shm_too_small", retry_after=RETRY_AFTER_SECONDS)
        if kind == UPDATE:  # partial results finish a round already admitted: never refused by quota
            self._check_quota(owner.job, tenant, need, floor)
        if need > self.free:
            self._refused(owner.job, tenant, now)
            raise Overloaded(
                f"job {owner.job!r} needs {need} bytes of shared memory and {max(self.free, 0)} of {self.capacity} are "
                f"free{self._over_others(tenant, now)}; retry after {RETRY_AFTER_SECONDS:g} s",
                code="shm_exhausted", retry_after=RETRY_AFTER_SECONDS)
        if kind == UPDATE:  # memory is free, but kept for the other tenants and jobs that want some
            self._check_shares(owner.job, tenant, memory, need, floor, now)
        r.count(kind, 1)
        r.reserved += need
        memory.rounds[owner.round] = r
        self._settle(owner.job)
        return need

    def _check_quota(self, job: str, tenant: str, need: int, least: int) -> None:
        """Refuse ``need`` more bytes past the tenant's ``shm_bytes``; for good (403) if even
        ``least`` bytes, held alone, would be past it."""
        limit = self.quota(tenant).shm_bytes
        held = self.tenant_held(tenant)
        if limit is None or held + need <= limit:
            return
        self._settle(job)
        extra = {"quota": "shm_bytes", "limit": limit, "used": held}
        if least > limit:
            raise QuotaExceeded(
                f"job {job!r} needs {least} bytes of shared memory at once on a node, over tenant {tenant!r}'s quota "
                f"(shm_bytes) of {limit}; the operator must raise it", extra=extra)
        raise QuotaBusy(
            f"tenant {tenant!r} holds {held} bytes of shared memory on this node and job {job!r} needs {need} more, "
            f"over its quota (shm_bytes) of {limit}; retry after {RETRY_AFTER_SECONDS:g} s, as its rounds end",
            retry_after=RETRY_AFTER_SECONDS, extra=extra)

    def _check_shares(self, job: str, tenant: str, memory: JobMemory, need: int, floor: int, now: float) -> None:
        """Refuse an update over its tenant's share or over its job's share inside it. A round
        larger than a share may still take its updates one leaf at a time (its floor, on top of
        its tenant's pinned objects), or it could never finish and free what it holds while
        others want memory."""
        share, tenants = self.tenant_share(tenant, now)
        t = self.tenants[tenant]
        in_rounds = self._in_rounds(t)
        if in_rounds + need > max(share - t.pinned, floor):
            self._refused(job, tenant, now)
            raise Overloaded(
                f"tenant {tenant!r} holds {t.pinned + in_rounds} bytes of shared memory ({t.pinned} in models) and "
                f"job {job!r} needs {need} more, over the tenant's fair share of {share} bytes ({tenants} tenants want "
                f"memory on this node); retry after {RETRY_AFTER_SECONDS:g} s", code="fair_share",
                retry_after=RETRY_AFTER_SECONDS)
        job_share, jobs = self.job_share(job, tenant, now)
        if memory.held + need > max(job_share, floor):
            self._refused(job, tenant, now)
            raise Overloaded(
                f"job {job!r} holds {memory.held} bytes of shared memory and needs {need} more, over its fair share of "
                f"{job_share} bytes (tenant {tenant!r}'s share of {share} bytes, less {t.pinned} in its models, "
                f"between {jobs} of its jobs wanting memory on this node); retry after {RETRY_AFTER_SECONDS:g} s",
                code="fair_share", retry_after=RETRY_AFTER_SECONDS)

    def admit_pinned(self, owner: Pinned, size: int, now: float, tenant: str) -> None:
        """Check the model a client sends for a job: within the tenant's ``shm_bytes`` quota,
        free memory and, while other tenants want memory, the tenant's share; raises
        ``Overloaded`` otherwise (then ``add_object`` it). A refused tenant counts as wanting
        memory, so tenants over their shares are refused and spilled (``over_share``)."""
        self._check_quota(owner.job, tenant, size, size)
        if size > self.free:
            self._refused(owner.job, tenant, now)
            raise Overloaded(
                f"the model of job {owner.job!r} needs {size} bytes of shared memory and {max(self.free, 0)} of "
                f"{self.capacity} are free{self._over_others(tenant, now)}; retry after {RETRY_AFTER_SECONDS:g} s",
                code="shm_exhausted", retry_after=RETRY_AFTER_SECONDS)
        share, tenants = self.tenant_share(tenant, now)
        held = self.tenant_held(tenant)
        if held + size > share:
            self._refused(owner.job, tenant, now)
            raise Overloaded(
                f"tenant {tenant!r} holds {held} bytes of shared memory and the model of job {owner.job!r} needs {size} "
                f"more, over the tenant's fair share of {share} bytes ({tenants} tenants want memory on this node); "
                f"retry after {RETRY_AFTER_SECONDS:g} s", code="fair_share", retry_after=RETRY_AFTER_SECONDS)

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
        self._settle(owner.job)

    def release_round(self, owner: RoundOf) -> int:
        """The round is over on this node: release what it (and any older round) did not use."""
        memory = self.jobs.get(owner.job)
        if memory is None:
            return 0
        released = self._release_older_rounds(memory, owner.round + 1)
        self._settle(owner.job)
        return released

    # -- objects ----------------------------------------------------------------------------
    def check_object(self, owner: Owner, size: int) -> None:
        """Raise ``Overloaded`` unless an object of ``size`` bytes fits: what its round's
        reservation does not cover must come from free memory."""
        r = self._round(owner)
        uncovered = size - min(size, r.reserved if r else 0)
        if uncovered > self.free:
            raise Overloaded(
                f"shared memory is full: {size} bytes requested for {owner.job if owner else 'an object of no job'!r}, "
                f"{size - uncovered} of them reserved, {max(self.free, 0)} of {self.capacity} free",
                code="shm_exhausted", retry_after=RETRY_AFTER_SECONDS)

    def add_object(self, owner: Owner, size: int, tenant: str | None = None) -> int:
        """Account a created object (call ``check_object`` first) of ``tenant`` (None: its job
        is a tenant of its own); returns the bytes it drew from its round's reservation."""
        if owner is None:
            self.unattributed += size
            return 0
        memory = self._job(owner.job, tenant or owner.job)
        if isinstance(owner, Pinned):
            memory.pinned += size
            self.tenants[memory.tenant].pinned += size
            return 0
        memory.working += size
        r = memory.rounds.get(owner.round)
        drawn = min(size, r.reserved) if r else 0
        if r:
            r.reserved -= drawn
        self._settle(owner.job)
        return drawn

    def remove_object(self, owner: Owner, size: int, refund: int = 0) -> None:
        """An object was freed; ``refund`` bytes go back to its round's reservation if the round
        is still open here (a crashed task's accumulator: its re-run allocates it again)."""
        self._take_out(owner, size)
        r = self._round(owner)
        if r is not None:
            r.reserved += refund
        if owner is not None:
            self._settle(owner.job)

    def pin(self, owner: RoundOf, size: int) -> Pinned:
        """A round's result became the job's model: out of its rounds' memory, pinned (still its
        tenant's); returns the object's new owner."""
        memory = self.jobs[owner.job]
        memory.working -= size
        memory.pinned += size
        self.tenants[memory.tenant].pinned += size
        self._settle(owner.job)
        return Pinned(owner.job)

    def retain(self, owner: Owner, size: int, tenant: str) -> None:
        """Only retention holds the object now: out of its job's memory (or the objects of no
        job), into the tenant's retained bytes, which admission evicts first."""
        self._take_out(owner, size)
        if owner is not None:
            self._settle(owner.job)
        self.tenants.setdefault(tenant, TenantMemory()).retained += size

    def remove_retained(self, size: int, tenant: str) -> None:
        self.tenants[tenant].retained -= size
        self._settle_tenant(tenant)

    # -- helpers ----------------------------------------------------------------------------
    def _job(self, job: str, tenant: str) -> JobMemory:
        memory = self.jobs.get(job)
        if memory is None:
            memory = self.jobs[job] = JobMemory(tenant)
            self.tenants.setdefault(tenant, TenantMemory())
        return memory

    def _take_out(self, owner: Owner, size: int) -> None:
        if owner is None:
            self.unattributed -= size
            return
        memory = self.jobs[owner.job]
        if isinstance(owner, Pinned):
            memory.pinned -= size
            self.tenants[memory.tenant].pinned -= size
        else:
            memory.working -= size

    def _round(self, owner: Owner) -> RoundReservation | None:
        if not isinstance(owner, RoundOf):
            return None
        memory = self.jobs.get(owner.job)
        return memory.rounds.get(owner.round) if memory else None

    def _in_rounds(self, t: TenantMemory) -> int:
        return sum(self.jobs[j].held for j in t.in_rounds)

    def _over_others(self, tenant: str, now: float) -> str:
        """Why memory is short, when other tenants hold more than their shares."""
        over = {t: n for t, n in self.over_share(now).items() if t != tenant}
        return (f"; tenants over their fair shares: {', '.join(f'{t!r} by {n} bytes' for t, n in sorted(over.items()))}"
                f" (their rounds are refused until they are under, their idle models spill)") if over else ""

    @staticmethod
    def _release_older_rounds(memory: JobMemory, before: int) -> int:
        """Once a later round admits, no earlier one allocates again (it installed or was abandoned)."""
        return sum(memory.rounds.pop(r).reserved for r in [r for r in memory.rounds if r < before])

    def _refused(self, job: str, tenant: str, now: float) -> None:
        self.wanting[job] = (tenant, now)
        self._settle(job)

    def _settle(self, job: str) -> None:
        """Keep the indexes true after a change to ``job``'s memory: its tenant's jobs with
        rounds here, and no record of a job or tenant that holds nothing."""
        memory = self.jobs.get(job)
        if memory is None:
            return
        t = self.tenants[memory.tenant]
        if memory.in_rounds:
            t.in_rounds.add(job)
            return
        t.in_rounds.discard(job)
        memory.rounds.clear()
        if memory.pinned == 0:
            del self.jobs[job]
        self._settle_tenant(memory.tenant)

    def _settle_tenant(self, tenant: str) -> None:
        t = self.tenants.get(tenant)
        if t is not None and not (t.pinned or t.retained or t.in_rounds):
            del self.tenants[tenant]
