"""The comparison baselines (lifl.baselines): each aggregates exactly what lifl does, refuses bad
input with a code, and shuts down leaving nothing behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from conftest import RunningNode, wait_for
from lifl import errors
from lifl.baselines.aggregate import MAX_BATCH_INPUTS, Input, frame, framed_size, unframe
from lifl.baselines.broker import Broker
from lifl.baselines.serverful import PARTIAL_METHOD, TopClient
from lifl.baselines.serverless import get_json
from lifl.baselines.system import BaselineConfig, BaselineSystem
from lifl.client import Gateway, from_blob, to_blob

pytestmark = pytest.mark.slow
SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 72), "fc.bias": (10,)}
BASELINES = ["sf", "sf-micro", "sl"]


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def reference(updates: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """FedAvg in float64: the answer every system must give."""
    total = sum(n for _, n in updates)
    return {k: sum(u[k].astype(np.float64) * n for u, n in updates) / total for k in SHAPES}


@pytest.fixture
def baseline(request: pytest.FixtureRequest) -> Iterator[BaselineSystem]:
    system = BaselineSystem(BaselineConfig(request.param, http="127.0.0.1:0", fan_in=2, kpa_scale=0.02), log=open(os.devnull, "w"))
    system.start()
    yield system
    pids = system.all_pids()
    system.stop()
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"], "a process outlived stop()"
    assert not system.run_dir.exists()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def run_rounds(address: str, rounds: list[list[tuple[dict[str, np.ndarray], int]]], first: dict[str, np.ndarray],
               token: str | None = None, job: str = "j") -> list[dict[str, np.ndarray]]:
    gateway = Gateway(address, token=token)
    try:
        gateway.create_job(job, len(rounds[0]))
        gateway.set_model(job, to_blob(first))
        results = []
        for version, updates in enumerate(rounds):
            for i, (update, samples) in enumerate(updates):
                assert gateway.push(job, to_blob(update), samples=samples, base_version=version, client=f"c{i}")["version"] == version
            assert gateway.wait_for_version(job, version, 60)["version"] == version + 1  # held until the install
            got_version, blob = gateway.model(job)
            assert got_version == version + 1
            results.append(from_blob(blob))
        return results
    finally:
        gateway.close()


def make_rounds(seed: int, n_rounds: int = 2, goal: int = 5) -> tuple[dict[str, np.ndarray], list[list[tuple[dict[str, np.ndarray], int]]]]:
    rng = np.random.default_rng(seed)
    return model(rng), [[(model(rng), int(rng.integers(1, 500))) for _ in range(goal)] for _ in range(n_rounds)]


@pytest.mark.parametrize("baseline", BASELINES, indirect=True)
def test_baseline_aggregates_as_lifl_does(baseline: BaselineSystem, node: RunningNode) -> None:
    """Two rounds of five updates (SL: leaves of two, through the broker, then the top): the same
    FedAvg as float64, and as lifl's own node on the same updates."""
    first, rounds = make_rounds(7)
    ours = run_rounds(baseline.http, rounds, first)
    from conftest import OPERATOR_TOKEN

    lifls = run_rounds(node.http, rounds, first, token=OPERATOR_TOKEN)
    for got, lifl_got, updates in zip(ours, lifls, rounds):
        want = reference(updates)
        for k in SHAPES:
            assert got[k].dtype == np.float32
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6)
            np.testing.assert_allclose(got[k], lifl_got[k], rtol=0, atol=1e-6)
    rounds_done = [json.loads(r) for r in baseline_jobs(baseline).redis.lrange("bl:rounds:j", 0, -1)]
    assert [r["version"] for r in rounds_done] == [1, 2] and all(r["updates"] == 5 for r in rounds_done)


def baseline_jobs(system: BaselineSystem):
    from lifl.baselines.jobs import Jobs

    return Jobs(system.redis_url)


