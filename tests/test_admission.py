"""Memory admission (lifl.ledger): what each admission reserves, fair shares, limits."""

from __future__ import annotations

import pytest

from lifl import format as fmt
from lifl.errors import Overloaded
from lifl.ledger import (
    PARTIAL, RETRY_AFTER_SECONDS, UPDATE, WANTING_SECONDS, JobSizes, MemoryLedger, RoundOf, round_extra,
)

SIZES = JobSizes(accumulator=10, model=3, leaf_fan_in=2)
A0, B0 = RoundOf("a", 0), RoundOf("b", 0)
BIG = 1 << 40


@pytest.mark.parametrize("fan_in,updates,partials,extra", [
    (2, 0, 0, 0),
    (2, 1, 0, 3),  # the next model, with the round's first update
    (2, 2, 0, 13),  # the leaf's second input: its accumulator
    (2, 3, 0, 23),  # a second leaf starts: the middle's accumulator
    (2, 4, 0, 33),
    (2, 5, 0, 43),  # a third leaf (its lone input held, not copied): the middle folds again
    (2, 6, 0, 53),
    (1, 1, 0, 3),  # leaves of one input pass it on
    (1, 2, 0, 13),  # ... so the middle folds from the second update on
    (1, 3, 0, 23),
    (3, 2, 0, 13),
    (3, 3, 0, 23),  # the leaf's third input: a fresh accumulator from the previous one
    (3, 4, 0, 33),
    (3, 5, 0, 43),
    (2, 0, 1, 3),  # a top with one partial writes the model from it
    (2, 0, 2, 13),  # two partials: the top's accumulator
    (2, 1, 1, 13),  # this node's own result and a partial
    (2, 2, 3, 33),
])
def test_round_extra_counts_accumulators_and_the_next_model(fan_in: int, updates: int, partials: int, extra: int) -> None:
    assert round_extra(JobSizes(10, 3, fan_in), updates, partials) == extra


@pytest.mark.parametrize("fan_in, updates, partials, extra", [
    (2, 1, 0, 13),  # a lone input taken off in a copy
    (2, 2, 0, 23),  # the leaf's accumulator, and its unmasked copy
    (2, 3, 0, 43),  # two leaves, two copies; the middle's accumulator
    (25, 100, 0, 4 * 20 + 4 * 10 + 20 + 3),  # four leaves of 25: two accumulators and a copy each; the middle's two
    (2, 0, 2, 13),  # a top of partials alone takes nothing off
])
def test_a_secure_round_counts_each_leafs_unmasked_copy(fan_in: int, updates: int, partials: int, extra: int) -> None:
    assert round_extra(JobSizes(10, 3, fan_in, secure=True), updates, partials) == extra


def test_each_update_reserves_itself_and_what_it_adds_to_its_round() -> None:
    ledger = MemoryLedger(BIG)
    costs = [ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0) for _ in range(6)]
    # the model; leaf accumulators; the middle's first, then second accumulator (for its re-folds)
    assert costs == [5 + 3, 5 + 10, 5 + 10, 5 + 10, 5 + 10, 5 + 10]
    assert ledger.usage("a").reserved == sum(costs) and ledger.free == BIG - sum(costs)
    assert ledger.reserve(A0, PARTIAL, SIZES, 10, now=0.0) == 10 + 10  # the partial and the top's accumulator
    assert ledger.reserve(A0, PARTIAL, SIZES, 10, now=0.0) == 10 + 10  # and the top's second, for its re-folds
    assert ledger.reserve(A0, PARTIAL, SIZES, 10, now=0.0) == 10


def test_a_partial_reserves_the_model_when_no_update_did() -> None:
    ledger = MemoryLedger(BIG)
    assert [ledger.reserve(A0, PARTIAL, SIZES, 10, now=0.0) for _ in range(4)] == [10 + 3, 10 + 10, 10 + 10, 10]


