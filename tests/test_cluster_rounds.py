"""Global rounds: the cluster-wide duties (a pure function, tables) and the Redis scripts that carry
them out atomically (a real redis-server), including nodes racing for the last slot."""

from __future__ import annotations

import threading

import pytest

from lifl import shards
from lifl.cluster_types import Job, SecureRound, Shard
from lifl.control.rounds import AbandonRound, AdvanceSecureStage, CloseAtDeadline, DeclareLost, PlaceTop, duties
from lifl.format import F32, ModelSpec, TensorSpec
from lifl.jobs import JobSpec
from lifl.secagg_round import ABANDONED, ADVERTISE, COLLECT, CONSISTENCY, DONE, SHARE, UNMASK
from lifl.state import (
    ACCEPT_CLOSED_ROUND, ACCEPT_COUNTED, ACCEPT_FENCED, ACCEPT_ROUND_CLOSED, CLOSE_ABANDON, CLOSE_FINAL, RESERVE_FULL,
    RESERVE_OK, ClusterState,
)

SPEC = JobSpec("j", goal=4, round_deadline_s=10.0, min_updates=2)


def job(**changes) -> Job:
    values = dict(spec=SPEC, version=3, round=7, round_opened=100.0, closed=False, model_key="", model_node="a",
                  model_spec=None, reserved=0, accepted=0, aggregated=0, rejected={}, last_round=None, checkpoint=3)
    return Job(**{**values, **changes})


def shard(**changes) -> Shard:
    values = dict(round=7, finalized=False, counts={}, top=None, epoch=0, delivered=frozenset(), dead=frozenset(),
                  lost={}, plan=None)
    return Shard(**{**values, **changes})


@pytest.mark.parametrize("j,s,now,live,expected", [
    (job(version=-1), shard(), 200.0, {"a"}, []),  # no model yet
    (job(), shard(round=8), 200.0, {"a"}, []),  # the next round is being opened
    (job(accepted=2, reserved=2), shard(counts={"a": 1, "b": 1}), 105.0, {"a", "b"}, []),  # nothing due
    (job(accepted=2, reserved=3), shard(counts={"a": 1, "b": 1}, inflight={"c": 1}), 105.0, {"a"},
     [DeclareLost(7, "b"), DeclareLost(7, "c")]),  # dead with updates, or with uploads in progress
    (job(accepted=2, reserved=2), shard(counts={"a": 1, "b": 1}, dead=frozenset({"b"})), 105.0, {"a"}, []),  # handled
    (job(accepted=1, reserved=1), shard(counts={"a": 1}), 110.0, {"a"}, [CloseAtDeadline(7, 2)]),
    (job(accepted=1, reserved=1, closed=True), shard(counts={"a": 1}), 111.0, {"a"},
     [AbandonRound(7, "abandoned", "deadline passed with 1 of the 2 updates needed")]),
    (job(accepted=3, closed=True), shard(finalized=True, counts={"a": 0}, lost={"b": 3}), 105.0, {"a"},
     [AbandonRound(7, "abandoned", "every update of the round was lost with node(s) b")]),
    (job(accepted=4, closed=True), shard(finalized=True, counts={"a": 1, "b": 3}), 105.0, {"a", "b"},
     [PlaceTop(7, 0, "b")]),  # the node with the most updates
    (job(accepted=4, closed=True), shard(finalized=True, counts={"a": 1, "b": 3}, plan={"top": "a"}), 105.0,
     {"a", "b"}, [PlaceTop(7, 0, "a")]),  # the planned top, since it has updates
    (job(accepted=4, closed=True), shard(finalized=True, counts={"a": 1, "b": 3}, top="b"), 105.0, {"a", "b"}, []),
    (job(accepted=4, closed=True), shard(finalized=True, counts={"a": 1, "b": 3}, top="b"), 105.0, {"a"},
     [DeclareLost(7, "b")]),  # the top's node died
    (job(), shard(lost={"a": 2}), 105.0, {"a"}, [AbandonRound(7, "interrupted", "its updates were lost with node(s) a")]),
    (job(reserved=1), shard(lost={"a": 2}, inflight={"b": 1}), 105.0, {"a", "b"}, []),  # an upload is on its way
])
def test_round_duties(j: Job, s: Shard, now: float, live: set[str], expected: list) -> None:
    assert duties(j, s, now, live) == expected


