"""A noisy tenant against its quotas while another tenant works: the noisy one is refused by
name (jobs and tokens with 403, rounds in progress with 429 and Retry-After), the quiet one's
rounds go on, and afterwards each job's versions have one round record each with nothing lost,
its latest version is the exact FedAvg of the updates acknowledged for its round, and no job is
wedged (each completes one more round, checked the same way)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, wait_for
from lifl import format as fmt
from lifl.client import Gateway, RetryPolicy
from lifl.errors import QuotaExceeded
from lifl.quotas import Quota

pytestmark = pytest.mark.slow
GOAL = 4
QUIET_ROUNDS = 3
NOISY_ROUNDS = 2  # per job
PATIENT = RetryPolicy(max_attempts=100_000, max_elapsed_s=300.0, max_delay_s=0.5)  # bounds a failing run only
SEEDS = itertools.count(1)


def weights(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).standard_normal(512).astype(np.float32)}


class Job:
    """A job's rounds as its clients pushed them: every update acknowledged, by version."""

    def __init__(self, node: RunningNode, name: str) -> None:
        self.node, self.name = node, name
        self.rounds: dict[int, list[tuple[dict[str, np.ndarray], int]]] = {}

    def round(self, version: int) -> None:
        """GOAL clients push at once (each retried through 429/503 by the SDK); the round's
        acknowledged updates are recorded."""
        updates = [(weights(next(SEEDS)), 1 + i) for i in range(GOAL)]
        acknowledged: list[tuple[dict[str, np.ndarray], int]] = []
        lock = threading.Lock()

        def push(i: int) -> None:
            gw = Gateway(self.node.http, token=OPERATOR_TOKEN, retry=PATIENT)
            try:
                answer = gw.push(self.name, fmt.encode(updates[i][0]), samples=updates[i][1], base_version=version,
                                 client=f"{self.name}-c{i}")
            finally:
                gw.close()
            assert answer["version"] == version, answer
            with lock:
                acknowledged.append(updates[i])

        run_all([lambda i=i: push(i) for i in range(GOAL)])
        self.rounds[version] = acknowledged
        wait_for(lambda: self.version() > version, timeout=300, what=f"{self.name} version {version + 1}")

    def version(self) -> int:
        return self.node.json("GET", f"/v1/jobs/{self.name}")[1]["version"]

    def check(self) -> None:
        """Every version has one round record and nothing was lost; the latest is the exact FedAvg
        of its round's acknowledged updates."""
        gw = Gateway(self.node.http, token=OPERATOR_TOKEN)
        records = gw.rounds(self.name)
        made = sorted(r["new_version"] for r in records if r["outcome"] in ("complete", "partial"))
        assert made == list(range(1, len(self.rounds) + 1)), records
        assert not any(sum(r.get("lost", {}).values()) for r in records), records
        version, blob = gw.model(self.name)
        gw.close()
        last = self.rounds[version - 1]
        model = fmt.views(blob, fmt.parse_layout(blob))["w"]
        expected = sum(u["w"].astype(np.float64) * c for u, c in last) / sum(c for _, c in last)
        np.testing.assert_allclose(model, expected, rtol=1e-5, atol=1e-6)


def run_all(calls: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.timeout(1200)
def test_a_tenant_at_its_quotas_is_refused_by_name_while_another_tenant_works(node: RunningNode) -> None:
    node.state.set_quota("noisy", Quota(jobs=2, tokens=2, rounds=1))
    op = Gateway(node.http, token=OPERATOR_TOKEN)
    noisy = Gateway(node.http, token=op.create_token("tenant", "noisy")["token"])  # its first token
    made, refused = [], []
    for i in range(5):  # more than its quota: the rest are refused, naming it
        try:
            made.append(noisy.create_job(f"noisy-{i}", GOAL)["job"])
        except QuotaExceeded as e:
            refused.append(e.extra["quota"])
    assert len(made) == 2 and refused == ["jobs"] * 3
    noisy.create_token("client", "noisy", job=made[0])
    with pytest.raises(QuotaExceeded):
        noisy.create_token("client", "noisy", job=made[0])
    for job in made:
        noisy.set_model(job, fmt.encode(weights(0)))
    op.create_job("quiet-0", GOAL, tenant="quiet")
    op.set_model("quiet-0", fmt.encode(weights(0)))
    noisy_jobs, quiet = [Job(node, name) for name in made], Job(node, "quiet-0")

    # the noisy tenant's first job holds its only round in progress: the second job's waits
    assert node.push(made[0], fmt.encode(weights(99)), client=f"{made[0]}-early")[0] == 202
    status, headers, raw = node.request("POST", f"/v1/jobs/{made[1]}/updates", fmt.encode(weights(98)), {
        "X-Lifl-Client": "x", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"})
    assert status == 429 and int(headers["Retry-After"]) >= 1 and b'"quota": "rounds"' in raw
    early = (weights(99), 1)  # in the first job's round 0, with the rest below

    def noisy_load() -> None:  # the first job finishes round 0 and goes on while the second's rounds wait their turn
        run_all([finish_first, *[lambda job=job: [job.round(v) for v in range(NOISY_ROUNDS)] for job in noisy_jobs[1:]]])

    def finish_first() -> None:
        first = noisy_jobs[0]
        updates = [(weights(next(SEEDS)), 2 + i) for i in range(GOAL - 1)]

        def push(i: int) -> None:
            gw = Gateway(node.http, token=OPERATOR_TOKEN, retry=PATIENT)
            try:
                gw.push(first.name, fmt.encode(updates[i][0]), samples=updates[i][1], base_version=0,
                        client=f"{first.name}-late{i}")
            finally:
                gw.close()

        run_all([lambda i=i: push(i) for i in range(GOAL - 1)])
        first.rounds[0] = [early, *updates]
        wait_for(lambda: first.version() > 0, timeout=300, what=f"{first.name} version 1")
        for v in range(1, NOISY_ROUNDS):
            first.round(v)

    run_all([noisy_load, lambda: [quiet.round(v) for v in range(QUIET_ROUNDS)]])
    for job in [*noisy_jobs, quiet]:
        job.check()
    # nothing is wedged: with the noise over, every job still completes a round
    run_all([lambda job=job: job.round(job.version()) for job in [*noisy_jobs, quiet]])
    for job in [*noisy_jobs, quiet]:
        job.check()
    assert node.state.tenant_usage("noisy") == {"jobs": 2, "tokens": 2, "rounds": 0}
    op.close()
    noisy.close()