def test_objects_consume_their_rounds_reservation_and_the_rest_comes_from_free_memory() -> None:
    ledger = MemoryLedger(100)
    ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)  # 5 + 3
    assert ledger.add_object(A0, 5) == 5
    assert ledger.usage("a").__dict__ == {"working": 5, "reserved": 3} and ledger.free == 92
    assert ledger.add_object(A0, 4) == 3  # the model's 3 reserved bytes, 1 more from free memory
    assert (ledger.usage("a").reserved, ledger.free) == (0, 91)
    ledger.check_object(None, 91)  # a model exactly fits what is free ...
    with pytest.raises(Overloaded) as refused:  # ... one byte more does not
        ledger.check_object(None, 92)
    assert refused.value.code == "shm_exhausted" and refused.value.retry_after == RETRY_AFTER_SECONDS
    model = ledger.pin(A0, 4)  # the round's result became the model
    assert (ledger.usage("a").working, ledger.pinned, ledger.used) == (5, 4, 9)
    ledger.remove_object(A0, 5)
    ledger.remove_object(model, 4)
    ledger.release_round(A0)
    assert ledger.used == 0 and ledger.free == 100 and ledger.jobs == {}


def test_reserved_memory_is_not_given_to_others() -> None:
    ledger = MemoryLedger(100)
    ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)
    ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)  # 8 + 15 reserved for job a
    ledger.check_object(None, 77)
    with pytest.raises(Overloaded):
        ledger.check_object(None, 78)
    with pytest.raises(Overloaded):
        ledger.check_object(B0, 78)  # another job's object, no reservation of its own


@pytest.mark.parametrize("capacity,pinned,admitted", [
    (8, 0, True),  # the first update (5) and the next model (3) exactly fit
    (7, 0, False),  # one byte short: never, even alone
    (18, 10, True),
    (17, 10, False),  # models are inside capacity
])
def test_a_round_that_could_never_fit_is_refused_as_too_small(capacity: int, pinned: int, admitted: bool) -> None:
    ledger = MemoryLedger(capacity)
    if pinned:
        ledger.add_object(None, pinned)
    if admitted:
        assert ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0) == 8
        return
    with pytest.raises(Overloaded) as refused:
        ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)
    e = refused.value
    assert e.code == "shm_too_small" and e.status == 503 and e.retry_after == RETRY_AFTER_SECONDS
    assert "'a'" in e.message and "8 bytes" in e.message and f"{capacity - pinned} bytes for the rounds of tenant 'a'" in e.message
    assert ledger.jobs == {} and ledger.wanting == {}  # it does not count as wanting memory


def test_the_too_small_floor_counts_the_inputs_waiting_in_the_same_leaf() -> None:
    sizes = JobSizes(accumulator=10, model=3, leaf_fan_in=3)
    ledger = MemoryLedger(5 + 5 + 13)  # two updates of a leaf and its accumulator plus the model
    for _ in range(2):
        ledger.reserve(A0, UPDATE, sizes, 5, now=0.0)
        ledger.add_object(A0, 5)
    with pytest.raises(Overloaded) as refused:  # the leaf's third input: 3 inputs, 2 accumulators, the model > 23
        ledger.reserve(A0, UPDATE, sizes, 5, now=0.0)
    assert refused.value.code == "shm_too_small" and "38 bytes" in refused.value.message


def test_free_memory_limit_and_one_past_it() -> None:
    ledger = MemoryLedger(100)
    ledger.add_object(B0, 92)  # another job's objects (past its share: it was alone)
    assert ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0) == 8  # exactly the 8 free bytes
    ledger.withdraw(A0, UPDATE, unused=5)
    ledger.add_object(B0, 1)
    with pytest.raises(Overloaded) as refused:
        ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)
    e = refused.value
    assert e.code == "shm_exhausted" and "'a' needs 8 bytes" in e.message and "7 of 100 are free" in e.message
    assert f"retry after {RETRY_AFTER_SECONDS:g} s" in e.message
    assert "a" in ledger.wanting