SECURE = JobSpec("j", goal=8, fixed_point={"frac_bits": 16, "width": 64}, secure_aggregation={"stage_timeout_s": 5.0})


def secure(stage: str, *, round_id: int = 7, deadline_s: float = 110.0, why: str = "") -> SecureRound:
    return SecureRound("j", round_id, stage, b"seed", int(deadline_s * 1000), 8, 4, 3, 5, why)


@pytest.mark.parametrize("j,s,now,sa,expected", [
    (job(spec=SECURE), shard(), 200.0, None, []),  # nobody advertised yet: no deadline runs
    (job(spec=SECURE), shard(), 200.0, secure(SHARE, round_id=6), []),  # last round's
    (job(spec=SECURE), shard(), 105.0, secure(ADVERTISE), []),
    (job(spec=SECURE), shard(), 110.0, secure(ADVERTISE), [AdvanceSecureStage(7)]),
    (job(spec=SECURE, reserved=2, accepted=2), shard(counts={"a": 2}), 110.0, secure(COLLECT), [AdvanceSecureStage(7)]),
    (job(spec=SECURE, accepted=3), shard(counts={"a": 3}), 105.0, secure(CONSISTENCY), [CloseAtDeadline(7, 3)]),
    (job(spec=SECURE, accepted=3), shard(counts={"a": 3}), 105.0, secure(UNMASK), [CloseAtDeadline(7, 3)]),
    (job(spec=SECURE, accepted=3, closed=True), shard(finalized=True, counts={"a": 3}, top="a"), 110.0, secure(CONSISTENCY),
     [AdvanceSecureStage(7)]),  # its survivors' signatures are due
    (job(spec=SECURE, accepted=3, closed=True), shard(finalized=True, counts={"a": 3}), 105.0, secure(UNMASK),
     [PlaceTop(7, 0, "a")]),  # the top folds, then waits for the unmasking
    (job(spec=SECURE, accepted=3, closed=True), shard(finalized=True, counts={"a": 3}, top="a"), 120.0, secure(DONE), []),
    (job(spec=SECURE, accepted=2, closed=True), shard(counts={"a": 2}), 105.0, secure(UNMASK),
     [AbandonRound(7, "abandoned", "2 masked inputs arrived, fewer than the threshold of 3")]),
    (job(spec=SECURE, accepted=3, closed=True), shard(finalized=True, counts={"a": 3}, top="a"), 105.0,
     secure(ABANDONED, why="2 clients' secrets have fewer than 3 shares"),
     [AbandonRound(7, "abandoned", "2 clients' secrets have fewer than 3 shares")]),
])
def test_secure_round_duties(j: Job, s: Shard, now: float, sa: SecureRound | None, expected: list) -> None:
    assert duties(j, s, now, {"a"}, sa) == expected


MODEL = ModelSpec((TensorSpec("w", F32, (1000,)),))
PARTS = shards.split_record(4, shards.ELEMENT, MODEL, 1 << 30, ["a", "b"])


def split(**changes) -> Job:
    return job(model_spec=MODEL, parts=PARTS, **changes)


