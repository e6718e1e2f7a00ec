"""Whether a job's round can ever fit (lifl.ledger.node_peak, round_fit): the peak must be the
largest floor the ledger admits a round's updates by, one leaf at a time, so that a job refused
at its model is exactly one whose round the ledger would stall."""

from __future__ import annotations

import pytest

from lifl.ledger import UPDATE, JobSizes, MemoryLedger, RoundOf, node_peak, round_extra, round_fit
from lifl.errors import Overloaded

ACCUMULATOR, MODEL, UPDATE_BYTES = 100, 90, 80


def brute_floor(sizes: JobSizes, updates: int) -> int:
    """The largest floor the ledger checks over a node's updates of a round (MemoryLedger.reserve)."""
    held = sizes.leaf_inputs_held
    return max(round_extra(sizes, k + 1, 0) + min(k % sizes.leaf_fan_in + 1, held) * UPDATE_BYTES for k in range(updates))


@pytest.mark.parametrize("fan_in", [1, 2, 3, 5])
@pytest.mark.parametrize("updates", [1, 2, 3, 4, 7, 10, 31])
@pytest.mark.parametrize("max_inflight", [0, 1, 2, 40])
def test_a_nodes_peak_is_the_largest_floor_the_ledger_admits_by(fan_in: int, updates: int, max_inflight: int) -> None:
    sizes = JobSizes(ACCUMULATOR, MODEL, fan_in, max_inflight)
    assert node_peak(sizes, UPDATE_BYTES, updates, 0) == brute_floor(sizes, updates)


@pytest.mark.parametrize("fan_in, updates, max_inflight", [(2, 1, 0), (2, 6, 0), (3, 7, 0), (4, 9, 0), (8, 8, 2), (8, 11, 1),
                                                          (4, 9, 3)])
def test_the_ledger_takes_a_round_one_leaf_at_a_time_with_its_peak_and_not_one_byte_less(
        fan_in: int, updates: int, max_inflight: int) -> None:
    """Admitting the updates, each leaf folding (its inputs freed, its accumulator made) as it
    fills, or as soon as the job's max_inflight updates wait."""
    sizes = JobSizes(ACCUMULATOR, MODEL, fan_in, max_inflight)
    peak = node_peak(sizes, UPDATE_BYTES, updates, 0)

    def run(capacity: int) -> bool:
        ledger, owner = MemoryLedger(capacity), RoundOf("j", 0)
        inputs = in_leaf = 0
        for k in range(updates):
            try:
                ledger.reserve(owner, UPDATE, sizes, UPDATE_BYTES, now=0.0)
            except Overloaded as e:
                assert e.code == "shm_too_small"
                return False
            ledger.add_object(owner, UPDATE_BYTES)
            inputs += 1
            in_leaf += 1
            if inputs == sizes.leaf_inputs_held or in_leaf == fan_in or k == updates - 1:
                for _ in range(inputs):  # the leaf folds: its inputs go, its result stays
                    ledger.remove_object(owner, UPDATE_BYTES)
                inputs = 0
                in_leaf %= fan_in
        return True

    assert run(peak) and not run(peak - 1)


SIZES = JobSizes(ACCUMULATOR, MODEL, 2)
ALONE = node_peak(SIZES, UPDATE_BYTES, 40, 0)  # 40 updates on one node
TOP_OF_TWO, OTHER_OF_TWO = node_peak(SIZES, UPDATE_BYTES, 20, 1), node_peak(SIZES, UPDATE_BYTES, 20, 0)
TOP_OF_THREE = node_peak(SIZES, UPDATE_BYTES, 14, 2)


def test_spreading_a_round_lowers_each_nodes_peak_and_the_top_needs_the_most() -> None:
    assert ALONE > TOP_OF_TWO > OTHER_OF_TWO and TOP_OF_TWO > TOP_OF_THREE


@pytest.mark.parametrize("goal, room, fits, needed", [
    (40, [ALONE], True, ALONE),  # one node: its peak against its room
    (40, [ALONE - 1], False, ALONE),
    (40, [ALONE - 1, OTHER_OF_TWO - 1], False, TOP_OF_TWO),  # both must hold their half: the second cannot
    (40, [ALONE - 1, OTHER_OF_TWO], True, TOP_OF_TWO),  # the top on the larger, the other half on the smaller
    (40, [TOP_OF_TWO - 1, TOP_OF_TWO - 1], False, TOP_OF_TWO),
    (40, [TOP_OF_TWO - 1, TOP_OF_TWO - 1, TOP_OF_TWO - 1], True, TOP_OF_THREE),  # a third node makes it fit
    (40, [TOP_OF_THREE - 1] * 3, False, TOP_OF_THREE),
    (40, [], False, ALONE),  # no node at all: what one node would need is said
    (1, [10**9] * 5, True, node_peak(SIZES, UPDATE_BYTES, 1, 0)),  # a goal of one never spreads
])
def test_a_round_fits_if_some_spread_over_the_nodes_fits(goal: int, room: list[int], fits: bool, needed: int) -> None:
    assert round_fit(SIZES, UPDATE_BYTES, goal, room) == (fits, needed)
