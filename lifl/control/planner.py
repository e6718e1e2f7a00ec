"""The control plane's pure planner (LIFL §5): no I/O, clocks, randomness or globals.

- ``estimate`` turns an agent's cumulative counters into the node's arrival rate k, mean
  aggregation time E and an EWMA-smoothed queue Q = k × E (§5.1, §5.2).
- ``size_hierarchy`` plans a node's two-level k-ary tree (§5.2): leaves each fold up to I
  client updates, one middle aggregator folds the leaves, and the top folds the nodes'
  middles and installs the new global model; ``warm_instances`` counts what to keep warm,
  with or without reusing instances across roles (§5.3).
- ``place`` / ``quotas`` map client updates to nodes by bin packing on residual capacity
  (§5.1: BestFit, FirstFit, WorstFit) or by Knative's least-connection baseline.
- ``plan_round`` / ``plan_warm`` combine these into a round's cluster plan and the periodic
  re-plan of warm instances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol
from itertools import groupby

DEFAULT_ALPHA = 0.7
"""The paper's EWMA coefficient (§5.2): weight of the previous queue estimate."""

TOLERANCE = 1e-9
"""Float noise: a queue at most this is empty, a demand at most this above a residual still fits."""

BESTFIT, FIRSTFIT, WORSTFIT, LEAST_CONNECTION = "bestfit", "firstfit", "worstfit", "least_connection"
POLICIES = (BESTFIT, FIRSTFIT, WORSTFIT, LEAST_CONNECTION)