@pytest.mark.parametrize("j,s,now,live,expected", [
    (split(), shard(), 105.0, {"a", "b"}, []),  # nothing under way
    (split(), shard(), 105.0, {"a"}, []),  # a node died, but the round holds nothing yet
    (split(reserved=1), shard(inflight={"a": 1, "b": 1}), 105.0, {"a", "b"}, []),
    (split(reserved=1), shard(inflight={"a": 1}), 105.0, {"a"},  # a node holding shards died: no version can be whole
     [AbandonRound(7, "interrupted", "node(s) b holding shards of the round died")]),
    (split(accepted=4, closed=True), shard(finalized=True, counts={"a": 4, "b": 4}), 105.0, {"a", "b"}, []),  # no top to place
    (split(accepted=4, closed=True), shard(finalized=True, counts={"a": 4, "b": 4}, installed=frozenset({"b"})),
     105.0, {"a"}, []),  # b died with its part of the next version durable: the round still completes
    (split(accepted=4, closed=True), shard(finalized=True, counts={"a": 4, "b": 4}, installed=frozenset({"a"})),
     105.0, {"a"}, [AbandonRound(7, "interrupted", "node(s) b holding shards of the round died")]),
    (split(reserved=2, parts_lost="a part of the update of client c1 on node b was given up"), shard(), 105.0, {"a", "b"},
     [AbandonRound(7, "interrupted", "a part of the update of client c1 on node b was given up")]),
    (split(spec=SPEC, accepted=1), shard(counts={"a": 1, "b": 1}), 110.0, {"a", "b"}, [CloseAtDeadline(7, 2)]),
    (split(spec=SPEC, accepted=1, closed=True), shard(counts={"a": 1, "b": 1}), 111.0, {"a", "b"},
     [AbandonRound(7, "abandoned", "deadline passed with 1 whole updates of the 2 needed, or with parts of updates missing")]),
])
def test_split_round_duties(j: Job, s: Shard, now: float, live: set[str], expected: list) -> None:
    assert duties(j, s, now, live) == expected


def test_a_split_round_closes_at_its_deadline_with_whole_updates_only(state: ClusterState) -> None:
    state.create_job(JobSpec("j", goal=4, shards=4, round_deadline_s=10.0, min_updates=1))
    state.next_round("j", -1, 0, key="00", node="a", spec=MODEL, parts=PARTS)
    for node in ("a", "b"):
        assert state.reserve("j", 0, node, client="c1", token=f"c1{node}")[0] == RESERVE_OK
        state.accept("j", 0, node, client="c1", token=f"c1{node}")
    assert state.reserve("j", 0, "a", client="c2", token="c2a")[0] == RESERVE_OK
    state.accept("j", 0, "a", client="c2", token="c2a")  # c2's part on b never comes
    assert state.close_round("j", 0, 1) == CLOSE_ABANDON  # a's partial sums hold part of c2: abandoned
    state.next_round("j", 0, 0)
    for node in ("a", "b"):
        assert state.reserve("j", 0, node, client="c1", token=f"again{node}")[0] == RESERVE_OK
        state.accept("j", 1, node, client="c1", token=f"again{node}")
    assert state.close_round("j", 1, 1) == CLOSE_FINAL  # whole updates only: closes with them
    assert state.shard("j").counts == {"a": 1, "b": 1}


@pytest.fixture
def cluster(state: ClusterState) -> ClusterState:
    state.create_job(JobSpec("j", goal=4))
    state.next_round("j", -1, 0, key="00", node="a")  # the model is set: round 0 opens
    return state


def admit(state: ClusterState, node: str) -> int:
    status, _, round_id = state.reserve("j", 0, node)
    assert status == RESERVE_OK
    return round_id


def test_each_acknowledged_update_counts_once_whichever_node_took_it(cluster: ClusterState) -> None:
    results = [cluster.accept("j", admit(cluster, n), n)[0] for n in ("a", "b", "a")]
    assert results == [ACCEPT_COUNTED] * 3 and cluster.shard("j").counts == {"a": 2, "b": 1}
    assert cluster.accept("j", admit(cluster, "c"), "c")[0] == ACCEPT_CLOSED_ROUND  # the goal: closed, counts final
    s = cluster.shard("j")
    assert s.finalized and s.counts == {"a": 2, "b": 1, "c": 1} and s.inflight == {"a": 0, "b": 0, "c": 0}
    assert cluster.reserve("j", 0, "a")[0] == RESERVE_FULL
    assert cluster.accept("j", 0, "a")[0] == ACCEPT_ROUND_CLOSED


