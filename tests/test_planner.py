"""The control-plane planner: pure functions, table-driven."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest

from lifl.control.planner import (
    BESTFIT,
    DEFAULT_ALPHA,
    FIRSTFIT,
    LEAST_CONNECTION,
    POLICIES,
    TOLERANCE,
    WORSTFIT,
    Counters,
    Estimate,
    InstanceView,
    NodeHierarchy,
    NodeLoad,
    choose_top,
    estimate,
    expired,
    pick_warm,
    place,
    plan_round,
    plan_warm,
    quotas,
    size_hierarchy,
    warm_instances,
)


I = InstanceView
POOL = [I(1, "a", True, 10.0), I(2, "a", True, 30.0), I(3, "a", False, 50.0), I(4, "b", True, 40.0)]


@pytest.mark.parametrize("tenant,exclude,chosen", [
    ("a", frozenset(), 2),  # the most recently used idle instance of the tenant
    ("a", frozenset({2}), 1),
    ("b", frozenset(), 4),
    ("c", frozenset(), None),  # never another tenant's instance
    ("a", frozenset({1, 2}), None),  # busy instances are not taken
])
def test_pick_warm(tenant: str, exclude: frozenset[int], chosen: int | None) -> None:
    assert pick_warm(POOL, tenant, exclude) == chosen


@pytest.mark.parametrize("now,keep_warm,gone", [(35.0, 10.0, [1]), (45.0, 10.0, [1, 2]), (100.0, 100.0, []), (60.0, 0.0, [1, 2, 4])])
def test_expired_idle_instances(now: float, keep_warm: float, gone: list[int]) -> None:
    assert expired(POOL, now, keep_warm) == gone


# --- estimate: EWMA of k × E from cumulative counters ----------------------------------------

C = Counters


@pytest.mark.parametrize("alpha,snapshots,expected", [
    # (k, e, q, index of the snapshot held as `last`) after each snapshot
    (0.7, [C(0, 0, 0, 0.0)], [(0, 0, 0, 0)]),
    # first sample: no interval, so no rate and no queue, but E from the totals
    (0.7, [C(100.0, 50, 40, 8.0), C(110.0, 70, 60, 12.0)], [(0, 0.2, 0, 0), (2, 0.2, 0.12, 1)]),
    # Q_t = 0.7 Q_{t-1} + 0.3 k E; an idle interval keeps E and decays Q
    (0.7, [C(0, 0, 0, 0.0), C(10, 20, 10, 5.0), C(20, 60, 30, 15.0), C(30, 60, 30, 15.0), C(40, 80, 50, 35.0)],
     [(0, 0, 0, 0), (2, 0.5, 0.3, 1), (4, 0.5, 0.81, 2), (0, 0.5, 0.567, 3), (2, 1.0, 0.9969, 4)]),
    (0.5, [C(0, 0, 0, 0.0), C(2, 10, 5, 1.0), C(4, 30, 15, 3.0)], [(0, 0, 0, 0), (5, 0.2, 0.5, 1), (10, 0.2, 1.25, 2)]),
    # alpha 0: no smoothing, Q is the last interval's k E
    (0.0, [C(0, 0, 0, 0.0), C(4, 8, 8, 2.0), C(8, 8, 8, 2.0)], [(0, 0, 0, 0), (2, 0.25, 0.5, 1), (0, 0.25, 0, 2)]),
    # alpha 0.9 damps a spike
    (0.9, [C(0, 0, 0, 0.0), C(1, 100, 100, 10.0), C(2, 100, 100, 10.0)], [(0, 0, 0, 0), (100, 0.1, 1.0, 1), (0, 0.1, 0.9, 2)]),
    # nothing aggregated yet: E stays 0 until something is
    (0.7, [C(0, 0, 0, 0.0), C(10, 5, 0, 0.0), C(20, 5, 5, 1.0)], [(0, 0, 0, 0), (0.5, 0, 0, 1), (0, 0.2, 0, 2)]),
    # counters went backwards (node restarted): an idle interval, then rates from the new baseline
    (0.7, [C(0, 0, 0, 0.0), C(10, 20, 10, 5.0), C(20, 3, 1, 0.4), C(30, 13, 11, 5.4)],
     [(0, 0, 0, 0), (2, 0.5, 0.3, 1), (0, 0.5, 0.21, 2), (1, 0.5, 0.297, 3)]),
    # a snapshot not later than the last changes nothing (not even the baseline)
    (0.7, [C(0, 0, 0, 0.0), C(10, 20, 10, 5.0), C(10, 25, 12, 6.0), C(20, 40, 30, 15.0)],
     [(0, 0, 0, 0), (2, 0.5, 0.3, 1), (2, 0.5, 0.3, 1), (2, 0.5, 0.51, 3)]),
    (0.7, [C(0, 0, 0, 0.0), C(10, 20, 10, 5.0), C(9, 25, 12, 6.0)], [(0, 0, 0, 0), (2, 0.5, 0.3, 1), (2, 0.5, 0.3, 1)]),
    # ... unless the counters went backwards too: then they become the baseline
    (0.7, [C(0, 0, 0, 0.0), C(10, 20, 10, 5.0), C(5, 2, 1, 0.5), C(15, 12, 11, 5.5)],
     [(0, 0, 0, 0), (2, 0.5, 0.3, 1), (2, 0.5, 0.3, 2), (1, 0.5, 0.36, 3)]),
])
def test_estimate(alpha: float, snapshots: list[Counters], expected: list[tuple[float, float, float, int]]) -> None:
    est: Estimate | None = None
    for now, (k, e, q, last) in zip(snapshots, expected, strict=True):
        est = estimate(est, now, alpha)
        assert (est.k, est.e, est.q) == pytest.approx((k, e, q))
        assert est.last == snapshots[last]


def test_estimate_default_alpha_is_the_papers() -> None:
    first = estimate(None, C(0, 0, 0, 0.0))
    assert DEFAULT_ALPHA == 0.7
    assert estimate(first, C(10, 20, 10, 5.0)).q == pytest.approx(0.3)


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5, math.nan])
@pytest.mark.parametrize("first", [True, False])
def test_estimate_rejects_bad_alpha(alpha: float, first: bool) -> None:
    previous = None if first else estimate(None, C(0, 0, 0, 0.0))
    with pytest.raises(ValueError, match="alpha"):
        estimate(previous, C(1, 1, 1, 0.1), alpha)


# --- hierarchy sizing and warm instances -----------------------------------------------------


@pytest.mark.parametrize("queue,fan_in,top,leaves,middles,warm_reuse,warm_no_reuse", [
    (0, 2, False, 0, 0, 0, 0),
    (0, 2, True, 0, 0, 1, 1),  # a node hosting only the top still needs it
    (-1e-12, 2, False, 0, 0, 0, 0),  # float noise makes no leaf
    (1e-10, 1, False, 0, 0, 0, 0),
    (1e-12, 3, True, 0, 0, 1, 1),
    (0.3, 2, False, 1, 1, 1, 2),
    (1, 1, False, 1, 1, 1, 2),
    (1, 2, False, 1, 1, 1, 2),
    (2, 2, False, 1, 1, 1, 2),
    (2.5, 2, False, 2, 1, 2, 3),
    (5, 2, True, 3, 1, 3, 5),
    (6, 3, False, 2, 1, 2, 3),
    (6 + 1e-12, 3, False, 2, 1, 2, 3),  # float noise above a multiple of I adds no leaf
    (7, 3, True, 3, 1, 3, 5),
    (4, 1, False, 4, 1, 4, 5),
    (3.7, 1, True, 4, 1, 4, 6),
    (20, 2, True, 10, 1, 10, 12),
    (1e-6, 50, False, 1, 1, 1, 2),  # any real queue gets a leaf
])
def test_size_hierarchy_and_warm_instances(queue: float, fan_in: int, top: bool, leaves: int, middles: int,
                                           warm_reuse: int, warm_no_reuse: int) -> None:
    h = size_hierarchy("n1", queue, fan_in, top=top)
    assert h == NodeHierarchy("n1", leaves, middles, top)
    assert warm_instances(h, reuse=True) == warm_reuse
    assert warm_instances(h, reuse=False) == warm_no_reuse


@pytest.mark.parametrize("queue,fan_in", [(4, 0), (4, -1), (math.nan, 2), (math.inf, 2)])
def test_size_hierarchy_rejects(queue: float, fan_in: int) -> None:
    with pytest.raises(ValueError):
        size_hierarchy("n1", queue, fan_in)


@pytest.mark.parametrize("queue, fan_in, top, lanes, leaves, middles, warm_reuse, warm_no_reuse", [
    (5, 2, False, 3, 9, 3, 9, 12),  # each tensor shard has the tree of the whole model
    (5, 2, True, 3, 9, 3, 9, 15),  # ... and a top of its own
    (0, 2, True, 4, 0, 0, 4, 4),  # a node hosting only the tops runs them side by side
    (0, 2, False, 4, 0, 0, 0, 0),
    (1, 1, False, 1, 1, 1, 1, 2),
])
def test_tensor_shards_size_a_tree_per_shard(queue: float, fan_in: int, top: bool, lanes: int, leaves: int, middles: int,
                                             warm_reuse: int, warm_no_reuse: int) -> None:
    h = size_hierarchy("n1", queue, fan_in, top=top, lanes=lanes)
    assert (h.leaves, h.middles, h.lanes) == (leaves, middles, lanes)
    assert warm_instances(h, reuse=True) == warm_reuse
    assert warm_instances(h, reuse=False) == warm_no_reuse
    assert plan_warm({"n1": queue}, fan_in=fan_in, reuse=True, top="n1" if top else None, lanes=lanes) == (
        {"n1": warm_reuse} if warm_reuse else {})
    with pytest.raises(ValueError):
        size_hierarchy("n1", queue, fan_in, lanes=0)


# --- placement -------------------------------------------------------------------------------


def reference_place(demands: list[float], nodes: list[NodeLoad], policy: str) -> list[str]:
    """The policies' definition, one demand at a time."""
    residual = [n.residual for n in nodes]
    load = [n.queue for n in nodes]
    everyone = range(len(nodes))
    out = []
    for d in demands:
        fitting = [i for i in everyone if d <= residual[i] + TOLERANCE]
        if policy == LEAST_CONNECTION:
            chosen = min(everyone, key=lambda i: load[i])
        elif policy == BESTFIT and fitting:
            chosen = min(fitting, key=lambda i: residual[i])
        elif policy == FIRSTFIT and fitting:
            chosen = fitting[0]
        else:  # WorstFit, and overflow
            chosen = max(everyone, key=lambda i: residual[i])
        residual[chosen] -= d
        load[chosen] += d
        out.append(nodes[chosen].node)
    return out