class WarmInstance(Protocol):
    """What placement needs to know about a warm instance."""

    @property
    def id(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def idle(self) -> bool: ...

    @property
    def last_used(self) -> float: ...


@dataclass(frozen=True)
class InstanceView:
    """A warm instance as a plain record."""

    id: int
    tenant: str
    idle: bool
    last_used: float


def pick_warm(instances: Iterable[WarmInstance], tenant: str, exclude: frozenset[int] = frozenset()) -> int | None:
    """The idle instance of ``tenant`` used most recently (its caches are warmest), if any."""
    best: WarmInstance | None = None
    for inst in instances:
        if inst.idle and inst.tenant == tenant and inst.id not in exclude:
            if best is None or inst.last_used > best.last_used:
                best = inst
    return best.id if best else None


def expired(instances: Iterable[WarmInstance], now: float, keep_warm: float) -> list[int]:
    """Idle instances past their keep-warm period, to be terminated (scale to zero)."""
    return [i.id for i in instances if i.idle and now - i.last_used >= keep_warm]


# --- Estimating each node's queue (§5.1, §5.2) ---------------------------------------------


@dataclass(frozen=True)
class Counters:
    """A node agent's cumulative counters; the planner differences successive snapshots."""

    time: float  # seconds, on whatever monotonic-ish clock the caller uses
    arrivals: int  # client updates accepted by the node so far
    aggregated: int  # client updates whose aggregation finished so far
    agg_seconds: float  # total seconds spent aggregating those


@dataclass(frozen=True)
class Estimate:
    """A node's load over the last interval and its smoothed queue."""

    k: float  # arrival rate k_i,t (updates/s)
    e: float  # mean aggregation time per update E_i,t (s); kept from before when nothing was aggregated
    q: float  # EWMA-smoothed queue Q_i,t
    last: Counters  # the snapshot the next interval starts from


def estimate(previous: Estimate | None, now: Counters, alpha: float = DEFAULT_ALPHA) -> Estimate:
    """Fold the snapshot ``now`` into ``previous``: Q_t = alpha × Q_{t-1} + (1 − alpha) × k_t × E_t.

    Smoothing keeps short spikes from scaling the hierarchy up (§5.2). The first snapshot has
    no interval, so no rate: k = 0 and Q = 0. A snapshot that is not later than the last one
    changes nothing. Counters that went backwards mean the node restarted: that interval counts
    as idle (k = 0) and the new counters become the baseline.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"EWMA alpha must be in [0, 1), got {alpha}")
    if previous is None:
        return Estimate(k=0.0, e=now.agg_seconds / now.aggregated if now.aggregated > 0 else 0.0, q=0.0, last=now)
    last = previous.last
    reset = now.arrivals < last.arrivals or now.aggregated < last.aggregated or now.agg_seconds < last.agg_seconds
    dt = now.time - last.time
    if dt <= 0:
        return replace(previous, last=now) if reset else previous
    if reset:
        k, e = 0.0, previous.e
    else:
        k = (now.arrivals - last.arrivals) / dt
        done = now.aggregated - last.aggregated
        e = (now.agg_seconds - last.agg_seconds) / done if done > 0 else previous.e
    return Estimate(k=k, e=e, q=alpha * previous.q + (1.0 - alpha) * k * e, last=now)


# --- Sizing each node's hierarchy (§5.2, §5.3) ---------------------------------------------


@dataclass(frozen=True)
class NodeHierarchy:
    """One node's share of a job's aggregation tree."""

    node: str
    leaves: int  # ceil(Q / I) leaf aggregators of fan-in I
    middles: int  # 1 when the node has any leaves, else 0 (per tensor shard)
    top: bool  # this node hosts the job's top aggregator (one per tensor shard)
    lanes: int = 1  # tensor shards (lifl.shards): each has a tree of its own, the same size


def size_hierarchy(node: str, queue: float, fan_in: int, *, top: bool = False, lanes: int = 1) -> NodeHierarchy:
    """The tree for ``queue`` pending updates: as many leaves as keep each at fan-in ``fan_in``,
    in each of ``lanes`` tensor shards.

    A small fan-in maximises parallelism (§5.2). Float noise (within ``TOLERANCE``) neither
    creates a leaf from an empty queue nor adds one for a queue just above a multiple of I.
    """
    if lanes < 1:
        raise ValueError(f"a job has at least one lane, got {lanes}")
    if fan_in < 1:
        raise ValueError(f"leaf fan-in must be >= 1, got {fan_in}")
    if not math.isfinite(queue):
        raise ValueError(f"queue must be finite, got {queue}")
    leaves = 0 if queue <= TOLERANCE else max(1, math.ceil(queue / fan_in - TOLERANCE))
    return NodeHierarchy(node=node, leaves=lanes * leaves, middles=lanes if leaves else 0, top=top, lanes=lanes)


def warm_instances(h: NodeHierarchy, *, reuse: bool) -> int:
    """Aggregator instances to keep warm on the node for ``h``.

    With reuse (§5.3) an idle leaf becomes the middle and the first middle done becomes the
    top, so the leaves suffice (one instance when the node only hosts the top); without it
    every role needs its own instance.
    """
    if reuse:
        return max(h.leaves, h.lanes) if h.leaves > 0 or h.top else 0
    return h.leaves + h.middles + (h.lanes if h.top else 0)


# --- Placing client updates on nodes (§5.1) ------------------------------------------------


@dataclass(frozen=True)
class NodeLoad:
    """What placement needs to know about a worker node."""

    node: str
    capacity: float  # MC_i: updates the node can aggregate at once (measured offline, appendix E)
    queue: float  # k_i × E_i: load the node already carries

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity) and math.isfinite(self.queue)):
            raise ValueError(f"node {self.node!r}: capacity and queue must be finite, "
                             f"got {self.capacity}, {self.queue}")

    @property
    def residual(self) -> float:
        """RC_i = MC_i − k_i × E_i: the capacity left for new updates."""
        return self.capacity - self.queue


_Segment = tuple[tuple[int, ...], int]
"""Node indices in placement order, repeated a number of times: placements emitted in bulk."""
_Named = tuple[tuple[str, ...], int]
"""A segment with node names, ready to expand."""


def place(demands: Sequence[float], nodes: Sequence[NodeLoad], policy: str) -> list[str]:
    """The node each demand goes to, in order, placing them one after another.

    BESTFIT: the node with the smallest residual that fits the demand (concentrates load on
    the fewest nodes, the paper's choice); FIRSTFIT: the first node that fits; WORSTFIT: the
    node with the largest residual (spreads load); LEAST_CONNECTION (Knative's baseline):
    ignores capacity, the node with the smallest load = queue + demands placed on it so far.
    Ties go to the earlier node in ``nodes``. A demand fits when it exceeds the residual by at
    most ``TOLERANCE``. A demand that fits nowhere is still placed, on the node with the
    largest residual (overflow): updates are never refused here, admission control is not
    the planner's job.

    Runs of equal demands are placed in bulk, with the result of placing them one by one:
    under BestFit and FirstFit a run stays on its node while it fits; under WorstFit and
    least-connection it water-fills the nodes' loads (see ``_water_fill``). The results are
    identical whenever the float arithmetic is exact (integer or binary-fraction sizes, loads
    and capacities); otherwise rounding may tip an exact tie or a fit decided within 1e-15.
    """
    out: list[str] = []
    for names, times in _placements(_runs(demands), nodes, policy):
        out += names * times
    return out


def quotas(count: int, nodes: Sequence[NodeLoad], policy: str) -> dict[str, int]:
    """How many of ``count`` unit updates ``place`` would put on each node: the nodes used, in first-use order.

    Its cost does not grow with ``count``: the per-update list is never built.
    """
    if count < 0:
        raise ValueError(f"update count must be >= 0, got {count}")
    counts: dict[str, int] = {}
    for names, times in _placements([(1.0, count)], nodes, policy):
        for name in names:
            counts[name] = counts.get(name, 0) + times
    return counts


def _runs(demands: Iterable[float]) -> Iterator[tuple[float, int]]:
    """(size, length) of each run of equal consecutive demands."""
    for size, run in groupby(demands):
        if not (math.isfinite(size) and size >= 0):
            raise ValueError(f"demands must be finite and >= 0, got {size}")
        yield float(size), len(list(run))


def _placements(runs: Iterable[tuple[float, int]], nodes: Sequence[NodeLoad], policy: str) -> list[_Named]:
    """The placements of ``runs`` of (size, length) under ``policy``, in order."""
    if not nodes:
        raise ValueError("placement needs at least one node")
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; expected one of {', '.join(POLICIES)}")
    names = [n.node for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must be unique, got {names}")
    # Least-connection tracks each node's load; the bin-packing policies its excess = −residual
    # (exact in floats), so the largest residual (WorstFit, overflow) is the smallest excess.
    state = [n.queue for n in nodes] if policy == LEAST_CONNECTION else [-n.residual for n in nodes]
    packing = policy in (BESTFIT, FIRSTFIT)
    indices = range(len(state))
    singles = [(name,) for name in names]
    segments: list[_Named] = []
    for size, length in runs:
        if length > len(state):
            bulk = _pack(state, size, length, policy) if packing else _water_fill(state, size, length)
            segments += [(tuple(names[i] for i in run), times) for run, times in bulk]
            continue
        for _ in range(length):  # a short run: one by one is cheaper, by the policies' definition
            fitting = [i for i in indices if size <= TOLERANCE - state[i]] if packing else []
            if not fitting:
                chosen = min(indices, key=state.__getitem__)
            elif policy == BESTFIT:
                chosen = max(fitting, key=state.__getitem__)
            else:
                chosen = fitting[0]
            state[chosen] += size
            segments.append((singles[chosen], 1))
    return segments


def _pack(excess: list[float], size: float, count: int, policy: str) -> list[_Segment]:
    """Place a run of ``count`` demands of ``size`` by BestFit or FirstFit, updating ``excess``.

    The chosen node keeps the run while it still fits: under BestFit its residual minus
    ``size`` is still the smallest that fits, under FirstFit the nodes before it still do not.
    Once the run fits nowhere it never will again (residuals only shrink), so the rest
    overflows onto the largest residuals, which is WorstFit.
    """
    segments: list[_Segment] = []
    while count:
        fitting = [i for i, x in enumerate(excess) if size <= TOLERANCE - x]
        if not fitting:
            return segments + _water_fill(excess, size, count)
        chosen = max(fitting, key=excess.__getitem__) if policy == BESTFIT else fitting[0]
        take = count if size == 0 else min(count, _fitting_count(excess[chosen], size))
        excess[chosen] += take * size
        segments.append(((chosen,), take))
        count -= take
    return segments


def _fitting_count(excess: float, size: float) -> int:
    """How many demands of ``size`` > 0 fit one after another on a node with ``excess``.

    At least 1, as the caller found one fits; should rounding undercount, ``_pack`` simply
    comes back to the same node.
    """
    return max(1, math.floor((TOLERANCE - excess) / size))


def _water_fill(keys: list[float], size: float, count: int) -> list[_Segment]:
    """Place ``count`` demands of ``size``, each on the node with the smallest key (ties: lowest index).

    Each placement adds ``size`` to the node's key, which ``keys`` holds afterwards. Node a's
    m-th slot has value keys[a] + m × size and the greedy takes slots in (value, index) order,
    a merge of the nodes' slot sequences. Between consecutive starting keys the set of nodes
    taking part is fixed and their slots repeat with period ``size`` in one cyclic order, so
    each such stage is whole cycles plus a partial one: O(nodes² log nodes) per run, not per demand.
    """
    if size == 0:
        return [((min(range(len(keys)), key=keys.__getitem__),), count)]
    start = keys[:]
    order = sorted(range(len(start)), key=start.__getitem__)  # stable: ties by index
    used = [0] * len(start)
    segments: list[_Segment] = []
    for stage in range(1, len(order) + 1):
        if not count:
            break
        active = order[:stage]
        cycle = tuple(sorted(active, key=lambda a: (start[a] + used[a] * size, a)))
        if stage < len(order):
            ceiling = start[order[stage]]
            # each active node's slots below the next starting key: whole cycles, then a partial one
            slots = {a: math.ceil((ceiling - start[a]) / size) - used[a] for a in active}
            total = sum(slots.values())
            if total <= count:
                full = min(slots.values())
                segments.append((cycle, full))
                segments += [(tuple(a for a in cycle if slots[a] - full > extra), 1)
                             for extra in range(max(slots.values()) - full)]
                for a in active:
                    used[a] += slots[a]
                count -= total
                continue
        full, part = divmod(count, stage)
        segments += [(cycle, full), (cycle[:part], 1)]
        for position, a in enumerate(cycle):
            used[a] += full + (position < part)
        count = 0
    for a, n in enumerate(used):
        keys[a] = start[a] + n * size
    return [(indices, times) for indices, times in segments if indices and times]


# --- The cluster plan -----------------------------------------------------------------------


def choose_top(counts: Mapping[str, int], preferred: str | None = None) -> str | None:
    """The node to host the round's top aggregator, given each node's update count.

    ``preferred`` (e.g. where the model lives) when it has updates, else the node with the
    most updates, so the fewest intermediate updates cross nodes; ties go to the smallest
    name, for a deterministic choice. None when no node has an update.
    """
    if preferred is not None and counts.get(preferred, 0) > 0:
        return preferred
    busy = [(-c, node) for node, c in counts.items() if c > 0]
    return min(busy)[1] if busy else None


@dataclass(frozen=True)
class ClusterPlan:
    """A round's plan across the cluster."""

    policy: str
    quotas: dict[str, int]  # expected updates per node (placement result)
    top: str | None  # planned top node: the largest quota (ties: first in quota order)
    hierarchies: dict[str, NodeHierarchy]  # per node that has work
    warm: dict[str, int]  # instances to keep warm per node


def plan_round(expected_updates: int, nodes: Sequence[NodeLoad], *, policy: str, fan_in: int,
               reuse: bool) -> ClusterPlan:
    """Place the round's updates, then size each used node's tree from its quota.

    As in the paper's evaluation, the estimated queue is taken to equal the node's quota.
    """
    if fan_in < 1:
        raise ValueError(f"leaf fan-in must be >= 1, got {fan_in}")
    per_node = quotas(expected_updates, nodes, policy)
    top = max(per_node, key=per_node.__getitem__) if per_node else None
    hierarchies = {node: size_hierarchy(node, q, fan_in, top=node == top) for node, q in per_node.items()}
    warm = {node: warm_instances(h, reuse=reuse) for node, h in hierarchies.items()}
    return ClusterPlan(policy=policy, quotas=per_node, top=top, hierarchies=hierarchies, warm=warm)


def plan_warm(queues: Mapping[str, float], *, fan_in: int, reuse: bool, top: str | None = None,
              lanes: int = 1) -> dict[str, int]:
    """The periodic re-plan (§5.2): instances to keep warm per node from its smoothed queue
    (``lanes``: the job's tensor shards, each a tree of its own).

    Nodes needing none are left out. ``top`` needs an instance even without a queue estimate.
    """
    loads = dict(queues)
    if top is not None:
        loads.setdefault(top, 0.0)
    hierarchies = [size_hierarchy(node, q, fan_in, top=node == top, lanes=lanes) for node, q in loads.items()]
    return {h.node: n for h in hierarchies if (n := warm_instances(h, reuse=reuse))}