def test_nodes_racing_for_the_last_slots_fill_the_goal_exactly(state: ClusterState) -> None:
    state.create_job(JobSpec("r", goal=7))
    state.next_round("r", -1, 0, key="00", node="a")
    outcomes: list[tuple[str, int]] = []
    lock = threading.Lock()
    start = threading.Barrier(24)

    def client(i: int) -> None:
        node = "abc"[i % 3]
        mine = ClusterState(state.url)
        start.wait()
        status, _, round_id = mine.reserve("r", 0, node)
        result = mine.accept("r", round_id, node)[0] if status == RESERVE_OK else status
        with lock:
            outcomes.append((node, result))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [r for _, r in outcomes]
    assert results.count(ACCEPT_CLOSED_ROUND) == 1 and results.count(ACCEPT_COUNTED) == 6
    assert results.count(RESERVE_FULL) == 17
    s = state.shard("r")
    assert s.finalized and s.total == 7 and state.job("r").accepted == 7
    for node in "abc":  # every node's final count is what it was told it acknowledged
        assert s.counts.get(node, 0) == sum(1 for n, r in outcomes if n == node and r in (ACCEPT_COUNTED, ACCEPT_CLOSED_ROUND))


def test_a_dead_node_loses_what_it_acknowledged_and_its_slots_reopen(cluster: ClusterState) -> None:
    for n in ("a", "b", "b"):
        cluster.accept("j", admit(cluster, n), n)
    admit(cluster, "b")  # an upload in progress on b when it dies
    loss = cluster.node_lost("j", 0, "b")
    assert (loss.handled, loss.remaining, loss.closed, loss.top_lost) == (True, 1, False, False)
    assert cluster.node_lost("j", 0, "b").handled is False  # once only
    j, s = cluster.job("j"), cluster.shard("j")
    assert (j.accepted, j.reserved) == (1, 1) and s.lost == {"b": 2} and s.counts["b"] == 0 and "b" in s.dead
    assert cluster.accept("j", 0, "b")[0] == ACCEPT_FENCED  # a zombie b takes no part in this round
    for n in ("a", "c", "c"):  # the round still completes, on the others
        result = cluster.accept("j", admit(cluster, n), n)[0]
    assert result == ACCEPT_CLOSED_ROUND and cluster.shard("j").counts == {"a": 2, "b": 0, "c": 2}


def test_a_result_delivered_to_the_top_survives_its_node(cluster: ClusterState) -> None:
    for n in ("a", "a", "b", "c"):
        cluster.accept("j", admit(cluster, n), n)
    assert cluster.set_top("j", 0, 0, "a") and not cluster.set_top("j", 0, 0, "b")  # once per epoch
    assert cluster.delivered("j", 0, "b", 0) == 1 and cluster.delivered("j", 0, "b", 0) == 0
    assert cluster.delivered("j", 0, "c", 5) == -1  # another epoch's
    cluster.node_lost("j", 0, "b")
    cluster.node_lost("j", 0, "c")
    s = cluster.shard("j")
    assert s.counts == {"a": 2, "b": 1, "c": 0} and s.lost == {"c": 1}  # b's partial had arrived, c's had not


def test_when_the_top_dies_what_it_received_from_dead_nodes_is_lost_and_the_epoch_moves(cluster: ClusterState) -> None:
    for n in ("a", "a", "b", "c"):
        cluster.accept("j", admit(cluster, n), n)
    cluster.set_top("j", 0, 0, "a")
    cluster.delivered("j", 0, "b", 0)
    cluster.delivered("j", 0, "c", 0)
    cluster.node_lost("j", 0, "c")  # c's partial is safe at a...
    loss = cluster.node_lost("j", 0, "a")  # ...until a dies: survivors resend, c cannot
    s = cluster.shard("j")
    assert loss.top_lost and loss.remaining == 1 and s.top is None and s.epoch == 1
    assert s.counts == {"a": 0, "b": 1, "c": 0} and s.lost == {"a": 2, "c": 1} and s.delivered == frozenset()
    assert cluster.set_top("j", 0, 1, "b")