def test_fair_share_limit_and_one_past_it() -> None:
    ledger = MemoryLedger(100)
    ledger.reserve(B0, UPDATE, SIZES, 20, now=0.0)  # b holds 23: two jobs share, 50 each
    ledger.add_object(A0, 27)  # a holds 27 (its previous round's objects)
    assert ledger.reserve(A0, UPDATE, SIZES, 20, now=0.0) == 23  # 27 + 23 = 50: exactly its share
    ledger.withdraw(A0, UPDATE, unused=20)
    ledger.add_object(A0, 1)
    with pytest.raises(Overloaded) as refused:
        ledger.reserve(A0, UPDATE, SIZES, 20, now=0.0)
    e = refused.value
    assert e.code == "fair_share" and "'a' holds 28 bytes" in e.message and "needs 23 more" in e.message
    assert "fair share of 50 bytes (2 tenants" in e.message


def test_a_job_alone_takes_everything_and_is_capped_at_half_once_another_wants_memory() -> None:
    ledger = MemoryLedger(100)
    updates = 0
    while True:  # a alone fills memory with updates of 20 bytes
        try:
            ledger.reserve(A0, UPDATE, SIZES, 20, now=0.0)
        except Overloaded as e:
            assert e.code == "shm_exhausted"
            break
        ledger.add_object(A0, 20)
        updates += 1
    assert ledger.usage("a").working + ledger.usage("a").reserved > 50
    with pytest.raises(Overloaded) as refused:  # b wants memory: none is free
        ledger.reserve(B0, UPDATE, SIZES, 20, now=1.0)
    assert refused.value.code == "shm_exhausted"
    with pytest.raises(Overloaded) as refused:  # a is over its half now, whatever is free
        ledger.remove_object(A0, 20)
        ledger.reserve(A0, UPDATE, SIZES, 1, now=2.0)
    assert refused.value.code == "fair_share"
    ledger.release_round(A0)  # a's round ends and frees its memory
    for _ in range(updates - 1):
        ledger.remove_object(A0, 20)
    assert ledger.reserve(B0, UPDATE, SIZES, 20, now=3.0) == 23  # b gets its share
    assert ledger.reserve(RoundOf("a", 1), UPDATE, SIZES, 20, now=3.0) == 23  # a too: both fit in half
    # once b stops wanting and holds nothing, a may have everything again
    ledger.withdraw(B0, UPDATE, unused=20)
    assert ledger.tenant_share("a", now=1.0 + WANTING_SECONDS - 0.01) == (50, 2)
    assert ledger.tenant_share("a", now=1.0 + WANTING_SECONDS) == (100, 1)


def test_partials_finish_rounds_so_they_are_exempt_from_shares_but_not_from_capacity() -> None:
    ledger = MemoryLedger(100)
    ledger.reserve(B0, UPDATE, SIZES, 20, now=0.0)
    ledger.add_object(A0, 60)  # a is over its share of 50
    assert ledger.reserve(A0, PARTIAL, SIZES, 14, now=0.0) == 17  # the partial and the model: 77 of 100
    with pytest.raises(Overloaded) as refused:
        ledger.reserve(A0, PARTIAL, SIZES, 10, now=0.0)  # and the top's accumulator: 20 > 100 - 60 - 17 - 23 free
    assert refused.value.code == "shm_exhausted"


def test_withdrawn_updates_give_back_what_their_round_reserved_for_them() -> None:
    ledger = MemoryLedger(BIG)
    for _ in range(3):
        ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)
        ledger.add_object(A0, 5)
    assert ledger.usage("a").reserved == 3 + 10 + 10
    ledger.withdraw(A0, UPDATE)  # an aborted upload: the round has two updates now
    assert ledger.usage("a").reserved == 3 + 10
    assert ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0) == 5 + 10  # the next one is the third again
    ledger.withdraw(A0, UPDATE, unused=5)  # never created: its own bytes too
    assert ledger.usage("a").reserved == 3 + 10


