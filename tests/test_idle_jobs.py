"""Issue 25: a node's periodic duties cost what its active jobs do, however many idle jobs it has."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl.state import ACTIVE

IDLE_JOBS = 200
# Redis commands per second a node with no active job may issue (membership, the controller's
# lease and plan, warm reads: about 20/s on a fresh node). Visiting every job would take more
# than ten times this: a settle and a retention pass each read each job every turn or two.
IDLE_COMMANDS_PER_S = 100


def commands(r: redis.Redis) -> int:
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def commands_per_second(r: redis.Redis, window: float = 2.0) -> float:
    """Redis commands per second served over ``window`` s (the node is the server's only client)."""
    start, at = commands(r), time.monotonic()
    time.sleep(window)  # a measuring window, not a synchronisation: what is counted is work done
    return (commands(r) - start) / (time.monotonic() - at)


@pytest.mark.slow
def test_idle_jobs_cost_nothing_and_an_active_one_still_completes(node: RunningNode) -> None:
    blob = fmt.encode({"w": np.zeros(16, np.float32)})
    for i in range(IDLE_JOBS):
        assert node.json("POST", "/v1/jobs", {"job": f"idle{i}", "goal": 1})[0] == 201
        assert node.json("PUT", f"/v1/jobs/idle{i}/model", blob)[0] == 201
    r = node.state.redis
    assert not r.smembers(ACTIVE)  # jobs with a model and no update have no round under way

    # once the gateway's requests are no longer recent, the duties visit no job; the rare full
    # sweep may fall in a window, so wait for one without it
    wait_for(lambda: commands_per_second(r) < IDLE_COMMANDS_PER_S, timeout=120,
             what=f"fewer than {IDLE_COMMANDS_PER_S} Redis commands/s with {IDLE_JOBS} idle jobs")

    # an idle job that becomes active still completes its round, and is idle again after it
    status, reply = node.push("idle7", fmt.encode({"w": np.ones(16, np.float32)}), client="c1", version=0)
    assert status == 202, reply
    wait_for(lambda: node.json("GET", "/v1/jobs/idle7")[1]["version"] == 1, what="round 0 of idle7 to complete")
    wait_for(lambda: not r.smembers(ACTIVE), what="idle7 to leave the active set once its round ended")
