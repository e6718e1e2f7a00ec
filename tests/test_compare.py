"""`lifl bench compare`: one run over every system gives the documented JSON, tables and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lifl.bench.compare import TARGETS, ratios, tables


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the bench it runs is given 1800 s: pytest's default 300 s cut it short on a loaded machine
def test_compare_json_has_the_documented_fields(tmp_path: Path) -> None:
    results = tmp_path / "compare"
    done = subprocess.run(
        [sys.executable, "-m", "lifl", "bench", "compare", "--json", "--sizes-mb", "2", "--reps", "1",
         "--systems", "lifl,sf,sf-micro,sl", "--target", "0.5", "--max-minutes", "3", "--results", str(results),
         "--sections", "transfer,queuing,tta,load", "--load-rounds", "1", "--load-goal", "2",
         "--load-max-minutes", "6"],  # its clients train a ResNet-18: a round of ten took over 3 minutes on 2 busy cores
        capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    systems = {"lifl", "sf", "sf-micro", "sl"}
    assert {r["system"] for r in result["transfer"]} == systems
    for r in result["transfer"]:
        assert r["size_mb"] == 2.0 and r["latency_ms"] > 0 and r["cpu_ms"] >= 0
    sl = next(r for r in result["transfer"] if r["system"] == "sl")
    assert 0 < sl["sidecar_ms"] + sl["broker_ms"] <= sl["latency_ms"] * 1.01
    assert {r["system"] for r in result["queuing"]} == systems
    for r in result["queuing"]:
        assert r["memory_mb"] > 0 and r["cpu_ms"] >= 0 and r["delay_ms"] > 0, r
    assert {r["system"] for r in result["tta"]} == systems
    for r in result["tta"]:
        assert r["target_accuracy"] == 0.5
        assert r["time_to_accuracy_s"] > 0 and r["aggregation_cpu_s"] > 0 and r["rounds"] >= 1, r
    assert {r["system"] for r in result["load"]} == systems
    for r in result["load"]:
        assert r["model"] == "resnet18" and r["rounds"] == 1 and result["load_setup"]["goal"] == 2 and r["time_s"] > 0 and r["aggregation_cpu_s"] > 0, r
        assert r["aggregation_tail_ms_p50"] > 0 and set(r["cpu_s_by_role"]) >= {"aggregators"}
    assert set(result["ratios"]) == {f"{s}.{f}.{b}" for s, f, b, _ in TARGETS}
    saved = json.loads((results / "compare.json").read_text())
    assert set(saved["series"]) == systems and all(saved["series"][s] for s in systems)
    assert {"t", "arrivals", "aggregators", "cpu_s"} <= set(saved["series"]["sl"][0])
    assert (results / "tables.txt").read_text().startswith("transfer")
    for plot in ("transfer.png", "queuing.png", "tta_series.png"):
        assert (results / plot).stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--systems", "lifl,nope"], "unknown system nope"),
    (["--sections", "speed"], "unknown section speed"),
    (["--models", "resnet999"], "unknown model resnet999"),
    (["--sizes-mb", "two"], "--sizes-mb takes sizes"),
    (["--sizes-mb", "5000"], "between 1 and 1000 MB"),
    (["--reps", "0"], "--reps, --load-rounds and --load-goal must be at least 1"),
    (["--load-goal", "0"], "--reps, --load-rounds and --load-goal must be at least 1"),
])
def test_compare_refuses_bad_arguments(argv: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "lifl", "bench", "compare", "--results", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr


def test_ratios_are_baseline_over_lifl_at_the_largest_size() -> None:
    result = {
        "transfer": [{"system": "lifl", "size_mb": 1.0, "latency_ms": 1.0}, {"system": "sf", "size_mb": 1.0, "latency_ms": 99.0},
                     {"system": "lifl", "size_mb": 230.0, "latency_ms": 2.0}, {"system": "sf", "size_mb": 230.0, "latency_ms": 5.0},
                     {"system": "sl", "size_mb": 230.0, "latency_ms": 10.0}],
        "tta": [{"system": "lifl", "time_to_accuracy_s": 10.0, "aggregation_cpu_s": 1.0},
                {"system": "sl", "time_to_accuracy_s": 30.0, "aggregation_cpu_s": None}],
    }
    r = ratios(result)
    assert r["transfer.latency_ms.sf"] == {"ratio": 2.5, "target": 3.0, "met": False}
    assert r["transfer.latency_ms.sl"] == {"ratio": 5.0, "target": 5.8, "met": False}
    assert r["tta.time_to_accuracy_s.sl"] == {"ratio": 3.0, "target": 2.7, "met": True}
    assert r["tta.aggregation_cpu_s.sl"]["ratio"] is None and not r["tta.aggregation_cpu_s.sl"]["met"]
    assert r["queuing.cpu_ms.sl"]["ratio"] is None  # not measured
    assert "NOT met" in tables({"ratios": r})
