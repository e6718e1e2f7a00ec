"""State-store faults under load: Redis killed five times in a round, and frozen (SIGSTOP) for
2, 6 and 30 seconds. After each, the next version must be the exact FedAvg of the updates
acknowledged for its round, no update may be recorded as lost (the node never went away), every
version must have exactly one round record, and the job must go on (the next round completes).
While Redis is frozen, calls answer 503 within the state timeout instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import redis

from conftest import wait_for
from lifl import errors
from lifl.client import Gateway, RetryPolicy
from lifl import format as fmt
from lifl.redisconn import STATE_TIMEOUT_S
from test_chaos import GOAL, SHAPES, Chaos, Node, disk, node, tensors  # noqa: F401 - the fixtures
from test_crash import running

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="the checkpoint disk is a small tmpfs mounted for the test")]

REDIS_KILLS = 5
FREEZES_S = (2, 6, 30)
# While frozen, a call waits STATE_TIMEOUT_S (< 2 s) for Redis and then answers 503; the test
# allows the gateway's own work on a loaded machine on top, and checks it on the longer freezes:
# without the timeout a call would wait out the whole freeze.
ANSWER_SLACK_S = 3.5


def redis_pid(node: Node) -> int:
    return wait_for(lambda: node.up.pids().get("redis"), what="redis-server running")


def kill_redis_repeatedly(node: Node) -> Callable[[], None]:
    """kill -9 of redis-server, REDIS_KILLS times, each once the supervisor has restarted it."""
    def fault() -> None:
        for _ in range(REDIS_KILLS):
            pid = redis_pid(node)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not running(pid), what="redis killed")
            wait_for(lambda: node.up.pids().get("redis") not in (None, pid), what="redis restarted")
            wait_for(lambda: answers(node), what="redis answering again")
    return fault


def answers(node: Node) -> bool:
    try:
        with redis.Redis(unix_socket_path=str(node.base / "run" / "redis" / "redis.sock"), socket_timeout=5) as r:
            return bool(r.ping())
    except redis.RedisError:
        return False


def freeze_redis(node: Node, seconds: float, answers: list[tuple[float, str]]) -> Callable[[], None]:
    """SIGSTOP redis-server for ``seconds`` while the round's pushes go on; meanwhile a client
    that does not retry reads the job, and what it was answered and how soon is kept."""
    def fault() -> None:
        pid = redis_pid(node)
        os.kill(pid, signal.SIGSTOP)
        thawed = threading.Event()

        def thaw() -> None:
            os.kill(pid, signal.SIGCONT)
            thawed.set()

        threading.Timer(seconds, thaw).start()
        gw = Gateway(node.up.http, timeout=60, retry=RetryPolicy(max_attempts=1))
        try:
            while not thawed.is_set():
                started = time.monotonic()
                try:
                    gw.job("small")
                    outcome = "answered"
                except errors.Unavailable as e:
                    outcome = e.code
                answers.append((time.monotonic() - started, outcome))
                thawed.wait(0.2)
        finally:
            gw.close()
    return fault


def assert_one_record_per_version(chaos: Chaos, job: str) -> None:
    history = chaos.node.gateway("http").rounds(job, 100)
    made = [r["new_version"] for r in history if r.get("new_version") is not None and r["outcome"] in ("complete", "partial")]
    assert len(made) == len(set(made)), f"a version with two round records: {sorted(made)}"
    chaos.assert_versions_contiguous(job)


@pytest.mark.timeout(1500)
def test_redis_killed_and_frozen_under_load_loses_nothing_acknowledged_and_never_wedges(node: Node) -> None:
    gw = node.gateway("http")
    gw.create_job("small", GOAL)
    gw.set_model("small", fmt.encode(tensors(SHAPES, 0)))
    chaos = Chaos(node)
    chaos.round("small", SHAPES, GOAL, None, "no fault")
    chaos.round("small", SHAPES, GOAL, kill_redis_repeatedly(node), f"kill -9 redis x{REDIS_KILLS}")
    assert_one_record_per_version(chaos, "small")
    slowest: dict[float, float] = {}
    for seconds in FREEZES_S:
        answers: list[tuple[float, str]] = []
        chaos.round("small", SHAPES, GOAL, freeze_redis(node, seconds, answers), f"SIGSTOP redis {seconds} s")
        assert_one_record_per_version(chaos, "small")
        during = [a for a in answers if a[1] != "answered"]
        assert during, f"no call was answered 503 during a {seconds} s freeze: {answers}"
        assert {outcome for _, outcome in during} == {"state_unavailable"}, answers
        slowest[seconds] = max(elapsed for elapsed, _ in answers)
        if seconds > STATE_TIMEOUT_S + ANSWER_SLACK_S:
            assert slowest[seconds] <= STATE_TIMEOUT_S + ANSWER_SLACK_S, answers
    chaos.round("small", SHAPES, GOAL, None, "no fault, after all of them")
    assert_one_record_per_version(chaos, "small")
    status = node.gateway("http").job("small")
    assert not status["round"]["lost"], status  # the node never went away, and was never taken for gone
    ledger = chaos.ledger
    print(f"\nstate faults: {', '.join(ledger.faults)}; {ledger.acknowledged} updates acknowledged, all in their "
          f"versions ({ledger.unknown} of unknown outcome, {ledger.refused} refused); slowest answer while frozen "
          + ", ".join(f"{s} s: {t:.2f} s" for s, t in slowest.items()))
    assert ledger.refused == 0
