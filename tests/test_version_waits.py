"""Waits for a job's next version (``GET /v1/jobs/{job}/version``, gRPC ``WaitForVersion``,
``Gateway.wait_for_version``): the registry as a table, the parameters' limits, the gateway's
watch on a real Redis, and long polls through a real node and the SF baseline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl.client import Gateway, from_blob
from lifl.cluster_types import Job
from lifl.errors import BadRequest, NotFound, Overloaded
from lifl.gateway.versions import VersionWatch, Waiter, Waits
from lifl.jobs import (MAX_VERSION, MAX_VERSION_WAIT_S, JobSpec, stage_wait_params, stage_wait_query, version_wait_params,
                       version_wait_query)
from lifl.net import lifl_pb2 as pb
from lifl.net.loop import Loop
from lifl.state import ClusterState

MODEL = {"w": np.zeros(8, np.float32)}


# -- the registry ------------------------------------------------------------------------------------------
def _waiter(job: str, after: int) -> Waiter:
    return Waiter(job, after, lambda job, error: None)


@pytest.mark.parametrize("afters, version, answered, left", [
    ([0, 0, 1], 1, [0, 1], [2]),  # version 1 passes after=0 only
    ([0, 1, 2], 3, [0, 1, 2], []),  # a version past all of them
    ([3], 3, [], [0]),  # not past: it waits on
    ([-1], 0, [0], []),  # after=-1: any version, 0 included
    ([], 5, [], []),
])
def test_a_version_answers_exactly_the_waiters_it_passes(afters: list[int], version: int, answered: list[int],
                                                         left: list[int]) -> None:
    waits = Waits()
    waiters = [_waiter("j", after) for after in afters]
    for w in waiters:
        waits.add(w)
    waits.add(_waiter("other", -1))
    assert waits.take("j", lambda after: after < version) == [waiters[i] for i in answered]
    assert waits.count == len(left) + 1 and ("j" in waits) == bool(left)
    assert [w for w in waiters if waits.remove(w)] == [waiters[i] for i in left]
    assert waits.jobs() == ["other"] and waits.take_all("other") and waits.count == 0


def test_the_registry_refuses_past_its_limit_and_a_removed_waiter_is_not_answered() -> None:
    waits = Waits(limit=2)
    first, second = _waiter("j", 0), _waiter("j", 0)
    waits.add(first)
    waits.add(second)
    with pytest.raises(Overloaded) as e:
        waits.add(_waiter("k", 0))
    assert e.value.code == "too_many_waits" and e.value.retry_after == 1.0
    assert waits.remove(first) and not waits.remove(first)  # its deadline came first: answered once
    waits.add(_waiter("k", 0))  # room again
    assert waits.take("j", lambda after: after < 1) == [second] and waits.count == 1


# -- the parameters ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("query, expected", [
    ("", (-1, 0.0)),
    ("after=3", (3, 0.0)),
    ("after=-1&wait_s=0", (-1, 0.0)),
    ("wait_s=60", (-1, MAX_VERSION_WAIT_S)),  # at the limit
    ("after=4611686018427387904&wait_s=0.5", (MAX_VERSION, 0.5)),  # at the limit
    ("after=2&wait_s=1.250", (2, 1.25)),
])
def test_version_wait_queries_within_their_limits(query: str, expected: tuple[int, float]) -> None:
    assert version_wait_query(query) == expected


@pytest.mark.parametrize("query, named", [
    ("wait_s=60.001", "wait_s"),  # past the limit
    ("wait_s=61", "wait_s"),
    ("after=-2", "after"),
    ("after=4611686018427387905", "after"),  # past the limit
    ("after=99999999999999999999", "after"),
    ("after=1.5", "after"), ("after=1e3", "after"), ("after=+5", "after"), ("after= 5", "after"), ("after=", "after"),
    ("after=%D9%A5", "after"),  # an Arabic-Indic digit: int() would take it
    ("wait_s=-1", "wait_s"), ("wait_s=nan", "wait_s"), ("wait_s=inf", "wait_s"), ("wait_s=1e1", "wait_s"),
    ("wait_s=1_0", "wait_s"), ("wait_s=", "wait_s"), ("wait_s=.5", "wait_s"),
    ("after=1&after=2", "at most once"),
    ("wait=5", "unknown query parameter 'wait'"),
])
def test_malformed_version_waits_are_refused_naming_the_problem(query: str, named: str) -> None:
    with pytest.raises(BadRequest) as e:
        version_wait_query(query)
    assert e.value.code == "bad_version_wait" and named in str(e.value)


@pytest.mark.parametrize("after, wait_s", [(-2, 0.0), (MAX_VERSION + 1, 0.0), (0, -0.5), (0, float("nan")),
                                            (0, float("inf")), (0, MAX_VERSION_WAIT_S + 0.001), (True, 0.0)])
def test_malformed_grpc_numbers_are_refused(after: Any, wait_s: float) -> None:
    with pytest.raises(BadRequest):
        version_wait_params(after, wait_s)


@pytest.mark.parametrize("query, expected", [
    ("", (None, None, 0.0)),
    ("client=c1", ("c1", None, 0.0)),
    ("client=", (None, None, 0.0)),
    ("client=c1&round=0&after=advertise&wait_s=60", ("c1", (0, "advertise"), MAX_VERSION_WAIT_S)),  # at the limit
    ("round=4611686018427387904&after=abandoned", (None, (MAX_VERSION, "abandoned"), 0.0)),
    ("round=3&after=unmask&wait_s=0.25", (None, (3, "unmask"), 0.25)),
])
def test_stage_wait_queries_within_their_limits(query: str, expected: tuple[Any, ...]) -> None:
    assert stage_wait_query(query) == expected


@pytest.mark.parametrize("query, named", [
    ("round=1", "together"), ("after=share", "together"),
    ("round=-1&after=share", "round"), ("round=4611686018427387905&after=share", "round"), ("round=1.0&after=share", "round"),
    ("round=%D9%A5&after=share", "round"), ("round=&after=share", "round"),
    ("round=1&after=sharing", "after must be a stage"), ("round=1&after=", "after must be a stage"),
    ("round=1&after=SHARE", "after must be a stage"),
    ("round=1&after=share&wait_s=60.5", "wait_s"), ("wait_s=-1", "wait_s"), ("wait_s=nan", "wait_s"),
    ("client=a&client=b", "at most once"), ("stage=share", "unknown query parameter 'stage'"),
])
def test_malformed_stage_waits_are_refused_naming_the_problem(query: str, named: str) -> None:
    with pytest.raises(BadRequest) as e:
        stage_wait_query(query)
    assert e.value.code == "bad_stage_wait" and named in str(e.value)


@pytest.mark.parametrize("round_id, after, wait_s", [(True, "share", 0), (1, None, 0), (None, "share", 0), (1, 2, 0),
                                                     (1, "share", True), (1, "share", "1e1"), (1.5, "share", 0),
                                                     (1, "share", 61)])
def test_malformed_json_stage_waits_are_refused(round_id: Any, after: Any, wait_s: Any) -> None:
    with pytest.raises(BadRequest) as e:
        stage_wait_params(round_id, after, wait_s)
    assert e.value.code == "bad_stage_wait"


# -- the gateway's watch, on a real Redis ------------------------------------------------------------------
@pytest.fixture
def watch(redis_url: str) -> Iterator[tuple[VersionWatch, ClusterState]]:
    state = ClusterState(redis_url)
    loop = Loop("test versions")
    loop.start()
    watch = VersionWatch(loop, state, limit=3)
    loop.call(watch.start)
    yield watch, state
    loop.call(watch.stop)
    loop.stop()


class Answers:
    def __init__(self) -> None:
        self.got: list[tuple[Job | None, BaseException | None]] = []

    def __call__(self, job: Job | None, error: BaseException | None) -> None:
        self.got.append((job, error))


def _job(state: ClusterState, name: str) -> None:
    state.create_job(JobSpec(job=name, goal=2))
    state.next_round(name, -1, 0)  # its model: version 0


def _wait(watch: VersionWatch, job: str, after: int, wait_s: float, answers: Answers,
          check: Any = lambda job: None) -> None:
    watch.loop.call(lambda: watch.wait(job, after, wait_s, check, answers))


def test_a_wait_is_answered_when_the_next_round_opens(watch: tuple[VersionWatch, ClusterState]) -> None:
    w, state = watch
    _job(state, "vw1")
    now, later = Answers(), Answers()
    _wait(w, "vw1", -1, 30, now)  # version 0 is past -1: answered at once
    _wait(w, "vw1", 0, MAX_VERSION_WAIT_S, later)
    wait_for(lambda: now.got and w.loop.call(lambda: w.waits.count) == 1, what="one answer, one waiter")
    assert now.got[0][0].version == 0 and not later.got
    state.next_round("vw1", 0, 1)
    wait_for(lambda: later.got, timeout=MAX_VERSION_WAIT_S - 10, what="the answer, before the wait's end")
    assert later.got[0][0].version == 1 and w.loop.call(lambda: w.waits.count) == 0


def test_a_wait_ends_with_the_version_then_and_a_missed_event_only_delays(watch: tuple[VersionWatch, ClusterState]) -> None:
    w, state = watch
    _job(state, "vw2")
    timed_out, unannounced = Answers(), Answers()
    _wait(w, "vw2", 0, 0.2, timed_out)
    wait_for(lambda: timed_out.got, what="the end of the wait")
    assert timed_out.got[0][0].version == 0 and timed_out.got[0][1] is None
    _wait(w, "vw2", 0, MAX_VERSION_WAIT_S, unannounced)
    wait_for(lambda: w.loop.call(lambda: w.waits.count) == 1, what="the waiter")
    state.redis.hset("lifl:job:vw2", "version", 5)  # no event published: the recheck finds it
    wait_for(lambda: unannounced.got, timeout=MAX_VERSION_WAIT_S - 10, what="the recheck's answer, before the wait's end")
    assert unannounced.got[0][0].version == 5


def test_waits_refused_past_the_limit_missing_jobs_and_failed_checks(watch: tuple[VersionWatch, ClusterState]) -> None:
    w, state = watch
    _job(state, "vw3")
    held = [Answers() for _ in range(4)]
    for answers in held:
        _wait(w, "vw3", 0, MAX_VERSION_WAIT_S, answers)
    refused = wait_for(lambda: [a for a in held if a.got], what="the refusal")  # whichever read came back last
    assert len(refused) == 1 and isinstance(refused[0].got[0][1], Overloaded) and w.loop.call(lambda: w.waits.count) == 3
    missing, forbidden = Answers(), Answers()
    _wait(w, "no-such-job", 0, 30, missing)

    def refuse(job: Job) -> None:
        raise NotFound("outside your scope")

    _wait(w, "vw3", -1, 30, forbidden, refuse)
    wait_for(lambda: missing.got and forbidden.got, what="both refusals")
    assert isinstance(missing.got[0][1], NotFound) and isinstance(forbidden.got[0][1], NotFound)
    state.next_round("vw3", 0, 1)
    waiting = [a for a in held if a is not refused[0]]
    wait_for(lambda: all(a.got for a in waiting), timeout=MAX_VERSION_WAIT_S - 10, what="the three held waits")
    assert {a.got[0][0].version for a in waiting} == {1}


# -- through a node ---------------------------------------------------------------------------------------
def _round(node: RunningNode, job: str, version: int, clients: int) -> None:
    for i in range(clients):
        status, body = node.push(job, fmt.encode({"w": np.full(8, 1.0, np.float32)}), client=f"c{version}-{i}", version=version)
        assert status == 202, body


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_waits_for_the_next_version_through_the_gateway(node: RunningNode, protocol: str) -> None:
    gw = Gateway(node.http)
    gw.create_job(f"lp-{protocol}", 2)
    gw.set_model(f"lp-{protocol}", fmt.encode(MODEL))
    job = f"lp-{protocol}"
    client = Gateway(node.http if protocol == "http" else node.grpc, protocol=protocol)
    assert client.wait_for_version(job) == {"job": job, "tenant": "default", "version": 0,
                                            "round": {"id": 0, "version": 0, "closed": False}}
    assert client.wait_for_version(job, 0, 0.3)["version"] == 0  # nothing new: the wait ends with version 0
    seen: list[dict[str, Any]] = []
    waiting = threading.Thread(target=lambda: seen.append(client.wait_for_version(job, 0, MAX_VERSION_WAIT_S)))
    started = time.monotonic()
    waiting.start()
    _round(node, job, 0, 2)
    waiting.join(60)
    assert seen and seen[0]["version"] == 1 and seen[0]["round"]["id"] == 1
    assert time.monotonic() - started < MAX_VERSION_WAIT_S  # answered by the round, not by the end of the wait


@pytest.mark.slow
def test_version_waits_refuse_bad_input_and_callers_outside_their_scope(node: RunningNode) -> None:
    gw = Gateway(node.http)
    gw.create_job("lp-scope", 2)
    gw.set_model("lp-scope", fmt.encode(MODEL))
    status, body = node.json("GET", "/v1/jobs/lp-scope/version?wait_s=61")
    assert status == 400 and body["error"]["code"] == "bad_version_wait" and "wait_s" in body["error"]["message"]
    status, body = node.json("GET", "/v1/jobs/lp-scope/version?after=x")
    assert status == 400 and body["error"]["code"] == "bad_version_wait"
    status, body = node.json("GET", "/v1/jobs/nope/version")
    assert status == 404 and body["error"]["code"] == "no_such_job"
    status, _ = node.json("GET", "/v1/jobs/lp-scope/version", headers={"Authorization": None})
    assert status == 401
    elsewhere = Gateway(node.http, token=gw.create_token("tenant", "acme")["token"])
    with pytest.raises(NotFound):  # another tenant's job is no job of theirs
        elsewhere.wait_for_version("lp-scope", 0, 5)
    stub = node.grpc_stub()
    with pytest.raises(grpc.RpcError) as e:
        stub.WaitForVersion(pb.WaitForVersionRequest(job="lp-scope", after=0, wait_s=float("nan")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = stub.WaitForVersion(pb.WaitForVersionRequest(job="lp-scope", after=-1))
    assert (reply.version, reply.round, reply.closed) == (0, 0, False)


@pytest.mark.slow
def test_a_download_after_a_version_shows_is_that_version(node: RunningNode) -> None:
    """Downloads share one model reference per version: never one older than the status shows."""
    gw = Gateway(node.http)
    gw.create_job("lp-fresh", 2)
    gw.set_model("lp-fresh", fmt.encode(MODEL))
    for version in range(4):
        assert gw.model("lp-fresh")[0] == version  # shared from here on, until the version changes
        _round(node, "lp-fresh", version, 2)
        wait_for(lambda: gw.job("lp-fresh")["version"] == version + 1, what=f"version {version + 1}")
        got, blob = gw.model("lp-fresh")
        assert got == version + 1 and from_blob(blob)["w"][0] == 1.0


def test_stage_waits_past_their_limit_are_refused_and_a_held_one_ends_with_its_wait(redis_url: str) -> None:
    """A stage watch of limit 1 on a real Redis, a secure round at its advertise stage: a second
    wait is refused (503 too_many_waits); the first is held until its wait ends, then answered with
    the round as it is; one that saw a stage already past is answered at once."""
    from lifl.client.secure import SecureClient
    from lifl.gateway.versions import StageWatch
    from lifl.secagg_round import Settings
    from lifl.secure_state import SecureRounds

    state = ClusterState(redis_url)
    _job(state, "j")
    rounds = SecureRounds(state)
    seen = rounds.advertise("j", Settings(), 3, "c0", SecureClient("c0").advertisement())
    loop = Loop("test stages")
    loop.start()
    watch = StageWatch(loop, rounds.round, limit=1)
    held, refused, at_once = Answers(), Answers(), Answers()
    try:
        loop.call(lambda: watch.wait("j", (seen.round, "advertise"), seen, 0.5, held))
        loop.call(lambda: watch.wait("j", (seen.round, "advertise"), seen, 30, refused))
        assert refused.got and isinstance(refused.got[0][1], Overloaded) and refused.got[0][1].code == "too_many_waits"
        wait_for(lambda: held.got != [], what="the held wait's end")
        loop.call(lambda: watch.wait("j", (seen.round, "share"), seen, 30, at_once))
    finally:
        loop.stop()
    assert held.got == [(seen, None)] and at_once.got == [(seen, None)]
