"""`lifl bench throughput`: one small run gives the documented JSON for every system, size and
protocol; its refusals of bad flags are clear; and a round of 10,000 updates of 4 KB on one
node completes and is the exact FedAvg of what its clients were told was acknowledged."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lifl.bench.compare import running
from lifl.bench.throughput import BIG_ROUND, ROLES, Case, System, measure


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_throughput_json_has_the_documented_fields() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lifl", "bench", "throughput", "--json", "--sizes", "4k,400k", "--goals", "20",
         "--protocols", "http,grpc", "--rounds", "2", "--clients", "2", "--connections", "2"],
        capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    by = {(r["system"], r["size"], r["protocol"]): r for r in result["results"]}
    # lifl over both protocols, SF over HTTP only (it has no gRPC API), the reference over both
    assert set(by) == {(s, size, p) for size in ("4k", "400k") for s, p in
                       (("lifl", "http"), ("lifl", "grpc"), ("sf", "http"), ("reference", "http"), ("reference", "grpc"))}
    for (system, _, _), r in by.items():
        assert r["updates_per_s"] > 0 and r["cpu_ms_per_update"] > 0 and 0 < r["ack_ms_p50"] <= r["ack_ms_p99"], r
        if system == "reference":
            continue
        assert r["updates"] == r["expected_updates"] == 2 * 20 and r["exact"], r
        assert set(r["cpu_ms_per_update_by_role"]) == set(ROLES) and r["close_ms"] is not None, r
        assert abs(sum(r["cpu_ms_per_update_by_role"].values()) - r["cpu_ms_per_update"]) < 1e-3
    targets = {(t["target"], t["size"], t["protocol"]) for t in result["targets"]}
    assert ("cpu_vs_sf", "4k", "grpc") in targets and ("rate_vs_sf", "400k", "http") in targets
    assert ("cpu_vs_reference (stretch)", "4k", "http") in targets and result["all_targets_met"] in (True, False)


@pytest.mark.parametrize("argv, message", [
    (["--systems", "lifl,nope"], "unknown system nope"),
    (["--sizes", "4k,3m"], "unknown size 3m"),
    (["--protocols", "quic"], "unknown protocol quic"),
    (["--goals", "ten"], "--goals takes integers"),
    (["--goals", "0"], "must be positive"),
    (["--clients", "0"], "must be positive"),
    (["--systems", "sf", "--big-round"], "--big-round runs on lifl"),
])
def test_bad_flags_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "lifl", "bench", "throughput", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_round_of_ten_thousand_updates_completes_exactly() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="lifl-throughput-test-", dir="/tmp"))
    tmp.chmod(0o755)
    try:
        with open(tmp / "systems.log", "w") as log, running("lifl", tmp, log) as sut:
            result = measure(System("lifl", sut), Case("4k", BIG_ROUND, "http", 1), 4, 4, seed=77)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert result["updates"] == result["expected_updates"] == BIG_ROUND
    assert result["exact"] and result["close_ms"] is not None
