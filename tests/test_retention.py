"""Retention policies (lifl.flstore.retention): parsing, and what stays in memory, queryable, evicted."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl.checkpoints import DirectoryStore
from lifl.errors import BadRequest
from lifl.flstore.retention import (
    MAX_KEEP, MAX_SELECTED_CLIENTS, MODEL, UPDATE, Held, RetentionPolicy, checkpoints_kept, in_memory, lru_victims,
    round_queryable, version_queryable,
)
from lifl.jobs import JobSpec
from lifl.net.loop import Loop
from lifl.node.metrics import Metrics
from lifl.node.retention import Retainer
from lifl.state import ClusterState
from lifl.store import ObjectStore, Tenant

TENANT = Tenant("acme", id=610001)


@pytest.mark.parametrize("body, expected", [
    (None, RetentionPolicy()),
    ({}, RetentionPolicy()),
    ({"models": 2}, RetentionPolicy(models=2)),
    ({"updates": 3, "history": 5}, RetentionPolicy(updates=3, history=5)),
    ({"clients": ["a", "b", "a"], "client_rounds": 4}, RetentionPolicy(clients=("a", "b"), client_rounds=4)),
    ({"models": MAX_KEEP}, RetentionPolicy(models=MAX_KEEP)),
])
def test_policies_parse(body: Any, expected: RetentionPolicy) -> None:
    policy = RetentionPolicy.from_request(body)
    assert policy == expected
    assert RetentionPolicy.from_json(policy.to_json()) == policy


@pytest.mark.parametrize("body, names", [
    ([], "JSON object"),
    ("models", "JSON object"),
    ({"model": 1}, "unknown retention field(s): model"),
    ({"models": -1}, "'models'"),
    ({"models": MAX_KEEP + 1}, "'models'"),
    ({"updates": 1.5}, "'updates'"),
    ({"history": True}, "'history'"),
    ({"history": "3"}, "'history'"),
    ({"clients": "a", "client_rounds": 1}, "'clients'"),
    ({"clients": ["x"] * (MAX_SELECTED_CLIENTS + 1), "client_rounds": 1}, "'clients'"),
    ({"clients": ["has space"], "client_rounds": 1}, "not a client id"),
    ({"clients": [""], "client_rounds": 1}, "not a client id"),
    ({"clients": [7], "client_rounds": 1}, "not a client id"),
    ({"clients": ["\x00"], "client_rounds": 1}, "not a client id"),
    ({"clients": ["a" * 257], "client_rounds": 1}, "not a client id"),
    ({"clients": ["a"]}, "needs 'client_rounds'"),
])
def test_malformed_policies_are_refused_naming_the_problem(body: Any, names: str) -> None:
    with pytest.raises(BadRequest) as e:
        RetentionPolicy.from_request(body)
    assert e.value.code == "bad_retention" and names in e.value.message


def test_a_job_takes_its_policy_and_architecture_at_creation() -> None:
    spec = JobSpec.from_request({"job": "j", "goal": 2, "retention": {"updates": 2}, "architecture": "cnn"})
    assert spec.retention_policy == RetentionPolicy(updates=2) and spec.architecture == "cnn"
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(BadRequest, match="architecture"):
        JobSpec.from_request({"job": "j", "goal": 2, "architecture": "vgg"})
    with pytest.raises(BadRequest, match="retention"):
        JobSpec.from_request({"job": "j", "goal": 2, "retention": {"updates": -1}})


MODELS2 = RetentionPolicy(models=2)
UPDATES1 = RetentionPolicy(updates=1, history=3)
CLIENT_A = RetentionPolicy(clients=("a",), client_rounds=3)


@pytest.mark.parametrize("policy, held, newest_round, newest_version, kept", [
    (MODELS2, Held(MODEL, 5), 9, 5, True),  # the current model
    (MODELS2, Held(MODEL, 4), 9, 5, True),
    (MODELS2, Held(MODEL, 3), 9, 5, False),
    (MODELS2, Held(UPDATE, 9, "a"), 9, 5, False),
    (UPDATES1, Held(UPDATE, 9, "a"), 9, 5, True),
    (UPDATES1, Held(UPDATE, 10, "a"), 9, 5, True),  # the round in progress
    (UPDATES1, Held(UPDATE, 8, "a"), 9, 5, False),  # queryable (history 3) but in the store only
    (UPDATES1, Held(MODEL, 5), 9, 5, False),
    (CLIENT_A, Held(UPDATE, 7, "a"), 9, 5, True),
    (CLIENT_A, Held(UPDATE, 6, "a"), 9, 5, False),
    (CLIENT_A, Held(UPDATE, 9, "b"), 9, 5, False),
    (RetentionPolicy(), Held(UPDATE, 9, "a"), 9, 5, False),
])
def test_what_stays_in_memory(policy: RetentionPolicy, held: Held, newest_round: int, newest_version: int,
                              kept: bool) -> None:
    assert in_memory(policy, held, newest_round, newest_version) is kept


@pytest.mark.parametrize("policy, round_id, newest, queryable", [
    (UPDATES1, 9, 9, True), (UPDATES1, 7, 9, True), (UPDATES1, 6, 9, False), (UPDATES1, 10, 9, True),
    (RetentionPolicy(), 9, 9, False), (MODELS2, 9, 9, False),  # models alone keep no update
    (CLIENT_A, 7, 9, True), (CLIENT_A, 6, 9, False),
])
def test_which_rounds_are_queryable(policy: RetentionPolicy, round_id: int, newest: int, queryable: bool) -> None:
    assert round_queryable(policy, round_id, newest) is queryable


@pytest.mark.parametrize("policy, version, newest, queryable", [
    (UPDATES1, 5, 5, True), (UPDATES1, 2, 5, True), (UPDATES1, 1, 5, False), (UPDATES1, 6, 5, False),
    (RetentionPolicy(), 5, 5, True), (RetentionPolicy(), 4, 5, False),
    (MODELS2, 4, 5, True), (MODELS2, 3, 5, False), (RetentionPolicy(models=5, history=1), 1, 5, True),
])
def test_which_versions_are_queryable(policy: RetentionPolicy, version: int, newest: int, queryable: bool) -> None:
    assert version_queryable(policy, version, newest) is queryable


@pytest.mark.parametrize("policy, kept", [(RetentionPolicy(), 3), (UPDATES1, 4), (RetentionPolicy(history=10), 11),
                                          (RetentionPolicy(models=8), 8)])
def test_checkpoints_kept_cover_every_queryable_version(policy: RetentionPolicy, kept: int) -> None:
    assert checkpoints_kept(policy, 3) == kept


@pytest.mark.parametrize("policy, client, kept", [
    (RetentionPolicy(), "a", False), (MODELS2, "a", False), (UPDATES1, "a", True), (RetentionPolicy(history=1), "a", True),
    (CLIENT_A, "a", True), (CLIENT_A, "b", False),
])
def test_which_updates_are_retained_at_all(policy: RetentionPolicy, client: str, kept: bool) -> None:
    assert policy.keeps_update(client) is kept


@pytest.mark.parametrize("held, budget, victims", [
    ([(1.0, 10, "a"), (2.0, 10, "b"), (3.0, 10, "c")], 30, []),
    ([(1.0, 10, "a"), (2.0, 10, "b"), (3.0, 10, "c")], 29, ["a"]),
    ([(3.0, 10, "a"), (2.0, 10, "b"), (1.0, 10, "c")], 15, ["c", "b"]),
    ([(1.0, 50, "big"), (2.0, 10, "small")], 10, ["big"]),
    ([(1.0, 10, "a")], 0, ["a"]),
    ([], 0, []),
])
def test_budget_evicts_least_recently_used_first(held: list[tuple[float, int, str]], budget: int,
                                                 victims: list[str]) -> None:
    assert lru_victims(held, budget) == victims


def test_an_update_the_round_let_go_of_is_fetched_back_not_fatal(shm_node: str, state: ClusterState, tmp_path: Path) -> None:
    """The tree discards an update it will not aggregate (one of a round already over here)
    whoever holds it, retention included: the next pass of the policy does not fail on the
    object that is gone; it fetches the update back from its copy, as after an eviction."""
    store = ObjectStore(shm_node, capacity=16 << 20, pool_limit=8 << 20)
    state.create_job(JobSpec("kept", goal=2, retention=RetentionPolicy.from_request({"updates": 1}).to_dict()))
    loop = Loop("test")  # the store is the loop's, as in the agent: the test touches it there too
    loop.start()
    retainer = Retainer(shm_node, store, state, DirectoryStore(tmp_path), Metrics(), loop.call, budget=8 << 20)
    try:
        blobs = {client: fmt.encode({"w": np.full(1000, i, np.float32)}) for i, client in enumerate("ab")}
        keys = {}
        for client, blob in blobs.items():
            def upload(client: str = client, blob: bytes = blob) -> bytes:
                seg = store.create(TENANT, len(blob), "upload")
                with mmap.mmap(seg.fd, len(blob)) as mm:
                    mm[:] = blob
                store.seal(seg.key)
                retainer.keep_update("kept", TENANT, seg.key, 0, 0, client, 1)
                store.release(seg.key, "upload")
                return seg.key

            keys[client] = loop.call(upload)
        wait_for(lambda: loop.call(lambda: all(i.stored for i in retainer.items.values())), what="both updates written behind")
        loop.call(lambda: store.discard(keys["a"]))
        retainer.apply("kept")  # off the loop, as the agent's duty runs it
        for client, blob in blobs.items():
            key = loop.call(lambda client=client: retainer.items[("kept", UPDATE, 0, client)].key)
            assert key is not None and (key == keys[client]) == (client == "b")
            with mmap.mmap(loop.call(lambda key=key: store.get(key).fd), len(blob), prot=mmap.PROT_READ) as mm:
                assert mm[:] == blob
    finally:
        retainer.stop()
        loop.call(store.close)
        loop.stop()
