"""Shared memory between tenants (lifl.ledger): two-level fair shares, pinned models counted
against their tenant, the shm_bytes and retained_bytes quotas."""

from __future__ import annotations

import pytest

from lifl.errors import Overloaded, QuotaBusy, QuotaExceeded
from lifl.ledger import UPDATE, JobSizes, MemoryLedger, Pinned, RoundOf
from lifl.quotas import Quota

SIZES = JobSizes(accumulator=10, model=3, leaf_fan_in=2)
CAPACITY = 1000
UPDATE_BYTES = 20


def fill_alone(ledger: MemoryLedger, tenant: str, jobs: list[str], now: float) -> None:
    """The tenant's jobs take turns reserving updates until each is refused (memory exhausted,
    or the job at its share of its tenant's memory)."""
    refused: set[str] = set()
    while len(refused) < len(jobs):
        for job in set(jobs) - refused:
            try:
                ledger.reserve(RoundOf(job, 0), UPDATE, SIZES, UPDATE_BYTES, now, tenant)
            except Overloaded as e:
                assert e.code in ("shm_exhausted", "fair_share")
                refused.add(job)


def reserve_until_refused(ledger: MemoryLedger, job: str, tenant: str, now: float) -> Overloaded:
    while True:
        try:
            ledger.reserve(RoundOf(job, 0), UPDATE, SIZES, UPDATE_BYTES, now, tenant)
        except Overloaded as e:
            return e


