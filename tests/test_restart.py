"""kill -9 a whole node mid-job, start it again: the job resumes from its last version, with no
version lost or produced twice, and clients carry on."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from conftest import wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.client import Gateway
from test_crash import Up

pytestmark = pytest.mark.slow


def push_round(gw: Gateway, version: int, values: list[float]) -> None:
    for i, v in enumerate(values):
        gw.push("j", fmt.encode({"w": np.full(1000, v, np.float32)}), client=f"c{i}", samples=1, base_version=version)


def three_versions(up: Up) -> Gateway:
    """Job j at version 3, made by three rounds of two updates."""
    gw = Gateway(up.http.removeprefix("http://"))
    gw.create_job("j", 2)
    gw.set_model("j", fmt.encode({"w": np.zeros(1000, np.float32)}))
    for version in range(3):
        push_round(gw, version, [version + 1.0, version + 3.0])
        wait_for(lambda: gw.job("j")["version"] == version + 1, what=f"version {version + 1}")
    return gw


def test_restart_after_kill_resumes_from_the_last_version(shm_node: str, run_dir) -> None:
    up = Up(shm_node, run_dir.parent)
    try:
        gw = three_versions(up)
        _, before = gw.model("j")
        push_round(gw, 3, [100.0])  # half of round 3 has arrived when the node dies
        gw.close()
        up.kill_all()

        up = Up(shm_node, run_dir.parent)
        gw = Gateway(up.http.removeprefix("http://"))
        status = gw.job("j")
        assert status["version"] == 3 and status["model"]["checkpoint"] == 3
        assert status["last_round"]["outcome"] == "interrupted" and status["round"]["received"] == 0
        version, after = gw.model("j")
        assert version == 3 and bytes(after) == bytes(before)  # the same version 3, bit for bit
        push_round(gw, 3, [5.0, 7.0])  # clients carry on from version 3
        wait_for(lambda: gw.job("j")["version"] == 4, what="version 4")
        version, blob = gw.model("j")
        assert version == 4 and fmt.views(blob, kernels.validate(blob))["w"][0] == pytest.approx(6.0)
        history = gw.rounds("j")
        assert [(r["outcome"], r["version"], r["new_version"]) for r in history] == [
            ("complete", 0, 1), ("complete", 1, 2), ("complete", 2, 3), ("interrupted", 3, None), ("complete", 3, 4)]
        gw.close()
    finally:
        up.proc.terminate()
        up.proc.wait(30)


def test_a_version_checkpointed_but_not_yet_in_redis_has_one_record_and_loses_nothing(shm_node: str, run_dir) -> None:
    """The node died after version 3 was checkpointed and before Redis heard of it (or Redis lost
    its last second): the restarted node makes version 3 the round's outcome, once, and records
    none of its updates as lost (they are in it: a client sending one again would count twice)."""
    up = Up(shm_node, run_dir.parent)
    try:
        gw = three_versions(up)
        _, made = gw.model("j")
        gw.close()
        r = redis.Redis.from_url(f"unix://{run_dir / 'redis' / 'redis.sock'}", decode_responses=True)
        r.hset("lifl:job:j", mapping={"version": 2, "round": 2, "accepted": 2, "reserved": 2, "closed": 1})
        r.hset("lifl:job:j:shard", mapping={"round": 2, f"count.{shm_node}": 2})  # this node took part in round 2
        r.rpop("lifl:job:j:rounds")  # the record of the round that made version 3
        r.close()
        up.kill_all()

        up = Up(shm_node, run_dir.parent)
        gw = Gateway(up.http.removeprefix("http://"))
        version, blob = gw.model("j")
        assert version == 3 and bytes(blob) == bytes(made)
        history = gw.rounds("j")
        assert [(r["outcome"], r["version"], r["new_version"]) for r in history] == [
            ("complete", 0, 1), ("complete", 1, 2), ("complete", 2, 3)], history
        assert history[-1]["updates"] == 2 and not history[-1]["lost"]
        push_round(gw, 3, [5.0, 7.0])  # and the job goes on
        wait_for(lambda: gw.job("j")["version"] == 4, what="version 4")
        gw.close()
    finally:
        up.proc.terminate()
        up.proc.wait(30)


def test_after_a_kill_queries_fetch_the_retained_updates_back_from_the_store(shm_node: str, run_dir) -> None:
    up = Up(shm_node, run_dir.parent)
    try:
        gw = Gateway(up.http.removeprefix("http://"))
        gw.create_job("j", 2, retention={"updates": 2, "models": 2, "history": 8})
        gw.set_model("j", fmt.encode({"w": np.zeros(1000, np.float32)}))
        for version in range(4):
            push_round(gw, version, [version + 1.0, version + 3.0])
            wait_for(lambda: gw.job("j")["version"] == version + 1, what=f"version {version + 1}")
        wait_for(lambda: gw.retention("j")["stats"]["pending_writes"] == 0
                 and gw.retention("j")["stats"]["bytes_retained"]["update"] > 0, what="the rounds written behind")
        before = gw.query("j", {"workload": "provenance", "round": 3})
        assert before["data"]["store"] == 0
        gw.close()
        up.kill_all()  # shared memory is gone; the index in Redis and the copies in the store are not

        up = Up(shm_node, run_dir.parent)
        gw = Gateway(up.http.removeprefix("http://"))
        after = gw.query("j", {"workload": "provenance", "round": 3})
        # the two updates and the base (version 3) come back from the store; version 4 was restored as the model
        assert after["result"] == before["result"] and after["data"]["store"] == 3
        assert gw.query("j", {"workload": "provenance", "round": 3})["data"]["store"] == 0  # kept again
        assert gw.query("j", {"workload": "cosine", "round": 0})["data"]["store"] > 0  # older: queryable, from the store
        gw.close()
    finally:
        up.proc.terminate()
        up.proc.wait(30)
