"""A short FL job through a real node: simulated clients train a CNN on digits to a modest accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from lifl import demo

pytestmark = pytest.mark.slow


def test_short_job_reaches_modest_accuracy_and_reports_it(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--clients", "30", "--active", "6", "--goal", "3", "--target", "0.7", "--workers", "1",
                              "--hibernate", "0.2", "--max-minutes", "3", "--results", str(tmp_path), "--json"])
    summary = demo.run(args)
    assert summary["reached_target"] and summary["final_accuracy"] >= 0.7
    for key in ("rounds", "final_accuracy", "time_to_accuracy_s", "act_p50_ms", "act_p95_ms", "aggregation_cpu_s"):
        assert summary[key] is not None and summary[key] >= 0, key
    assert summary["rounds"] >= 1 and summary["act_p95_ms"] >= summary["act_p50_ms"] > 0
    assert summary["peak_memory_mb"] > 0 and summary["aggregation_cpu_s"] > 0
    for plot in summary["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == summary["rounds"]