@pytest.mark.parametrize("jobs_of_a", [1, 3, 31])
def test_a_tenant_with_many_jobs_gets_half_against_a_tenant_with_one(jobs_of_a: int) -> None:
    ledger = MemoryLedger(CAPACITY)
    a_jobs = [f"a{i}" for i in range(jobs_of_a)]
    fill_alone(ledger, "A", a_jobs, now=0.0)  # alone, A may take everything
    assert ledger.tenant_held("A") > CAPACITY - jobs_of_a * (UPDATE_BYTES + SIZES.accumulator)
    refused = reserve_until_refused(ledger, "b", "B", 1.0)  # B wants memory: (almost) none is free
    assert refused.code == "shm_exhausted" and "'A' by " in refused.message
    assert ledger.over_share(1.0) == {"A": ledger.tenant_held("A") - CAPACITY // 2}
    assert ledger.tenant_share("A", 1.0) == (CAPACITY // 2, 2)
    assert ledger.job_share("a0", "A", 1.0) == (CAPACITY // 2 // jobs_of_a, jobs_of_a)
    for job in a_jobs:  # A's rounds end; its jobs push their next rounds while B still wants memory
        ledger.release_round(RoundOf(job, 0))
    for job in a_jobs:
        assert reserve_until_refused(ledger, job, "A", 2.0).code == "fair_share"
    assert ledger.tenant_held("A") <= CAPACITY // 2  # its half, split between its jobs
    # B gets its tenant's half, however many jobs A has (per job it would get 1/(jobs + 1))
    assert reserve_until_refused(ledger, "b", "B", 2.0).code in ("fair_share", "shm_exhausted")
    assert CAPACITY // 2 - 2 * (UPDATE_BYTES + SIZES.accumulator) < ledger.tenant_held("B") <= CAPACITY // 2


def test_the_jobs_of_a_tenant_split_its_share() -> None:
    ledger = MemoryLedger(CAPACITY)
    ledger.reserve(RoundOf("b", 0), UPDATE, SIZES, UPDATE_BYTES, 0.0, "B")  # B holds memory: halves of 500
    ledger.reserve(RoundOf("a1", 0), UPDATE, SIZES, UPDATE_BYTES, 0.0, "A")  # A's two jobs: 250 each
    refused = reserve_until_refused(ledger, "a0", "A", 0.0)
    assert refused.code == "fair_share" and "fair share of 250 bytes (tenant 'A'" in refused.message
    assert "between 2 of its jobs" in refused.message
    assert ledger.usage("a0").reserved <= 250


def test_models_count_against_their_tenant_and_its_excess_is_what_must_spill() -> None:
    ledger = MemoryLedger(CAPACITY)
    models = 0
    while True:  # A alone sets models of 100 bytes until memory is full
        try:
            ledger.admit_pinned(Pinned(f"a{models}"), 100, 0.0, "A")
        except Overloaded as e:
            assert e.code == "shm_exhausted"
            break
        ledger.add_object(Pinned(f"a{models}"), 100, "A")
        models += 1
    assert models == 10 and ledger.pinned == CAPACITY
    with pytest.raises(Overloaded) as refused:  # B's model: memory is full, A holds it all
        ledger.admit_pinned(Pinned("b"), 100, 1.0, "B")
    assert refused.value.code == "shm_exhausted" and "'A' by 500 bytes" in refused.value.message
    assert ledger.over_share(1.0) == {"A": 500}  # B is refused, so wants memory: A is 500 over its half
    with pytest.raises(Overloaded) as refused:  # A may add no model while over its half
        ledger.admit_pinned(Pinned("a10"), 1, 1.0, "A")
    assert refused.value.code in ("fair_share", "shm_exhausted")
    for i in range(5):  # A's idle models spill, as much as over_share says
        ledger.remove_object(Pinned(f"a{i}"), 100)
    assert ledger.over_share(1.0) == {}
    ledger.admit_pinned(Pinned("b"), 100, 1.0, "B")  # B's model gets in
    ledger.add_object(Pinned("b"), 100, "B")
    with pytest.raises(Overloaded) as refused:  # and A's new model waits for its share
        ledger.admit_pinned(Pinned("a10"), 100, 1.0, "A")
    assert refused.value.code == "fair_share" and "tenant 'A' holds 500 bytes" in refused.value.message
    # a round of A may still take its floor on top of its models, so that it finishes
    assert ledger.reserve(RoundOf("a0", 0), UPDATE, SIZES, UPDATE_BYTES, 1.0, "A") == UPDATE_BYTES + SIZES.model


def test_a_round_result_pinned_as_the_model_stays_its_tenants() -> None:
    ledger = MemoryLedger(CAPACITY)
    ledger.reserve(RoundOf("a", 0), UPDATE, SIZES, UPDATE_BYTES, 0.0, "A")
    ledger.add_object(RoundOf("a", 0), UPDATE_BYTES, "A")
    ledger.add_object(RoundOf("a", 0), SIZES.model, "A")
    owner = ledger.pin(RoundOf("a", 0), SIZES.model)
    assert owner == Pinned("a") and ledger.tenant_held("A") == UPDATE_BYTES + SIZES.model
    ledger.remove_object(RoundOf("a", 0), UPDATE_BYTES)
    ledger.release_round(RoundOf("a", 0))
    assert ledger.tenant_held("A") == SIZES.model and ledger.for_rounds("A") == CAPACITY - SIZES.model
    ledger.retain(owner, SIZES.model, "A")  # only retention holds it: retained, not held
    assert (ledger.tenant_held("A"), ledger.retained, ledger.jobs) == (0, SIZES.model, {})
    ledger.remove_retained(SIZES.model, "A")
    assert (ledger.used, ledger.tenants) == (0, {})


MODEL = 100
COST = UPDATE_BYTES + SIZES.model  # what the round's first update reserves


@pytest.mark.parametrize("limit,outcome", [
    (None, None),  # no limit of its own
    (MODEL + COST, None),  # exactly at the limit
    (MODEL + COST - 1, QuotaBusy),  # one byte past it: its model may spill or its rounds end
    (COST - 1, QuotaExceeded),  # the round alone could never fit
])
def test_the_shm_bytes_quota_at_and_past_its_limit(limit: int | None, outcome: type[Exception] | None) -> None:
    ledger = MemoryLedger(CAPACITY)
    ledger.set_quotas({"A": Quota(shm_bytes=limit), "B": Quota(shm_bytes=0)})
    ledger.add_object(Pinned("a"), MODEL, "A")  # a restored model: never refused
    if outcome is None:
        assert ledger.reserve(RoundOf("a", 0), UPDATE, SIZES, UPDATE_BYTES, 0.0, "A") == COST
        return
    with pytest.raises(outcome) as refused:
        ledger.reserve(RoundOf("a", 0), UPDATE, SIZES, UPDATE_BYTES, 0.0, "A")
    e = refused.value
    assert (e.code, e.extra) == ("quota_exceeded", {"quota": "shm_bytes", "limit": limit, "used": MODEL})
    assert e.status == (429 if outcome is QuotaBusy else 403) and "quota (shm_bytes)" in e.message
    assert "a" not in ledger.wanting  # a tenant at its quota wants nothing of the others' memory
    assert ledger.usage("a").reserved == 0


@pytest.mark.parametrize("limit,size,outcome", [
    (MODEL, MODEL, None),
    (MODEL, MODEL + 1, QuotaExceeded),  # a model larger than the quota
    (2 * MODEL, MODEL + 1, QuotaBusy),  # the tenant's other model is in the way
])
def test_a_model_past_the_shm_bytes_quota_is_refused(limit: int, size: int, outcome: type[Exception] | None) -> None:
    ledger = MemoryLedger(CAPACITY)
    ledger.set_quotas({"A": Quota(shm_bytes=limit)})
    if outcome is QuotaBusy:
        ledger.add_object(Pinned("other"), MODEL, "A")
    if outcome is None:
        ledger.admit_pinned(Pinned("a"), size, 0.0, "A")
        return
    with pytest.raises(outcome) as refused:
        ledger.admit_pinned(Pinned("a"), size, 0.0, "A")
    assert refused.value.extra["quota"] == "shm_bytes" and refused.value.extra["limit"] == limit


@pytest.mark.parametrize("node_budget,quota,limit", [
    (500, None, 500),  # no quota of its own: the node's budget per tenant
    (500, 200, 200),
    (500, 800, 500),  # the node's budget still bounds it
    (500, 0, 0),
])
def test_retained_bytes_are_held_to_the_lower_of_the_node_budget_and_the_quota(
        node_budget: int, quota: int | None, limit: int) -> None:
    ledger = MemoryLedger(CAPACITY)
    ledger.set_quotas({"A": Quota(retained_bytes=quota)})
    assert ledger.retained_limit("A", node_budget) == limit
    assert ledger.retained_limit("B", node_budget) == node_budget