def in_order_counts(names: list[str]) -> list[tuple[str, int]]:
    return list(Counter(names).items())  # Counter keeps first-seen order


PAPER = [NodeLoad(f"n{i}", 20.0, 0.0) for i in range(1, 6)]


@pytest.mark.parametrize("policy,updates,expected", [
    (BESTFIT, 20, {"n1": 20}),
    (BESTFIT, 60, {"n1": 20, "n2": 20, "n3": 20}),
    (BESTFIT, 100, {f"n{i}": 20 for i in range(1, 6)}),
    (FIRSTFIT, 20, {"n1": 20}),
    (FIRSTFIT, 60, {"n1": 20, "n2": 20, "n3": 20}),
    (FIRSTFIT, 100, {f"n{i}": 20 for i in range(1, 6)}),
    (WORSTFIT, 20, {f"n{i}": 4 for i in range(1, 6)}),
    (WORSTFIT, 60, {f"n{i}": 12 for i in range(1, 6)}),
    (WORSTFIT, 100, {f"n{i}": 20 for i in range(1, 6)}),
    (LEAST_CONNECTION, 20, {f"n{i}": 4 for i in range(1, 6)}),
    (LEAST_CONNECTION, 60, {f"n{i}": 12 for i in range(1, 6)}),
    (LEAST_CONNECTION, 100, {f"n{i}": 20 for i in range(1, 6)}),
])
def test_paper_setting(policy: str, updates: int, expected: dict[str, int]) -> None:
    """§6: 5 nodes of capacity 20; BestFit/FirstFit use 1, 3, 5 nodes, WorstFit and least-connection all 5."""
    assert quotas(updates, PAPER, policy) == expected
    assert Counter(place([1.0] * updates, PAPER, policy)) == expected


