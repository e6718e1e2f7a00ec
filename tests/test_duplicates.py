"""One update per client and round: a client's second update of a round (a retry whose first try
was taken, or a client trying to weigh more) is refused with `already_acknowledged`, and the
round averages its first update once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl.client import Gateway
from lifl.errors import Conflict
from lifl.jobs import JobSpec
from lifl.state import (
    ACCEPT_COUNTED, ACCEPT_DUPLICATE, RESERVE_DUPLICATE, RESERVE_OK, ClusterState, refusal,
)


def test_a_counted_client_cannot_reserve_or_be_counted_again_in_the_round(state: ClusterState) -> None:
    state.create_job(JobSpec("j", goal=3))
    state.next_round("j", -1, 0, key="00", node="n")
    assert state.reserve("j", 0, "n", client="a")[0] == RESERVE_OK
    assert state.reserve("j", 0, "n", client="a")[0] == RESERVE_OK  # two uploads in flight: the first counted wins
    assert state.accept("j", 0, "n", client="a")[0] == ACCEPT_COUNTED
    assert state.accept("j", 0, "n", client="a")[0] == ACCEPT_DUPLICATE
    status, version, round_id = state.reserve("j", 0, "n", client="a")
    assert status == RESERVE_DUPLICATE
    error = refusal(status, "j", version, round_id, 3)
    assert error.code == "already_acknowledged" and error.extra == {"version": 0, "round": 0}
    job, shard = state.job("j"), state.shard("j")
    assert (job.accepted, job.reserved, shard.inflight["n"]) == (1, 1, 0)  # the duplicate's slot came back
    assert state.reserve("j", 0, "n", client="b")[0] == RESERVE_OK  # other clients are not affected
    assert state.reserve("j", 0, "n")[0] == RESERVE_OK  # nor updates without a client id


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_pushing_twice_counts_once(node: RunningNode, protocol: str) -> None:
    gw = Gateway(node.http)
    gw.create_job("j", 2)
    gw.set_model("j", fmt.encode({"w": np.zeros(8, np.float32)}))
    pusher = Gateway(node.http if protocol == "http" else node.grpc, protocol)
    pusher.push("j", fmt.encode({"w": np.full(8, 1.0, np.float32)}), client="a", samples=1, base_version=0)
    with pytest.raises(Conflict) as info:
        pusher.push("j", fmt.encode({"w": np.full(8, 100.0, np.float32)}), client="a", samples=1000, base_version=0)
    assert info.value.code == "already_acknowledged"
    pusher.push("j", fmt.encode({"w": np.full(8, 3.0, np.float32)}), client="b", samples=1, base_version=0)
    wait_for(lambda: gw.job("j")["version"] == 1, what="version 1")
    _, blob = gw.model("j")
    np.testing.assert_array_equal(fmt.views(blob, fmt.parse_layout(blob))["w"], np.full(8, 2.0, np.float32))


@pytest.mark.slow
def test_concurrent_uploads_of_one_client_count_once(node: RunningNode) -> None:
    gw = Gateway(node.http)
    gw.create_job("j", 2)
    gw.set_model("j", fmt.encode({"w": np.zeros(8, np.float32)}))
    answers: list[str] = []

    def push() -> None:
        try:
            Gateway(node.http).push("j", fmt.encode({"w": np.ones(8, np.float32)}), client="a", samples=1, base_version=0)
            answers.append("acknowledged")
        except Conflict as e:
            answers.append(e.code)

    threads = [threading.Thread(target=push) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # slots are taken before the upload, so some may find the round's two slots taken
    assert answers.count("acknowledged") == 1 and set(answers) <= {"acknowledged", "already_acknowledged", "round_full"}
    assert "already_acknowledged" in answers, answers
    job = gw.job("j")
    assert job["version"] == 0 and job["round"]["received"] == 1
