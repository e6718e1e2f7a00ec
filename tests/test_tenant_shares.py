"""Shared memory between tenants at the probe's sizes (issue 25, item 3): a tenant with 31 jobs
fills a 512 MiB node alone, and gets half once a second tenant wants memory, not 31/32 of it
(the general tables: tests/test_tenant_memory.py)."""

from __future__ import annotations

import pytest

from lifl.errors import Overloaded
from lifl.ledger import UPDATE, JobSizes, MemoryLedger, RoundOf

MiB = 1 << 20
CAPACITY = 512 * MiB  # the probe's --shm-limit
PROBE = JobSizes(accumulator=32 * MiB, model=16 * MiB, leaf_fan_in=2)  # 16 MiB float32 models, float64 sums
FIRST = 16 * MiB + PROBE.model  # what a round's first update of 16 MiB reserves: itself and the next model


def reserve(ledger: MemoryLedger, job: str, tenant: str, now: float, at_round: int = 0) -> int:
    return ledger.reserve(RoundOf(job, at_round), UPDATE, PROBE, 16 * MiB, now, tenant)


def admitted_until_refused(ledger: MemoryLedger, jobs: list[str], tenant: str, now: float,
                           at_round: int = 0) -> tuple[int, Overloaded]:
    """(updates admitted, the refusal that stopped them): the jobs take turns, one update each."""
    admitted = 0
    while True:
        for job in jobs:
            try:
                reserve(ledger, job, tenant, now, at_round)
            except Overloaded as refused:
                return admitted, refused
            admitted += 1


def test_a_tenant_with_31_jobs_fills_memory_alone_and_gets_half_once_another_tenant_wants_some() -> None:
    ledger = MemoryLedger(CAPACITY)
    a_jobs = [f"a{i}" for i in range(31)]
    admitted, refused = admitted_until_refused(ledger, a_jobs, "A", now=0.0)
    assert (admitted, refused.code, ledger.free) == (CAPACITY // FIRST, "shm_exhausted", 0)  # alone: everything
    with pytest.raises(Overloaded) as b_refused:  # B's update finds nothing free, and so wants memory
        reserve(ledger, "b", "B", now=1.0)
    assert b_refused.value.code == "shm_exhausted" and f"'A' by {CAPACITY // 2} bytes" in b_refused.value.message
    for job in a_jobs:  # A's rounds end
        ledger.release_round(RoundOf(job, 0))
    # B's one job gets B's half (per job, it would get 1/32 of the memory) ...
    admitted_b, refused = admitted_until_refused(ledger, ["b"], "B", now=1.0)
    assert refused.code == "fair_share" and refused.message.startswith("tenant 'B' holds")
    assert f"over the tenant's fair share of {CAPACITY // 2} bytes (2 tenants" in refused.message
    assert CAPACITY // 2 - 3 * 16 * MiB < ledger.tenant_held("B") <= CAPACITY // 2
    # ... and A's 31 jobs share the other half
    admitted_a, refused = admitted_until_refused(ledger, a_jobs, "A", now=1.0, at_round=1)
    assert refused.code == "fair_share" and refused.message.startswith("tenant 'A' holds")
    assert (admitted_a, ledger.tenant_held("A")) == (CAPACITY // 2 // FIRST, CAPACITY // 2)
