"""The cluster state's answers when Redis stalls: calls fail fast with 503 instead of hanging,
membership survives a store that stalled, late commands do nothing, and the slots a node holds
are reconciled with Redis (lifl.redisconn, lifl.net.resp.Outage, lifl.state, lifl.node.uploads.Slots)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from conftest import wait_for
from lifl.errors import Unavailable
from lifl.jobs import JobSpec
from lifl.net.loop import Loop
from lifl.net.resp import PROBE_EVERY_S, Outage
from lifl.node.agent import Batches
from lifl.node.uploads import RECONCILE_PASSES, Slots
from lifl.protocol import InstanceCounts, NodeStatus, SharedMemory
from lifl.redisconn import DEFAULT_STATE_TIMEOUT_S, MAX_STATE_TIMEOUT_S, STATE_TIMEOUT_ENV, state_timeout
from lifl.state import NODE_FORGET_S, NODE_TTL, NODES_SEEN, STORE_PULSE, STORE_STALL_S, ClusterState, ScriptCall


# -- the timeout --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("", DEFAULT_STATE_TIMEOUT_S), ("0.5", 0.5), ("2", 2.0),
                                            (str(MAX_STATE_TIMEOUT_S), MAX_STATE_TIMEOUT_S)])
def test_state_timeout_is_read_from_the_environment(text: str, expected: float) -> None:
    assert state_timeout({STATE_TIMEOUT_ENV: text}) == expected


@pytest.mark.parametrize("text", ["0", "-1", "abc", "nan", "inf", "1e9", str(MAX_STATE_TIMEOUT_S + 0.001), "1 s"])
def test_a_bad_state_timeout_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match=STATE_TIMEOUT_ENV):
        state_timeout({STATE_TIMEOUT_ENV: text})


def test_the_default_answers_within_two_seconds() -> None:
    assert DEFAULT_STATE_TIMEOUT_S < 2.0


# -- the outage book ----------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("steps, expected", [
    ([], [True]),  # nothing known: every call goes
    (["failed"], [False]),  # known down: calls fail at once...
    (["failed", ("wait", PROBE_EVERY_S)], [True, False]),  # ...but one per PROBE_EVERY_S finds out
    (["failed", ("wait", PROBE_EVERY_S), "answered"], [True, True]),  # it answered: back to normal
    (["failed", ("wait", PROBE_EVERY_S / 2)], [False]),
    (["failed", "answered", "failed"], [False]),
])
def test_outage_table(steps: list, expected: list[bool]) -> None:
    clock = Clock()
    outage = Outage(clock)
    for step in steps:
        if step == "failed":
            outage.failed()
        elif step == "answered":
            outage.answered()
        else:
            clock.now += step[1]
    assert [outage.admits() for _ in expected] == expected


# -- a frozen redis-server ----------------------------------------------------------------------
@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A redis-server of this test's alone (it is frozen and killed)."""
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"unix://{sock}"
    wait_for(lambda: _answers(url), what="redis-server up")
    yield url, proc
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url).ping())
    except redis.RedisError:
        return False


def test_a_frozen_store_is_unavailable_once_and_then_at_once_until_it_answers(own_redis) -> None:
    url, proc = own_redis
    state = ClusterState(url)
    state.create_job(JobSpec(job="j", goal=2))
    os.kill(proc.pid, signal.SIGSTOP)
    with pytest.raises(Unavailable, match="Timeout") as first:  # no answer in time, and not sent again
        state.version("j")
    assert first.value.code == "state_unavailable" and first.value.retry_after
    with pytest.raises(Unavailable, match="did not answer the last call"):  # no I/O: the outage is known
        state.version("j")
    os.kill(proc.pid, signal.SIGCONT)
    assert wait_for(lambda: _version_or_none(state, "j") is not None, what="the store answering again") is not None


def _version_or_none(state: ClusterState, job: str) -> int | None:
    try:
        return state.version(job)
    except Unavailable:
        return None


# -- late commands --------------------------------------------------------------------------------
def _late(call: ScriptCall) -> ScriptCall:
    return ScriptCall(call.script, call.keys, [*call.args[:-1], int(time.time() * 1000) - 1])


def test_an_admission_that_arrives_after_its_caller_stopped_waiting_does_nothing(state: ClusterState) -> None:
    state.create_job(JobSpec(job="j", goal=2))
    state.redis.hset("lifl:job:j", "version", 0)
    with pytest.raises(Unavailable, match="after its caller stopped waiting"):
        state.run(_late(state.reserve_call("j", "n0", [("tok1", 0, "", "c1")])))
    assert state.redis.hget("lifl:job:j", "reserved") in (None, "0")
    assert state.run(state.held_slots_call("j", "n0", "tok")) == []
    assert state.run(state.reserve_call("j", "n0", [("tok1", 0, "", "c1")]))[0] == 0  # in time: reserved
    assert state.run(state.held_slots_call("j", "n0", "tok")) == ["tok1"]
    with pytest.raises(Unavailable, match="after its caller stopped waiting"):
        state.run(_late(state.accept_call("j", "n0", [("tok1", 0, "c1")])))
    assert state.run(state.held_slots_call("j", "n0", "tok")) == ["tok1"]  # still a slot, not counted
    assert state.run(state.held_slots_call("j", "n0", "other")) == [] and state.run(state.held_slots_call("j", "n1", "tok")) == []