def test_spreading_policies_round_robin_on_equal_nodes() -> None:
    assert place([1.0] * 7, PAPER, WORSTFIT) == ["n1", "n2", "n3", "n4", "n5", "n1", "n2"]
    assert place([1.0] * 7, PAPER, LEAST_CONNECTION) == ["n1", "n2", "n3", "n4", "n5", "n1", "n2"]
    assert place([1.0] * 7, PAPER, BESTFIT) == ["n1"] * 7


N = NodeLoad
# residuals 10, 5, 3: the first node that fits is not the tightest
LOOSE_FIRST = [N("a", 10, 0), N("c", 10, 5), N("b", 10, 7)]
# a small empty node and a big busy one: capacity and load disagree
SMALL_IDLE = [N("x", 4, 0), N("y", 20, 2)]


@pytest.mark.parametrize("nodes,demands,policy,expected", [
    (LOOSE_FIRST, [3, 2, 4, 1], BESTFIT, ["b", "c", "a", "c"]),
    (LOOSE_FIRST, [3, 2, 4, 1], FIRSTFIT, ["a", "a", "a", "a"]),
    (LOOSE_FIRST, [3, 2, 4, 1], WORSTFIT, ["a", "a", "a", "c"]),  # a and c tie at 5: a comes first
    (LOOSE_FIRST, [3, 2, 4, 1], LEAST_CONNECTION, ["a", "a", "a", "c"]),
    (SMALL_IDLE, [1] * 4, BESTFIT, ["x"] * 4),
    (SMALL_IDLE, [1] * 4, FIRSTFIT, ["x"] * 4),
    (SMALL_IDLE, [1] * 4, WORSTFIT, ["y"] * 4),
    (SMALL_IDLE, [1] * 4, LEAST_CONNECTION, ["x", "x", "x", "y"]),  # ignores capacity
    (SMALL_IDLE, [5, 1], BESTFIT, ["y", "x"]),  # 5 fits only y; then x is tightest
    (SMALL_IDLE, [5, 1], FIRSTFIT, ["y", "x"]),
    # ties go to the earlier node
    ([N("a", 5, 0), N("b", 5, 0), N("c", 5, 0)], [1], BESTFIT, ["a"]),
    ([N("a", 5, 0), N("b", 5, 0), N("c", 5, 0)], [1, 1], WORSTFIT, ["a", "b"]),
    ([N("a", 5, 0), N("b", 6, 1), N("c", 5, 0)], [1, 1, 1], BESTFIT, ["a", "a", "a"]),
    ([N("b", 6, 2), N("a", 5, 1)], [1, 1, 1, 1], WORSTFIT, ["b", "a", "b", "a"]),
    ([N("b", 6, 1), N("a", 5, 0)], [1, 1, 1], LEAST_CONNECTION, ["a", "b", "a"]),
])
def test_policies(nodes: list[NodeLoad], demands: list[float], policy: str, expected: list[str]) -> None:
    assert place(demands, nodes, policy) == expected == reference_place(demands, nodes, policy)


