"""Synchronous rounds on a real node: deadlines, partial participation, leases and heartbeats."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, read_response, wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.client import Gateway
from lifl.errors import Conflict, NotFound

pytestmark = pytest.mark.slow
MODEL = {"w": np.zeros((4, 4), np.float32)}
# The deadline of the tests that exercise one: the round opens when its model is set, and the
# pushes that must arrive before the deadline take milliseconds, but more than a second on a
# loaded machine; so the deadline is far longer than they can take, and the tests wait for it
# once. The opening and closing times each round records (Redis clock and host clock, one
# machine) show that it closed no earlier than its deadline.
DEADLINE = 5.0
LEASE_TTL = 3.0  # likewise for leases: heartbeats every LEASE_TTL / 10 keep one far within its lifetime


def update(value: float) -> bytearray:
    return fmt.encode({"w": np.full((4, 4), value, np.float32)})


def job(node: RunningNode, name: str, goal: int, **options) -> Gateway:
    gw = Gateway(node.http)
    gw.create_job(name, goal, **options)
    gw.set_model(name, fmt.encode(MODEL))
    return gw


def model_value(gw: Gateway, name: str) -> tuple[int, float]:
    version, blob = gw.model(name)
    return version, float(fmt.views(blob, kernels.validate(blob))["w"][0, 0])


def closed_after_its_deadline(summary: dict) -> bool:
    return summary["closed"] - summary["opened"] >= DEADLINE - 0.01  # both rounded to the millisecond


def test_deadline_closes_the_round_with_what_arrived(node: RunningNode) -> None:
    gw = job(node, "d", 4, round_deadline_s=DEADLINE, min_updates=2)
    for value, samples in ((1.0, 1), (2.0, 2), (4.0, 3)):
        gw.push("d", update(value), client=f"c{value}", samples=samples, base_version=0)
    assert gw.job("d")["version"] == 0  # no fourth update comes: only the deadline can close the round
    wait_for(lambda: gw.job("d")["version"] == 1, timeout=DEADLINE + 60, what="partial round installed")
    last = gw.job("d")["last_round"]
    assert (last["outcome"], last["updates"], last["samples"], last["new_version"]) == ("partial", 3, 6, 1), last
    assert closed_after_its_deadline(last), last  # it waited for the deadline
    assert model_value(gw, "d") == (1, pytest.approx((1 * 1 + 2 * 2 + 4 * 3) / 6, rel=1e-6))
    assert 'lifl_rounds_total{job="d",outcome="partial"} 1.0' in gw.metrics()
    assert 'lifl_job_version{job="d"} 1.0' in gw.metrics()


def test_deadline_with_too_few_updates_abandons_and_reopens_the_round(node: RunningNode) -> None:
    gw = job(node, "a", 3, round_deadline_s=DEADLINE, min_updates=2)
    gw.push("a", update(5.0), client="lonely", samples=1, base_version=0)
    wait_for(lambda: (gw.job("a")["last_round"] or {}).get("outcome") == "abandoned", timeout=DEADLINE + 60,
             what="abandoned round")
    status = gw.job("a")
    assert status["version"] == 0 and status["round"]["id"] == 1 and status["round"]["received"] == 0
    assert "1 of the 2 updates" in status["last_round"]["reason"]
    assert closed_after_its_deadline(status["last_round"]), status["last_round"]
    for i in range(3):  # the next round, on the same version, completes with its goal (well before its deadline)
        gw.push("a", update(float(i)), client=f"c{i}", samples=1, base_version=0)
    wait_for(lambda: gw.job("a")["version"] == 1, what="version 1")
    assert model_value(gw, "a") == (1, pytest.approx(1.0))
    assert [r["outcome"] for r in gw.rounds("a")] == ["abandoned", "complete"]


def test_update_still_arriving_when_the_round_closes_is_refused(node: RunningNode) -> None:
    gw = job(node, "s", 3, round_deadline_s=DEADLINE, min_updates=1)
    gw.push("s", update(1.0), client="early", samples=1, base_version=0)
    blob = bytes(update(9.0))
    host, port = node.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/jobs/s/updates HTTP/1.1\r\nHost: x\r\nX-Lifl-Client: slow\r\nX-Lifl-Samples: 1\r\n"
                  b"Authorization: Bearer %s\r\nX-Lifl-Base-Version: 0\r\nContent-Length: %d\r\n\r\n"
                  % (OPERATOR_TOKEN.encode(), len(blob)) + blob[:-8])
        wait_for(lambda: gw.job("s")["round"]["in_progress"] == 1, what="the slow upload admitted to round 0")
        wait_for(lambda: gw.job("s")["version"] == 1, timeout=DEADLINE + 60, what="round closed at its deadline")
        s.sendall(blob[-8:])
        status, _, body = read_response(s)
    assert (status, json.loads(body)["error"]["code"]) == (409, "round_closed"), body
    last = gw.job("s")["last_round"]
    assert (last["outcome"], last["updates"]) == ("partial", 1) and closed_after_its_deadline(last), last
    assert model_value(gw, "s") == (1, pytest.approx(1.0))  # only the update that had arrived


def test_lease_lapses_without_heartbeats_and_its_slot_goes_to_another_client(node: RunningNode) -> None:
    gw = job(node, "h", 1, lease_ttl_s=LEASE_TTL, over_selection=1.0)
    a = gw.take_lease("h", "a")
    taken = time.monotonic()
    assert (a["version"], a["round"], a["ttl_s"]) == (0, 0, LEASE_TTL)
    with pytest.raises(Conflict) as info:
        gw.take_lease("h", "b")
    assert info.value.code == "round_full" and info.value.extra["version"] == 0
    while time.monotonic() - taken < 1.5 * LEASE_TTL:  # heartbeats keep the slot past its lifetime
        time.sleep(LEASE_TTL / 10)  # the client's pace between heartbeats (not waiting for anything)
        last_beat = time.monotonic()
        assert gw.heartbeat("h", a["lease"])["ttl_s"] == LEASE_TTL
    with pytest.raises(Conflict) as info:
        gw.take_lease("h", "b")
    assert info.value.code == "round_full"
    assert gw.job("h")["round"]["leases"] == 1
    b = wait_for(lambda: lease_or_none(gw, "h", "b"), timeout=LEASE_TTL + 60, what="a's lease to lapse")
    assert time.monotonic() - last_beat >= LEASE_TTL  # no more heartbeats: it lapsed, but not before its lifetime
    with pytest.raises(NotFound) as info:
        gw.heartbeat("h", a["lease"])
    assert info.value.code == "no_such_lease"
    gw.push("h", update(3.0), client="b", samples=1, base_version=0, lease=b["lease"])
    wait_for(lambda: gw.job("h")["version"] == 1, what="version 1")
    assert gw.job("h")["round"]["leases"] == 0  # leases belong to a round


def lease_or_none(gw: Gateway, name: str, client: str) -> dict | None:
    """A lease for ``client``, or None while the round is full."""
    try:
        return gw.take_lease(name, client)
    except Conflict as e:
        if e.code != "round_full":
            raise
        return None


def test_over_selection_admits_more_trainers_than_the_goal_and_the_first_updates_win(node: RunningNode) -> None:
    gw = job(node, "o", 2, over_selection=1.5)
    leases = [gw.take_lease("o", f"c{i}")["lease"] for i in range(3)]
    with pytest.raises(Conflict):
        gw.take_lease("o", "c3")
    gw.push("o", update(1.0), client="c0", samples=1, base_version=0, lease=leases[0])
    gw.push("o", update(3.0), client="c1", samples=1, base_version=0, lease=leases[1])
    with pytest.raises(Conflict) as info:  # surplus: pull the next version and retrain
        gw.push("o", update(9.0), client="c2", samples=1, base_version=0, lease=leases[2])
    # the round is full until its model is installed, then the update is one version behind
    assert (info.value.code, info.value.extra["version"]) in {("round_full", 0), ("version_conflict", 1)}, info.value
    wait_for(lambda: gw.job("o")["version"] == 1, what="version 1")
    assert model_value(gw, "o") == (1, pytest.approx(2.0))


def test_leases_and_rounds_over_grpc(node: RunningNode) -> None:
    job(node, "g", 1, lease_ttl_s=60.0)  # no lease lapses here, however slow the machine
    g = Gateway(node.grpc, protocol="grpc")
    lease = g.take_lease("g", "c")
    assert lease["version"] == 0 and g.heartbeat("g", lease["lease"])["ttl_s"] == 60.0
    g.release_lease("g", lease["lease"])
    with pytest.raises(NotFound):
        g.heartbeat("g", lease["lease"])
    lease = g.take_lease("g", "c")
    g.push("g", update(2.0), client="c", samples=4, base_version=0, lease=lease["lease"])
    wait_for(lambda: g.job("g")["version"] == 1, what="version 1")
    rounds = g.rounds("g")
    assert [(r["outcome"], r["updates"], r["samples"], r["new_version"]) for r in rounds] == [("complete", 1, 4, 1)]
    assert g.job("g")["last_round"]["outcome"] == "complete"
