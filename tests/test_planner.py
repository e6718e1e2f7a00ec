"""Hierarchy planning: pure functions, table-driven."""

from __future__ import annotations

import pytest

from lifl.control.planner import InstanceView, RoundPlan, expired, pick_warm


@pytest.mark.parametrize("updates,fan_in,leaves,assignments", [
    (1, 2, 1, [(0, 1)]),
    (2, 2, 1, [(0, 2), (0, 2)]),
    (5, 2, 3, [(0, 2), (0, 2), (1, 2), (1, 2), (2, 1)]),
    (6, 3, 2, [(0, 3)] * 3 + [(1, 3)] * 3),
    (7, 3, 3, [(0, 3)] * 3 + [(1, 3)] * 3 + [(2, 1)]),
    (4, 1, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    (3, 10, 1, [(0, 3)] * 3),
])
def test_round_plan(updates: int, fan_in: int, leaves: int, assignments: list[tuple[int, int]]) -> None:
    plan = RoundPlan(updates, fan_in)
    assert plan.leaves == plan.middle_fan_in == leaves
    assert [plan.leaf_of(i) for i in range(updates)] == assignments


@pytest.mark.parametrize("updates,fan_in", [(0, 2), (3, 0), (-1, 1)])
def test_round_plan_rejects_empty_rounds(updates: int, fan_in: int) -> None:
    with pytest.raises(ValueError):
        RoundPlan(updates, fan_in)


def test_leaf_of_is_bounded() -> None:
    with pytest.raises(ValueError):
        RoundPlan(3, 2).leaf_of(3)


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