def test_round_end_releases_leftovers_of_that_round_and_older_ones_only() -> None:
    ledger = MemoryLedger(BIG)
    ledger.reserve(RoundOf("a", 3), UPDATE, SIZES, 5, now=0.0)
    ledger.add_object(RoundOf("a", 3), 5)
    ledger.reserve(RoundOf("a", 4), UPDATE, SIZES, 5, now=0.0)  # a later round admits: round 3 cannot allocate again
    assert set(ledger.jobs["a"].rounds) == {4}
    ledger.reserve(RoundOf("a", 5), PARTIAL, SIZES, 5, now=0.0)
    assert set(ledger.jobs["a"].rounds) == {5}
    ledger.reserve(RoundOf("b", 5), UPDATE, SIZES, 5, now=0.0)
    ledger.release_round(RoundOf("a", 5))
    assert ledger.usage("a").__dict__ == {"working": 5, "reserved": 0} and ledger.usage("b").reserved == 8
    ledger.remove_object(RoundOf("a", 3), 5)
    assert "a" not in ledger.jobs


def test_a_crashed_tasks_accumulator_goes_back_to_its_open_round() -> None:
    ledger = MemoryLedger(BIG)
    for _ in range(2):
        ledger.reserve(A0, UPDATE, SIZES, 5, now=0.0)
    drawn = ledger.add_object(A0, 10)  # the leaf's accumulator
    ledger.remove_object(A0, 10, refund=drawn)  # its instance died: the re-run needs it again
    assert ledger.add_object(A0, 10) == 10
    ledger.release_round(A0)
    ledger.remove_object(A0, 10, refund=10)  # after the round: nothing to give back to
    assert ledger.reserved == 0


def test_job_sizes_are_what_the_aggregator_allocates() -> None:
    spec = fmt.ModelSpec((fmt.TensorSpec("w", fmt.F32, (10, 3)), fmt.TensorSpec("n", fmt.I64, ())))
    sizes = JobSizes.of(spec, 4)
    assert sizes.model == len(fmt.spec_header(spec)) + 10 * 3 * 4 + 8
    assert sizes.accumulator == len(fmt.spec_header(spec.partial())) + 10 * 3 * 8 + 16
    assert sizes.leaf_fan_in == 4


def test_a_round_larger_than_a_share_still_takes_its_updates_one_leaf_at_a_time() -> None:
    sizes = JobSizes(accumulator=10, model=3, leaf_fan_in=2)
    ledger = MemoryLedger(100)
    ledger.reserve(B0, UPDATE, sizes, 5, now=0.0)  # b wants memory: shares of 50
    for leaf in range(3):  # a's round: 3 leaves of 2 updates, each folded (its updates freed) in turn
        for _ in range(2):
            ledger.reserve(A0, UPDATE, sizes, 5, now=0.0)
            ledger.add_object(A0, 5)
        ledger.add_object(A0, 10)  # the leaf's accumulator
        ledger.remove_object(A0, 5)
        ledger.remove_object(A0, 5)
    # leaves; the middle's two accumulators and the model
    assert ledger.usage("a").__dict__ == {"working": 30, "reserved": 23}
    # the 7th update (the 4th leaf's first) needs 5: 58 > 50, but its round's floor is
    # 53 + 5 = 58 (its accumulators and model, and the leaf's input)
    assert ledger.reserve(A0, UPDATE, sizes, 5, now=0.0) == 5
    ledger.add_object(A0, 5)
    # the 8th needs 15 (itself and the 4th leaf's accumulator): 73 > 50, but its floor is
    # 63 + 5 + 5 = 73 (and both inputs of the leaf)
    assert ledger.reserve(A0, UPDATE, sizes, 5, now=0.0) == 15
    ledger.add_object(A0, 5)
    with pytest.raises(Overloaded) as refused:  # the 9th waits until the 4th leaf is folded (78 > 68)
        ledger.reserve(A0, UPDATE, sizes, 5, now=0.0)
    assert refused.value.code == "fair_share"
    ledger.add_object(A0, 10)
    ledger.remove_object(A0, 5)
    ledger.remove_object(A0, 5)
    assert ledger.reserve(A0, UPDATE, sizes, 5, now=0.0) == 5