# -- membership ---------------------------------------------------------------------------------
def _status(node: str) -> NodeStatus:
    return NodeStatus(node=node, time=1.0, started=0.0, instances=InstanceCounts(0, 0, 0), jobs={}, counters={}, retention={},
                      shm=SharedMemory(0, 0, 1 << 20, 0, 0, 0, 0, 0))


def _now_ms(state: ClusterState) -> int:
    return int(state.now() * 1000)


@pytest.mark.parametrize("seen_ago_s, pulse_ago_s, live", [
    (0, 0, True),
    (NODE_TTL - 1, 0, True),
    (NODE_TTL + 1, 0.5, False),  # the store answered others meanwhile: n1 is gone
    (NODE_TTL + 1, STORE_STALL_S + 1, True),  # nobody reached the store: it stalled, not n1
    (30, 30, True),  # a 30 s freeze
    (NODE_FORGET_S + 1, 0.5, False),
])
def test_membership_table(state: ClusterState, seen_ago_s: float, pulse_ago_s: float, live: bool) -> None:
    state.publish_node("n1", _status("n1"))
    now = _now_ms(state)
    state.redis.hset(NODES_SEEN, "n1", now - int(seen_ago_s * 1000))
    state.redis.set(STORE_PULSE, now - int(pulse_ago_s * 1000))
    assert ("n1" in state.nodes()) == live
    assert ("n1" in state.nodes()) == live  # and stays so: the stall was forgiven once
    if seen_ago_s > NODE_FORGET_S:
        assert state.redis.hget(NODES_SEEN, "n1") is None  # forgotten


def test_a_node_refreshes_its_status(state: ClusterState) -> None:
    state.publish_node("n1", _status("n1"))
    state.publish_node("n2", _status("n2"))
    assert set(state.nodes()) == {"n1", "n2"}
    assert state.nodes()["n1"] == _status("n1")
    assert json.loads(state.redis.hget("lifl:nodes", "n2"))  # one hash, not a key per node


# -- the slots a node holds -------------------------------------------------------------------------
def test_slots_of_unknown_outcome_are_checked_until_redis_agrees() -> None:
    slots = Slots()
    slots.taking("j", ["a", "b", "c"])
    assert slots.check() == []  # nothing unsure
    slots.unknown("j", ["b"])  # its answer was lost
    assert slots.check() == ["j"]
    assert slots.orphans("j", ["a"]) == []  # b did not run (yet)
    assert slots.orphans("j", ["a", "b"]) == ["b"]  # it ran late: given back
    slots.released("j", ["a"])  # accepted
    assert slots.orphans("j", ["a"]) == ["a"]  # a stale read: giving an accepted slot back does nothing
    for _ in range(RECONCILE_PASSES - 1):
        assert slots.orphans("j", ["c"]) == []
    assert slots.check() == ["j"]
    assert slots.orphans("j", ["c"]) == []
    assert slots.check() == []  # RECONCILE_PASSES answers with nothing unknown


def test_released_slots_are_forgotten() -> None:
    slots = Slots()
    slots.taking("j", ["a"])
    slots.released("j", ["a", "zzz"])
    slots.unknown("k", ["x"])
    assert slots.orphans("j", ["a"]) == ["a"]


# -- the agent's batches when a call cannot even start ---------------------------------------------
class _Sizes:
    def observe(self, _: float) -> None:
        pass


def test_a_batch_whose_call_raises_fails_its_items_and_the_job_goes_on() -> None:
    loop = Loop("batches")
    loop.start()
    calls: list[list[int]] = []
    outcomes: list[tuple[list[int], str | None]] = []

    def call(job: str, items: list[int], finished) -> None:
        calls.append(items)
        if len(calls) == 1:
            raise RuntimeError("the call could not be made")
        finished("ok", None)

    batches = Batches(loop, call, lambda job, items, result, error: outcomes.append(
        (items, type(error).__name__ if error else result)), _Sizes())
    try:
        loop.call(lambda: batches.add("j", 1))
        wait_for(lambda: outcomes, what="the first batch's outcome")
        loop.call(lambda: batches.add("j", 2))  # not wedged behind the failed call
        wait_for(lambda: len(outcomes) == 2, what="the second batch's outcome")
        assert outcomes == [([1], "RuntimeError"), ([2], "ok")]
    finally:
        loop.stop()
        loop.close()