@pytest.mark.parametrize("baseline", ["sf"], indirect=True)
def test_round_rules_and_refusals(baseline: BaselineSystem) -> None:
    rng = np.random.default_rng(1)
    first = model(rng)
    gateway = Gateway(baseline.http)
    try:
        with pytest.raises(errors.NotFound):
            gateway.job("nope")
        gateway.create_job("r", 2)
        with pytest.raises(errors.Conflict) as e:
            gateway.create_job("r", 2)
        assert e.value.code == "job_exists"
        with pytest.raises(errors.Conflict) as e:
            gateway.push("r", to_blob(first), samples=1, base_version=0)
        assert e.value.code == "no_model"
        gateway.set_model("r", to_blob(first))
        with pytest.raises(errors.Conflict) as e:
            gateway.set_model("r", to_blob(first))
        assert e.value.code == "model_exists"
        with pytest.raises(errors.Conflict) as e:
            gateway.push("r", to_blob(model(rng)), samples=1, base_version=3)
        assert e.value.code == "version_conflict" and e.value.extra["version"] == 0
        bad = {**first, "fc.bias": np.zeros(11, np.float32)}
        nan = {**first, "fc.bias": np.full(10, np.nan, np.float32)}
        extra = {**first, "other": np.zeros(1, np.float32)}
        for update, code in ((bad, "shape_mismatch"), (nan, None), (extra, "unexpected_tensor")):
            with pytest.raises((errors.Unprocessable, errors.BadRequest)) as e:
                gateway.push("r", to_blob(update), samples=1, base_version=0)
            assert code is None or e.value.code == code
        gateway.push("r", to_blob(model(rng)), samples=2, base_version=0)
        gateway.push("r", to_blob(model(rng)), samples=2, base_version=0)
        with pytest.raises(errors.Conflict) as e:  # the goal is reached: the round takes no more
            gateway.push("r", to_blob(model(rng)), samples=2, base_version=0)
        assert e.value.code in ("round_full", "version_conflict")
    finally:
        gateway.close()
    host, port = baseline.http.rsplit(":", 1)
    blob = bytes(to_blob(first))
    cases = [  # (method, path, headers, body) -> status, code
        ("POST", "/v1/jobs/r/updates", {"X-Lifl-Base-Version": "1"}, blob, 400, "bad_header"),
        ("POST", "/v1/jobs/r/updates", {"X-Lifl-Samples": "x", "X-Lifl-Base-Version": "1"}, blob, 400, "bad_header"),
        ("POST", "/v1/jobs/r/updates", {"X-Lifl-Samples": "0", "X-Lifl-Base-Version": "1"}, blob, 400, "bad_header"),
        ("POST", "/v1/jobs/r/updates", {"X-Lifl-Samples": "1", "X-Lifl-Base-Version": "1"}, blob[:-5], 400, "truncated"),
        ("POST", "/v1/jobs/r/updates", {"X-Lifl-Samples": "1", "X-Lifl-Base-Version": "1"}, b"\xff" * 64, 413, "header_too_large"),
        ("POST", "/v1/jobs", {}, b"{not json", 400, "bad_json"),
        ("POST", "/v1/jobs", {}, b'{"job": "UPPER", "goal": 2}', 400, "bad_job"),
        ("POST", "/v1/jobs", {}, b'{"job": "g", "goal": 0}', 400, "bad_goal"),
        ("POST", "/v1/jobs", {}, b'{"job": "g", "goal": true}', 400, "bad_goal"),
        ("POST", "/v1/jobs", {}, b"[1]", 400, "bad_json"),
        ("GET", "/v1/nothing", {}, None, 404, "no_route"),
        ("PUT", "/v1/jobs/r/updates", {}, b"", 404, "no_route"),
    ]
    for method, path, headers, body, status, code in cases:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        assert response.status == status, (method, path, headers, answer)
        assert code is None or answer["error"]["code"] == code, (method, path, answer)
    # limits: a body over the limit is refused from its Content-Length, before it is read; no chunked bodies
    for headers, status, code in (({"Content-Length": str((1 << 30) + 1)}, 413, "too_large"),
                                  ({"Transfer-Encoding": "chunked"}, 400, "chunked_body")):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST", "/v1/jobs/r/updates")
        for k, v in {"X-Lifl-Samples": "1", "X-Lifl-Base-Version": "1", **headers}.items():
            conn.putheader(k, v)
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == status and json.loads(response.read())["error"]["code"] == code
        conn.close()


