"""Shared memory between tenants on a real node (lifl.ledger through the HTTP API): a tenant that
filled the node alone gives way to a second tenant, whose model gets in and whose round
completes; a tenant's shm_bytes quota refuses its updates with 429 (or 403) naming it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, wait_for
from lifl.client import Gateway, RetryPolicy
from lifl import format as fmt
from lifl.quotas import Quota
from lifl.state import ClusterState
from test_admission_e2e import (
    COSTS, GOAL, LEAF_FAN_IN, ROUND_FLOOR, UPDATE_BYTES, Uploads, check_round, deliver, held_round,
    start_node,  # noqa: F401 - the fixture
    random_model, refusal_code,
)

pytestmark = pytest.mark.slow
A_MODELS = 1  # tenant A's jobs, each with a model: only the one in its round, which cannot spill (idle models would, lifl.node.spill)
A_ADMITTED = 12  # A's round updates that exactly fill the memory its models leave
CAPACITY = A_MODELS * UPDATE_BYTES + sum(COSTS[:A_ADMITTED])


def tenant_token(node: RunningNode, tenant: str) -> dict[str, str]:
    status, answer = node.json("POST", "/v1/tokens", {"role": "tenant", "tenant": tenant})
    assert status == 201, answer
    return {"Authorization": f"Bearer {answer['token']}"}


def create_job(node: RunningNode, as_tenant: dict[str, str], job: str) -> None:
    assert node.json("POST", "/v1/jobs", {"job": job, "goal": GOAL, "leaf_fan_in": LEAF_FAN_IN}, as_tenant)[0] == 201


def test_a_tenant_that_filled_the_node_gives_way_to_a_second_tenants_model_and_round(
        start_node: Callable[[int], RunningNode]) -> None:
    # B's model and round fit next to A's models
    assert (A_MODELS + 1) * UPDATE_BYTES + ROUND_FLOOR <= CAPACITY
    node = start_node(CAPACITY)
    rng = np.random.default_rng(11)
    a, b = tenant_token(node, "tenant-a"), tenant_token(node, "tenant-b")
    for i in range(A_MODELS):  # A alone: its models, then a round that takes what they leave
        create_job(node, a, f"a{i}")
        assert node.json("PUT", f"/v1/jobs/a{i}/model", fmt.encode(random_model(rng)), a)[0] == 201
    busy = [(random_model(rng), int(rng.integers(1, 100))) for _ in range(GOAL)]
    with held_round(node, "a0", busy) as (held, state):
        assert (state["in_progress"], state["rejected"]) == (A_ADMITTED, {"shm_exhausted": GOAL - A_ADMITTED})
        # B's model finds the node full of A's memory: told to retry, and counted as wanting memory
        create_job(node, b, "b")
        b_model = random_model(rng)
        status, headers, body = node.request("PUT", "/v1/jobs/b/model", bytes(fmt.encode(b_model)), b)
        assert (status, refusal_code(body)) == (503, "shm_exhausted") and float(headers["Retry-After"]) >= 1
    uploads = Uploads()
    outcomes = [h.finish() for h in held]
    for status, headers, body in outcomes:
        uploads.record("a0", status, headers, body)
    refused = [i for i, (s, _, _) in enumerate(outcomes) if s == 503]

    def model_in() -> bool:  # B retries its model as a client would, A's clients push meanwhile
        status, _, body = node.request("PUT", "/v1/jobs/b/model", bytes(fmt.encode(b_model)), b)
        assert status in (201, 503), body
        return status == 201

    with ThreadPoolExecutor(len(refused)) as pool:
        pushes = [pool.submit(deliver, node, uploads, "a0", f"c{i}", bytes(fmt.encode(busy[i][0])), busy[i][1], 0)
                  for i in refused]
        wait_for(model_in, timeout=300, interval=1.0, what="tenant B's model in")
        for push in pushes:
            push.result()
    check_round(node, "a0", 0, busy)  # A's round completed with exactly its acknowledged updates
    b_updates = [(random_model(rng), int(rng.integers(1, 100))) for _ in range(GOAL)]
    with ThreadPoolExecutor(GOAL) as pool:
        for push in [pool.submit(deliver, node, uploads, "b", f"c{i}", bytes(fmt.encode(u)), c, 0)
                     for i, (u, c) in enumerate(b_updates)]:
            push.result()
    check_round(node, "b", 0, b_updates)
    for job in ("a0", "b"):
        history = node.json("GET", f"/v1/jobs/{job}/rounds")[1]["rounds"]
        assert [(r["outcome"], r["updates"], r["lost"]) for r in history] == [("complete", GOAL, {})]


MODEL_BYTES = UPDATE_BYTES  # the model is shaped as the updates


@pytest.mark.parametrize("spare", [0, -1])
def test_a_job_whose_round_cannot_fit_in_its_tenants_shm_bytes_quota_is_refused_at_its_model(
        start_node: Callable[[int], RunningNode], redis_url: str, spare: int) -> None:
    """The quota bounds the tenant's model and a whole round, taken one leaf at a time: one byte
    short, the model is refused (nothing of the job can be acknowledged and then stranded); once
    the operator raises the quota, it goes in."""
    limit = MODEL_BYTES + ROUND_FLOOR + spare
    ClusterState(redis_url).set_quota("tenant-q", Quota(shm_bytes=limit))  # the agent reads quotas as it starts
    node = start_node(4 * CAPACITY)
    q = tenant_token(node, "tenant-q")
    create_job(node, q, "q")
    rng = np.random.default_rng(5)
    status, answer = node.json("PUT", "/v1/jobs/q/model", fmt.encode(random_model(rng)), q)
    if spare == 0:
        assert status == 201, answer
        run_round = [(random_model(rng), 1 + i) for i in range(GOAL)]
        gw = Gateway(node.http, token=OPERATOR_TOKEN, retry=RetryPolicy(max_attempts=10_000, max_elapsed_s=300.0))
        for i, (update, samples) in enumerate(run_round):  # a 429 (leaves folding) is retried by the SDK
            gw.push("q", fmt.encode(update), samples=samples, base_version=0, client=f"c{i}")
        gw.close()
        check_round(node, "q", 0, run_round)
        return
    error = answer["error"]
    assert (status, error["code"], error["needed"], error["available"]) == (422, "round_too_large", ROUND_FLOOR,
                                                                           ROUND_FLOOR - 1)
    assert "shm_bytes quota" in error["message"]
    ClusterState(redis_url).set_quota("tenant-q", Quota(shm_bytes=None))  # the agent refreshes it
    wait_for(lambda: node.json("PUT", "/v1/jobs/q/model", fmt.encode(random_model(rng)), q)[0] == 201,
             what="the model in once the quota is raised")