def test_deadline_closes_with_what_arrived_or_marks_the_round_for_abandoning(state: ClusterState) -> None:
    for name in ("x", "y"):
        state.create_job(JobSpec(name, goal=4, round_deadline_s=1.0, min_updates=2))
        state.next_round(name, -1, 0, key="00", node="a")
    for n in ("a", "b"):
        state.reserve("x", 0, n)
        state.accept("x", 0, n)
    state.reserve("y", 0, "a")
    state.accept("y", 0, "a")
    assert state.close_round("x", 0, 2) == CLOSE_FINAL and state.shard("x").finalized
    assert state.close_round("y", 0, 2) == CLOSE_ABANDON and not state.shard("y").finalized and state.job("y").closed
    assert state.close_round("x", 0, 2) == -1


def test_assignments_follow_the_plan_and_stick(cluster: ClusterState) -> None:
    cluster.set_plan("j", 0, {"policy": "bestfit", "quotas": [["b", 2], ["a", 1]], "top": "b"})
    assert not cluster.set_plan("j", 0, {"policy": "worstfit", "quotas": [], "top": None})  # first writer wins
    live = ["a", "b", "c"]
    got = [cluster.assign("j", 0, f"c{i}", live) for i in range(4)]
    assert got == ["b", "b", "a", "c"]  # quotas in order, then the least-assigned node
    assert cluster.assign("j", 0, "c0", live) == "b"  # sticky within the round
    assert cluster.assign("j", 0, "c0", ["a", "c"]) == "a"  # unless its node is gone
    assert cluster.assign("j", 5, "c9", live) is None  # another round's


def test_least_connection_spreads_clients(state: ClusterState) -> None:
    state.create_job(JobSpec("lc", goal=6))
    state.next_round("lc", -1, 0, key="00", node="a")
    state.set_plan("lc", 0, {"policy": "least_connection", "quotas": [["a", 3], ["b", 3]], "top": "a"})
    assert [state.assign("lc", 0, f"c{i}", ["a", "b", "c"]) for i in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_the_controller_plans_only_for_the_jobs_it_is_given(state: ClusterState) -> None:
    from lifl.control.controller import ControlConfig, Controller

    for name, tenant in (("kept", "t1"), ("gone", "t2")):
        state.create_job(JobSpec(name, goal=4, tenant=tenant, leaf_fan_in=2))
        state.next_round(name, -1, 0, key="00", node="a")
        for i in range(4):  # four clients training for node a: two leaves' worth each
            assert state.assign(name, 0, f"c{i}", ["a"]) == "a"
    controller = Controller(state, "a", ControlConfig())
    assert controller.tick()  # the agents' way: every job, published for the nodes
    assert state.warm_plan() == {"a": {"t1": 2, "t2": 2}}
    # the operator's way: only the jobs that still have an FLJob ("gone" was deleted)
    assert controller.plan(only={"kept", "no-such-job"})[0] == {"a": {"t1": 2}}
    assert controller.plan(only=set())[0] == {}
    assert state.warm_plan() == {"a": {"t1": 2, "t2": 2}}  # planning alone publishes nothing


def test_the_controller_keeps_a_tree_warm_per_tensor_shard(state: ClusterState) -> None:
    from lifl.control.controller import ControlConfig, Controller

    model = ModelSpec((TensorSpec("w", F32, (300,)),))
    for name, count in (("whole", 1), ("sharded", 3)):
        state.create_job(JobSpec(name, goal=4, tenant=name, leaf_fan_in=2, shards=count))
        state.next_round(name, -1, 0, key="00", node="a", spec=model)
        for i in range(4):
            assert state.assign(name, 0, f"c{i}", ["a"]) == "a"
    warm = Controller(state, "a", ControlConfig()).plan()[0]
    assert warm == {"a": {"whole": 2, "sharded": 6}}  # two leaves in each of three shards
