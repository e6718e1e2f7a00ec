"""Rounds of a job whose shards are split across nodes (lifl.shards.split_record): the Redis
scripts that join an update's parts by client, count it once all its parts are in, and install
the next version once every node has its part (a real redis-server)."""

from __future__ import annotations

import pytest

from lifl import shards
from lifl.format import F32, ModelSpec, TensorSpec
from lifl.jobs import JobSpec
from lifl.state import (
    ACCEPT_CLOSED_ROUND, ACCEPT_COUNTED, ACCEPT_DUPLICATE, ACCEPT_UPDATE_GONE, RESERVE_FULL, RESERVE_NO_CLIENT, RESERVE_OK,
    RESERVE_UPDATE_GONE, ClusterState, part_given_up, refusal,
)

MODEL = ModelSpec((TensorSpec("w", F32, (1000,)),))
NODES = ("a", "b")


@pytest.fixture
def cluster(state: ClusterState) -> ClusterState:
    state.create_job(JobSpec("j", goal=2, shards=4))
    record = shards.split_record(4, shards.ELEMENT, MODEL, 1 << 30, ["b", "a"])
    state.next_round("j", -1, 0, key="00", node="a", spec=MODEL, parts=record)
    return state


def reserve(state: ClusterState, node: str, client: str, token: str) -> int:
    return state.reserve("j", 0, node, client=client, token=token)[0]


def accept(state: ClusterState, node: str, client: str, token: str) -> int:
    return state.accept("j", 0, node, client=client, token=token)[0]


def test_the_job_records_its_parts_and_every_reader_derives_the_same() -> None:
    record = shards.split_record(4, shards.ELEMENT, MODEL, 1 << 30, ["b", "a"])
    plan, parts = shards.parts_of(MODEL, record)
    assert [(p.node, p.first, p.stop) for p in parts] == [("a", 0, 2), ("b", 2, 4)]
    assert plan == shards.plan(MODEL, 4)
    assert shards.split_record(4, shards.ELEMENT, MODEL, 1 << 30, ["a"]) == ""  # one node: nothing to split
    assert shards.split_record(1, shards.ELEMENT, MODEL, 1 << 30, ["a", "b"]) == ""  # one shard: nothing either


def test_an_update_counts_once_every_part_is_in_and_the_goal_closes_the_round(cluster: ClusterState) -> None:
    job = cluster.job("j")
    assert job.part_of("a") is not None and job.part_of("b") is not None and job.part_of("c") is None
    assert [reserve(cluster, n, "c1", f"c1{n}") for n in NODES] == [RESERVE_OK, RESERVE_OK]
    assert [reserve(cluster, n, "c2", f"c2{n}") for n in NODES] == [RESERVE_OK, RESERVE_OK]
    assert cluster.job("j").reserved == 2  # one slot per update, whatever its parts
    assert reserve(cluster, "a", "c3", "c3a") == RESERVE_FULL
    assert accept(cluster, "a", "c1", "c1a") == ACCEPT_COUNTED and cluster.job("j").accepted == 0  # a part only
    assert accept(cluster, "b", "c1", "c1b") == ACCEPT_COUNTED and cluster.job("j").accepted == 1
    assert accept(cluster, "b", "c2", "c2b") == ACCEPT_COUNTED
    assert accept(cluster, "b", "c2", "c2b") == ACCEPT_COUNTED  # sent again: the same answer, counted once
    assert accept(cluster, "a", "c2", "c2a") == ACCEPT_CLOSED_ROUND
    s = cluster.shard("j")
    assert s.finalized and s.counts == {"a": 2, "b": 2} and s.inflight == {"a": 0, "b": 0}  # every node has every update


def test_a_client_is_needed_to_join_parts(cluster: ClusterState) -> None:
    assert reserve(cluster, "a", "", "t") == RESERVE_NO_CLIENT
    assert refusal(RESERVE_NO_CLIENT, "j", 0, 0, 2).code == "client_required"


def test_a_part_given_up_before_any_is_acknowledged_takes_its_update_out_and_frees_the_slot(cluster: ClusterState) -> None:
    assert [reserve(cluster, n, "c1", f"c1{n}") for n in NODES] == [RESERVE_OK, RESERVE_OK]
    assert cluster.give_back("j", "a", [("c1a", 0, "truncated")]) == 1
    job = cluster.job("j")
    assert job.reserved == 0 and job.rejected == {"truncated": 1} and not job.parts_lost
    assert accept(cluster, "b", "c1", "c1b") == ACCEPT_UPDATE_GONE  # its other part arrives: refused
    assert reserve(cluster, "a", "c1", "c1a2") == RESERVE_UPDATE_GONE  # and it may not come back this round
    assert part_given_up("j", 0, 0).code == "update_given_up"
    assert cluster.give_back("j", "b", [("c1b", 0, "")]) == 0  # its slot went already
    assert cluster.job("j").reserved == 0 and cluster.shard("j").inflight == {"a": 0, "b": 0}
    for client in ("c2", "c3"):  # the slot went to another client
        assert [reserve(cluster, n, client, f"{client}{n}") for n in NODES] == [RESERVE_OK, RESERVE_OK]
        assert [accept(cluster, n, client, f"{client}{n}") for n in NODES][-1] in (ACCEPT_COUNTED, ACCEPT_CLOSED_ROUND)
    assert cluster.shard("j").finalized and cluster.shard("j").counts == {"a": 2, "b": 2}


def test_a_part_given_up_after_another_was_acknowledged_loses_the_round(cluster: ClusterState) -> None:
    assert [reserve(cluster, n, "c1", f"c1{n}") for n in NODES] == [RESERVE_OK, RESERVE_OK]
    assert accept(cluster, "a", "c1", "c1a") == ACCEPT_COUNTED
    assert cluster.give_back("j", "b", [("c1b", 0, "truncated")]) == 1
    assert "client c1 on node b" in cluster.job("j").parts_lost
    assert cluster.part_installed("j", 0, "a") == -1  # nothing of this round may install
    cluster.next_round("j", 0, 0)  # abandoned: the next round opens on the same version, whole
    assert not cluster.job("j").parts_lost and cluster.job("j").parts  # the parts stay the job's


def test_a_part_sent_twice_counts_once_and_the_second_giving_back_changes_nothing(cluster: ClusterState) -> None:
    assert [reserve(cluster, "a", "c1", t) for t in ("first", "second")] == [RESERVE_OK, RESERVE_OK]
    assert cluster.job("j").reserved == 1
    assert accept(cluster, "a", "c1", "first") == ACCEPT_COUNTED
    assert accept(cluster, "a", "c1", "second") == ACCEPT_DUPLICATE
    assert cluster.give_back("j", "a", [("second", 0, "")]) == 0  # decided: no slot left to give
    job = cluster.job("j")
    assert job.reserved == 1 and not job.parts_lost and cluster.shard("j").counts == {"a": 1}


def test_the_version_installs_once_every_node_has_its_part(cluster: ClusterState) -> None:
    assert cluster.part_installed("j", 0, "a") == 1
    assert cluster.part_installed("j", 0, "a") == 0  # said before
    assert cluster.part_installed("j", 1, "b") == -1  # another round
    assert cluster.part_installed("j", 0, "b") == 2  # the last: b installs the version
    cluster.next_round("j", 0, 1)
    assert cluster.job("j").version == 1 and cluster.part_installed("j", 1, "a") == 1  # a new round counts anew