@pytest.mark.parametrize("baseline", ["sf-micro"], indirect=True)
def test_top_refuses_malformed_partials(baseline: BaselineSystem) -> None:
    top_address = baseline.children["top"].ready_line.rsplit(" ", 1)[1]
    jobs = baseline_jobs(baseline)
    jobs.create("p", 2)
    jobs.set_model("p", to_blob(model(np.random.default_rng(2))))
    top = TopClient(top_address)
    try:
        with pytest.raises(grpc.RpcError) as e:
            top.send("nope", 0, Input(b"x" * 10, 1, 1, False), fan_in=1)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        call = top.channel.stream_unary(PARTIAL_METHOD)
        for messages in ([b"not json"], [json.dumps({"job": "p", "size": 10, "fan_in": 1}).encode(), b"x" * 11],
                         [json.dumps({"job": "p", "size": 10, "fan_in": 1}).encode(), b"x" * 9],
                         [json.dumps({"job": "p", "size": 0, "fan_in": 1}).encode()],
                         [json.dumps({"job": "p", "size": 10, "fan_in": 0}).encode()], []):
            with pytest.raises(grpc.RpcError) as e:
                call(iter(messages), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, messages
        # a partial that is not a blob of the model is accepted as bytes, then loses its round only
        top.send("p", 0, Input(b"x" * 10, 1, 1, True), fan_in=1)
    finally:
        top.close()
    first, rounds = make_rounds(3, n_rounds=1, goal=2)
    assert run_rounds(baseline.http, rounds, first, job="after")  # the top still aggregates


def test_batches_round_trip_and_malformed_batches_are_refused() -> None:
    items = [Input(b"a" * 10, 3, 1, False), Input(b"bb", 5, 2, True)]
    body = b"".join(bytes(p) for p in frame(items))
    assert len(body) == framed_size(items)
    back = list(unframe(body))
    assert [(bytes(i.blob), i.samples, i.updates, i.partial) for i in back] == [(b"a" * 10, 3, 1, False), (b"bb", 5, 2, True)]
    second = framed_size(items[:1])  # where the second input's frame starts
    bad = [body[:5], body[:-1], body[:second] + b"\x07" + body[second + 1 :],
           b"".join(bytes(p) for p in frame([Input(b"a", 0, 1, False)])),
           b"".join(bytes(p) for p in frame([Input(b"a", 1, 0, False)])),
           b"".join(bytes(p) for p in frame([Input(b"", 1, 1, False)] * (MAX_BATCH_INPUTS + 1)))]
    for batch in bad:
        with pytest.raises(errors.BadRequest) as e:
            list(unframe(batch))
        assert e.value.code == "bad_batch"


def test_a_broker_write_waits_out_a_server_busier_than_redis_pys_default_timeout(redis_url: str) -> None:
    """redis-py 8 gives up on a command after 5 s unless told otherwise, and a write given up
    halfway loses the update: the broker waits up to BULK_TIMEOUT_S."""
    broker = Broker(redis_url)
    pause_ms = 6000  # longer than redis-py 8's default socket timeout
    assert redis.Redis.from_url(redis_url).client_pause(pause_ms, all=False)  # writes wait; reads go on
    started = time.monotonic()
    broker.publish("updates", "j", 0, Input(b"x" * (1 << 20), 1, 1, False))
    assert time.monotonic() - started >= pause_ms / 1000 * 0.9  # it did wait for the pause
    assert broker.length("updates", "j", 0) == 1


@pytest.mark.parametrize("baseline", ["sl"], indirect=True)
def test_sl_scales_from_zero_with_cold_starts_and_back_to_zero(baseline: BaselineSystem) -> None:
    """KPA (windows scaled by 0.02: 1.2 s stable, 0.6 s grace): no instance before the first
    invocation, one started for it (a cold start), none again once idle."""
    dispatcher = baseline.children["dispatcher"].ready_line.rsplit(" ", 1)[1]
    assert get_json(dispatcher, "/status")["instances"] == 0
    first, rounds = make_rounds(5, n_rounds=1, goal=4)
    assert run_rounds(baseline.http, rounds, first)
    status = get_json(dispatcher, "/status")
    assert status["cold_starts"] >= 1 and all(s > 0 for s in status["cold_start_s"])
    wait_for(lambda: get_json(dispatcher, "/status")["instances"] == 0, what="scale to zero")
    wait_for(lambda: not baseline.pids()["aggregators"] and not baseline.pids()["sidecars"], what="instances' processes gone")
    # and from zero again
    first, rounds = make_rounds(6, n_rounds=1, goal=4)
    assert run_rounds(baseline.http, rounds, first, job="again")
    assert get_json(dispatcher, "/status")["cold_starts"] >= 2


def test_lifl_up_system_runs_a_baseline_until_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "lifl", "up", "--system", "sf-micro", "--http", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert "lifl baseline sf-micro is up" in lines[0]
        address = lines[1].split("http://")[1].strip()
        first, rounds = make_rounds(9, n_rounds=1, goal=3)
        assert run_rounds(address, rounds, first)
        children = [int(p) for p in subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_for(lambda: not [p for p in children if Path(f"/proc/{p}").exists() and _state(p) != "Z"], what="no process left")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv, message", [
    (["--system", "nope"], "invalid choice"),
    (["--system", "sl", "--nodes", "2"], "one node"),
    (["--system", "sf", "--grpc", "127.0.0.1:0"], "no gRPC"),
])
def test_lifl_up_system_refuses_what_baselines_do_not_have(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lifl", "up", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr
