"""`lifl bench flstore`: the s3proxy launcher, the baselines' function servers against the
workloads called directly, the bench's data, and one small run's JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lifl import format as fmt
from lifl.bench.flstore import (BUCKET, SYSTEMS, WORKLOADS, BaselineTarget, RoundBlobs, S3Objects, S3Proxy, fedavg,
                                make_round, outlier_count, query_body, ratios, tables)
from lifl.errors import NotFound
from lifl.flstore import workloads


def _tensors(blob: bytes | bytearray) -> dict[str, Any]:
    return fmt.views(blob, fmt.parse_layout(blob))


def _cmdlines_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.slow
def test_s3proxy_serves_objects_from_files_and_stops_leaving_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "s3"
    directory.mkdir()
    with S3Proxy(directory) as s3:
        endpoint = s3.start()
        pid, port = s3.pid, int(endpoint.rsplit(":", 1)[1])
        objects = S3Objects(endpoint)
        blob = os.urandom(3 << 20)
        objects.put("job/rounds/0/updates/client-0", blob)
        assert objects.get("job/rounds/0/updates/client-0") == blob
        assert (directory / "objects" / BUCKET / "job" / "rounds" / "0" / "updates" / "client-0").read_bytes() == blob
        with pytest.raises(NotFound):
            objects.get("job/rounds/0/updates/nobody")
    assert not Path(f"/proc/{pid}").exists()
    assert _cmdlines_naming(str(directory / "s3proxy.properties")) == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.fixture(scope="module")
def cnn_round() -> tuple[RoundBlobs, bytearray]:
    blobs = make_round("cnn", 6)
    return blobs, fedavg(blobs)


@pytest.fixture(scope="module", params=["objstore", "cache"])
def baseline(request: pytest.FixtureRequest, cnn_round: tuple[RoundBlobs, bytearray],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[BaselineTarget]:
    blobs, aggregate = cnn_round
    with open(tmp_path_factory.mktemp("logs") / "systems.log", "w") as log:
        target = BaselineTarget(request.param, log)
        try:
            target.prepare("digits", blobs, aggregate, round_id=3)
            yield target
        finally:
            pids = target.pids()
            target.stop()
            assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _direct(workload: str, blobs: RoundBlobs, aggregate: bytearray, body: dict[str, Any]) -> dict[str, Any]:
    """The workload called in this process on the blobs the bench uploaded."""
    params = workloads.check_params(workload, {k: v for k, v in body.items() if k not in ("workload", "round", "version")})
    if workload == "inference":
        return workloads.inference("cnn", "direct", _tensors(aggregate), params)
    updates = [workloads.ClientUpdate(c, s, _tensors(b)) for c, s, b in blobs.updates]
    with_aggregate = workload != "cluster"
    rnd = workloads.RoundData(3, 0, _tensors(blobs.base), _tensors(aggregate) if with_aggregate else None, updates)
    return workloads.run(workload, [rnd], params)


@pytest.mark.slow
@pytest.mark.parametrize("workload", WORKLOADS)
def test_baseline_function_answers_as_the_workload_called_directly(
        baseline: BaselineTarget, cnn_round: tuple[RoundBlobs, bytearray], workload: str) -> None:
    blobs, aggregate = cnn_round
    body = query_body(workload, 3, [[[[0.5] * 8] * 8]] * 4)
    response, wire = baseline.query("digits", body)
    assert response["result"] == json.loads(json.dumps(_direct(workload, blobs, aggregate, body)))
    assert response["workload"] == workload and response["data"]["memory"] == 0
    # everything it needed came from the store in this very request: the job's record, then the
    # model (inference), or the round's manifest, its base, its aggregate (not for cluster) and updates
    data = response["data"]
    if workload == "inference":
        assert data["objects"] == data["store"] == 2 and data["bytes_fetched"] > len(aggregate)
    else:
        models = [blobs.base] + ([aggregate] if workload != "cluster" else [])
        assert data["objects"] == data["store"] == 2 + len(models) + len(blobs.updates)
        assert data["bytes_fetched"] > sum(len(m) for m in models) + blobs.update_bytes
    assert wire > len(json.dumps(body))
    assert 0 <= response["seconds"]["fetch"] <= response["seconds"]["total"]


@pytest.mark.slow
@pytest.mark.parametrize("body, status, code", [
    ({"workload": "gossip", "round": 3}, 400, "unknown_workload"),
    ({"workload": "cluster", "round": 3, "k": 0}, 400, "bad_query"),
    ({"workload": "filter", "round": 4}, 404, "not_retained"),
    ({"workload": "filter", "round": -1}, 400, "bad_query"),
    ({"workload": "inference", "version": 7, "inputs": [[[[0.0] * 8] * 8]]}, 404, "not_found"),
    ({"workload": "inference", "version": 1, "inputs": [[1.0, 2.0]]}, 400, "bad_inputs"),
])
def test_baseline_function_refuses_bad_queries(baseline: BaselineTarget, body: dict[str, Any], status: int, code: str) -> None:
    with pytest.raises(RuntimeError, match=f"answered {status}: .*{code}"):
        baseline.query("digits", body)
    assert baseline.query("digits", {"workload": "cosine", "round": 3})[0]["result"]["clients"]  # still serving


def test_the_round_has_outliers_filtering_finds() -> None:
    blobs = make_round("cnn", 20)
    assert blobs.outliers == {"client-18": "scaled", "client-19": "sign-flipped"}
    updates = [workloads.ClientUpdate(c, s, _tensors(b)) for c, s, b in blobs.updates]
    rnd = workloads.RoundData(0, 0, _tensors(blobs.base), _tensors(fedavg(blobs)), updates)
    suspects = {s["client"] for s in workloads.run("filter", [rnd], workloads.check_params("filter", {}))["suspects"]}
    assert suspects == set(blobs.outliers)
    assert make_round("cnn", 20).updates[5][2] == blobs.updates[5][2]  # seeded: every system gets the same bytes


@pytest.mark.parametrize("clients, outliers", [(3, 1), (4, 1), (5, 2), (20, 2)])
def test_outliers_stay_a_minority(clients: int, outliers: int) -> None:
    assert outlier_count(clients) == outliers


@pytest.mark.slow
def test_bench_flstore_json_has_the_documented_schema(tmp_path: Path) -> None:
    out = tmp_path / "flstore"
    done = subprocess.run([sys.executable, "-m", "lifl", "bench", "flstore", "--json", "--model", "cnn", "--clients", "4",
                           "--requests", "2", "--trace", "3,6", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert {(r["system"], r["workload"], r["model"]) for r in result["runs"]} == {
        (s, w, "cnn") for s in SYSTEMS for w in WORKLOADS}
    for r in result["runs"]:
        assert set(r) == {"system", "workload", "model", "first_ms", "p50_ms", "p95_ms", "cpu_s", "bytes_moved", "hit_rate"}, r
        assert r["first_ms"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"] and r["cpu_s"] >= 0 and r["bytes_moved"] > 0, r
        assert r["hit_rate"] == (1.0 if r["system"] == "lifl" else 0.0), r
    assert len(result["ratios"]) == 2 * len(WORKLOADS)
    for r in result["ratios"]:
        assert r["value"] > 0 and (r["met"] is None) == (r["workload"] == "inference"), r
    trace = result["trace"]
    assert (trace["model"], trace["inference"], trace["filter"]) == ("cnn", 3, 6)
    for mode in ("static", "adaptive"):
        assert len(trace[mode]["requests"]) == 9 and trace[mode]["mean_ms"] > 0
        assert trace[mode]["node_stats"]["hit_rate"] == pytest.approx(trace[mode]["hit_rate"], abs=1e-4)  # the node agrees
    assert trace["static"]["hit_rate"] < trace["adaptive"]["hit_rate"]
    assert trace["static"]["bytes_fetched"] > trace["adaptive"]["bytes_fetched"]
    assert result["environment"]["cpus"] == os.cpu_count()
    assert json.loads((out / "flstore.json").read_text())["runs"] == result["runs"]
    assert (out / "tables.txt").read_text().startswith("side by side")
    for plot in ("p50.png", "trace.png"):
        assert (out / plot).stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--systems", "lifl,s3"], "unknown system s3"),
    (["--clients", "2"], "--clients must be between 3 and 200"),
    (["--clients", "201"], "--clients must be between 3 and 200"),
    (["--requests", "0"], "--requests must be between 1 and 1000"),
    (["--requests", "1001"], "--requests must be between 1 and 1000"),
    (["--trace", "30"], "--trace takes two counts"),
    (["--trace", "0,5"], "--trace counts must be between 1 and 10000"),
    (["--trace", "1,10001"], "--trace counts must be between 1 and 10000"),
    (["--systems", "objstore"], "the trace runs on lifl"),
])
def test_bench_flstore_refuses_bad_arguments(argv: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "lifl", "bench", "flstore", "--out", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr


def test_ratios_are_baseline_over_lifl_with_targets_except_model_compute() -> None:
    runs = [{"system": s, "workload": w, "model": "cnn", "p50_ms": p} for s, w, p in [
        ("lifl", "filter", 10.0), ("objstore", "filter", 150.0), ("cache", "filter", 20.0),
        ("lifl", "inference", 5.0), ("objstore", "inference", 10.0)]]
    got = {(r["workload"], r["ratio"]): r for r in ratios(runs)}
    assert got[("filter", "objstore_p50/lifl_p50")] == {"workload": "filter", "model": "cnn", "ratio": "objstore_p50/lifl_p50",
                                                        "value": 15.0, "target": 10.0, "met": True}
    assert got[("filter", "cache_p50/lifl_p50")]["value"] == 2.0 and not got[("filter", "cache_p50/lifl_p50")]["met"]
    assert got[("inference", "objstore_p50/lifl_p50")]["met"] is None and ("inference", "cache_p50/lifl_p50") not in got
    text = tables({"runs": [], "ratios": list(got.values()), "trace": None})
    assert "NOT met" in text and "model compute" in text