@pytest.mark.parametrize("nodes,demands,policy,expected", [
    # full: the rest overflows onto the largest residual, spreading like WorstFit
    ([N("a", 2, 0), N("b", 3, 0)], [1] * 7, BESTFIT, ["a", "a", "b", "b", "b", "a", "b"]),
    ([N("a", 2, 0), N("b", 3, 0)], [1] * 7, FIRSTFIT, ["a", "a", "b", "b", "b", "a", "b"]),
    ([N("a", 2, 0), N("b", 3, 0)], [1] * 7, WORSTFIT, ["b", "a", "b", "a", "b", "a", "b"]),
    ([N("a", 2, 0), N("b", 3, 0)], [1] * 12, BESTFIT, ["a"] * 2 + ["b"] * 3 + ["a", "b"] * 3 + ["a"]),
    # a demand larger than every residual goes to the largest one
    ([N("a", 5, 0), N("b", 8, 1)], [10], BESTFIT, ["b"]),
    ([N("a", 5, 0), N("b", 8, 1)], [10], FIRSTFIT, ["b"]),
    ([N("a", 5, 0), N("b", 8, 1)], [10], WORSTFIT, ["b"]),
    # overflowing one demand does not stop later ones from fitting
    ([N("a", 4, 0), N("b", 2, 0)], [5, 1, 1], BESTFIT, ["a", "b", "b"]),
    ([N("a", 4, 0), N("b", 2, 0)], [5, 1, 1, 1], FIRSTFIT, ["a", "b", "b", "b"]),
    # overloaded nodes (negative residuals)
    ([N("a", 1, 3), N("b", 1, 2)], [1, 1, 1], BESTFIT, ["b", "a", "b"]),
    # zero demands fit wherever the residual is not negative
    ([N("a", 1, 2), N("b", 3, 3), N("c", 5, 0)], [0, 0], BESTFIT, ["b", "b"]),
    ([N("a", 1, 2), N("b", 3, 3), N("c", 5, 0)], [0, 0], WORSTFIT, ["c", "c"]),
    ([N("a", 1, 2), N("b", 3, 3), N("c", 5, 0)], [0] * 9, LEAST_CONNECTION, ["c"] * 9),
])
def test_overflow_and_edges(nodes: list[NodeLoad], demands: list[float], policy: str, expected: list[str]) -> None:
    assert place(demands, nodes, policy) == expected == reference_place(demands, nodes, policy)


@pytest.mark.parametrize("policy", [BESTFIT, FIRSTFIT])
def test_float_noise_does_not_overflow(policy: str) -> None:
    """20 × 0.1 fits in 2.0 although 2.0 − 0.1 − ... − 0.1 (19 times) < 0.1 in floats."""
    nodes = [N("a", 2.0, 0.0), N("b", 5.0, 0.0)]
    assert place([0.1] * 21, nodes, policy) == ["a"] * 20 + ["b"] == reference_place([0.1] * 21, nodes, policy)
    ewma_noise = [N("a", 20.0, 3.0000000000000004), N("b", 20.0, 0.0)]
    assert quotas(20, ewma_noise, policy) == {"a": 17, "b": 3}


def test_quotas_in_first_use_order() -> None:
    nodes = [N("a", 10, 0), N("b", 3, 0), N("c", 20, 20)]
    assert list(quotas(13, nodes, BESTFIT).items()) == [("b", 3), ("a", 10)]
    assert list(quotas(14, nodes, BESTFIT).items()) == [("b", 3), ("a", 11)]  # overflow: a, b, c tie at 0
    assert list(quotas(4, nodes, WORSTFIT).items()) == [("a", 4)]
    assert list(quotas(9, nodes, WORSTFIT).items()) == [("a", 8), ("b", 1)]
    assert quotas(0, nodes, BESTFIT) == {}
    assert place([], nodes, BESTFIT) == []


@pytest.mark.parametrize("call,match", [
    (lambda: place([1], [], BESTFIT), "node"),
    (lambda: quotas(0, [], BESTFIT), "node"),
    (lambda: place([1], PAPER, "roundrobin"), "bestfit, firstfit, worstfit, least_connection"),
    (lambda: quotas(1, PAPER, "BestFit"), "unknown placement policy"),
    (lambda: place([1, -1], PAPER, BESTFIT), "demands"),
    (lambda: place([math.nan], PAPER, WORSTFIT), "demands"),
    (lambda: place([math.inf], PAPER, LEAST_CONNECTION), "demands"),
    (lambda: place([1], [N("a", 1, 0), N("a", 2, 0)], BESTFIT), "unique"),
    (lambda: quotas(-1, PAPER, BESTFIT), "count"),
    (lambda: N("a", math.inf, 0), "finite"),
    (lambda: N("a", 1, math.nan), "finite"),
])
def test_placement_rejects(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def random_case(rng: random.Random) -> tuple[list[NodeLoad], list[float]]:
    """Nodes and demands on a grid of quarters, so float arithmetic is exact and ties are real."""
    quarter = lambda top: rng.randrange(int(top * 4) + 1) / 4  # noqa: E731
    shared = [quarter(30) for _ in range(2)]  # repeated capacities/queues make ties
    nodes = [N(f"n{i}", rng.choice(shared) if rng.random() < 0.4 else quarter(30),
               rng.choice([0.0, 0.0, quarter(8), quarter(35)])) for i in range(rng.randint(1, 7))]
    demands: list[float] = []
    for _ in range(rng.randint(1, 12)):
        size = rng.choice([0.0, 0.25, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 7.75, rng.randrange(1, 80) / 8])
        length = rng.choice([1, 1, 2, 3, len(nodes), len(nodes) + 1, rng.randint(1, 60), rng.randint(60, 200)])
        demands += [size] * length
    return nodes, demands


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", POLICIES)
def test_fast_placement_equals_one_by_one(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        nodes, demands = random_case(rng)
        assert place(demands, nodes, policy) == reference_place(demands, nodes, policy), (nodes, demands)
        count = rng.choice([0, 1, len(nodes), rng.randint(1, 150), rng.randint(150, 400)])
        expected = in_order_counts(reference_place([1.0] * count, nodes, policy))
        assert list(quotas(count, nodes, policy).items()) == expected, (nodes, count)


@pytest.mark.parametrize("policy", POLICIES)
def test_fast_placement_equals_one_by_one_on_integer_loads(policy: str) -> None:
    """Heterogeneous demands drawn with numpy, long runs of unit updates in between."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        nodes = [N(f"n{i}", float(rng.integers(0, 50)), float(rng.integers(0, 30))) for i in range(n)]
        parts = [rng.integers(0, 6, size=int(rng.integers(1, 40))).astype(float).tolist() + [1.0] * int(rng.integers(0, 300))
                 for _ in range(3)]
        demands = [d for part in parts for d in part]
        assert place(demands, nodes, policy) == reference_place(demands, nodes, policy), (nodes, demands)


def test_runs_are_placed_in_bulk() -> None:
    """A million unit updates: only feasible if a run is placed at once, not update by update."""
    nodes = [N("a", 300_000, 0), N("b", 500_000, 0), N("c", 100_000, 0), N("d", 400_000, 0)]
    out = place([1.0] * 1_000_000, nodes, BESTFIT)
    assert out == ["c"] * 100_000 + ["a"] * 300_000 + ["d"] * 400_000 + ["b"] * 200_000
    assert quotas(1_000_000, nodes, BESTFIT) == {"c": 100_000, "a": 300_000, "d": 400_000, "b": 200_000}
    assert quotas(1_000_000, nodes, WORSTFIT) == {"b": 425_000, "d": 325_000, "a": 225_000, "c": 25_000}
    assert quotas(1_000_001, PAPER, LEAST_CONNECTION) == {"n1": 200_001, "n2": 200_000, "n3": 200_000, "n4": 200_000, "n5": 200_000}


# --- top choice and the cluster plan ----------------------------------------------------------


@pytest.mark.parametrize("counts,preferred,top", [
    ({}, None, None),
    ({"a": 0}, None, None),
    ({"a": 0}, "a", None),
    ({"a": 3, "b": 5}, None, "b"),
    ({"a": 5, "b": 5}, None, "a"),
    ({"b": 5, "a": 5}, None, "a"),  # ties: smallest name, not insertion order
    ({"n2": 4, "n10": 4}, None, "n10"),  # lexicographic
    ({"a": 3, "b": 5}, "a", "a"),  # where the model lives, when it has updates
    ({"a": 0, "b": 5}, "a", "b"),
    ({"a": 3}, "z", "a"),
])
def test_choose_top(counts: dict[str, int], preferred: str | None, top: str | None) -> None:
    assert choose_top(counts, preferred) == top


@pytest.mark.parametrize("updates,nodes,policy,fan_in,reuse,quota,top,leaves,warm", [
    (20, PAPER, BESTFIT, 2, True, [("n1", 20)], "n1", {"n1": 10}, {"n1": 10}),
    (20, PAPER, BESTFIT, 2, False, [("n1", 20)], "n1", {"n1": 10}, {"n1": 12}),
    (60, PAPER, BESTFIT, 2, True, [("n1", 20), ("n2", 20), ("n3", 20)], "n1",
     {"n1": 10, "n2": 10, "n3": 10}, {"n1": 10, "n2": 10, "n3": 10}),
    (60, PAPER, FIRSTFIT, 2, False, [("n1", 20), ("n2", 20), ("n3", 20)], "n1",
     {"n1": 10, "n2": 10, "n3": 10}, {"n1": 12, "n2": 11, "n3": 11}),
    (100, PAPER, WORSTFIT, 2, False, [(f"n{i}", 20) for i in range(1, 6)], "n1",
     {f"n{i}": 10 for i in range(1, 6)}, {"n1": 12, "n2": 11, "n3": 11, "n4": 11, "n5": 11}),
    (60, PAPER, LEAST_CONNECTION, 3, True, [(f"n{i}", 12) for i in range(1, 6)], "n1",
     {f"n{i}": 4 for i in range(1, 6)}, {f"n{i}": 4 for i in range(1, 6)}),
    (7, [N("a", 4, 0), N("b", 10, 0)], BESTFIT, 3, True, [("a", 4), ("b", 3)], "a", {"a": 2, "b": 1}, {"a": 2, "b": 1}),
    (7, [N("a", 4, 0), N("b", 10, 0)], BESTFIT, 3, False, [("a", 4), ("b", 3)], "a", {"a": 2, "b": 1}, {"a": 4, "b": 2}),
    (13, [N("a", 10, 0), N("b", 3, 0)], BESTFIT, 1, True, [("b", 3), ("a", 10)], "a", {"b": 3, "a": 10}, {"b": 3, "a": 10}),
    # equal quotas: the first node used hosts the top
    (6, [N("a", 4, 0), N("b", 4, 1)], BESTFIT, 2, False, [("b", 3), ("a", 3)], "b", {"b": 2, "a": 2}, {"b": 4, "a": 3}),
    (1, PAPER, WORSTFIT, 4, True, [("n1", 1)], "n1", {"n1": 1}, {"n1": 1}),
    (0, PAPER, BESTFIT, 2, True, [], None, {}, {}),
])
def test_plan_round(updates: int, nodes: list[NodeLoad], policy: str, fan_in: int, reuse: bool,
                    quota: list[tuple[str, int]], top: str | None, leaves: dict[str, int], warm: dict[str, int]) -> None:
    plan = plan_round(updates, nodes, policy=policy, fan_in=fan_in, reuse=reuse)
    assert plan.policy == policy
    assert list(plan.quotas.items()) == quota
    assert plan.top == top
    assert plan.hierarchies == {n: NodeHierarchy(n, k, 1, n == top) for n, k in leaves.items()}
    assert plan.warm == warm


@pytest.mark.parametrize("updates,policy,fan_in", [(5, BESTFIT, 0), (5, "nearest", 2), (-1, BESTFIT, 2), (0, BESTFIT, 0)])
def test_plan_round_rejects(updates: int, policy: str, fan_in: int) -> None:
    with pytest.raises(ValueError):
        plan_round(updates, PAPER, policy=policy, fan_in=fan_in, reuse=True)


QUEUES = {"a": 0.0, "b": 3.2, "c": 1e-12}


@pytest.mark.parametrize("queues,fan_in,reuse,top,warm", [
    (QUEUES, 2, True, None, {"b": 2}),
    (QUEUES, 2, False, None, {"b": 3}),
    (QUEUES, 2, True, "a", {"a": 1, "b": 2}),  # the top's node needs an instance even without updates
    (QUEUES, 2, False, "a", {"a": 1, "b": 3}),
    (QUEUES, 2, True, "b", {"b": 2}),  # reuse: the top is a converted middle
    (QUEUES, 2, False, "b", {"b": 4}),
    (QUEUES, 2, True, "z", {"b": 2, "z": 1}),  # a top without an estimate still gets one
    ({"a": 4.0, "b": 0.5}, 1, True, None, {"a": 4, "b": 1}),
    ({"a": 4.0, "b": 0.5}, 1, False, None, {"a": 5, "b": 2}),
    ({"a": 4.0, "b": 0.5}, 3, True, None, {"a": 2, "b": 1}),
    ({}, 2, True, None, {}),
])
def test_plan_warm(queues: dict[str, float], fan_in: int, reuse: bool, top: str | None, warm: dict[str, int]) -> None:
    assert plan_warm(queues, fan_in=fan_in, reuse=reuse, top=top) == warm
