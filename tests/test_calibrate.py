"""`lifl calibrate` (appendix E): the knee of E over the arrival rate, and a run against a real node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import RunningNode
from lifl.control.calibrate import Capacity, Step, find_capacity


@pytest.mark.parametrize("steps,expected", [
    # E rises 2x at 8/s: MC = 8 x 0.004
    ([Step(1, 1, 0.002), Step(2, 2, 0.002), Step(4, 4, 0.0025), Step(8, 8, 0.004)], Capacity(0.032, 8, 0.004, True)),
    # the node could not keep up with 8/s (acknowledged 5)
    ([Step(1, 1, 0.002), Step(4, 4, 0.002), Step(8, 5, 0.0021)], Capacity(5 * 0.0021, 5, 0.0021, True)),
    # E never rose: the largest k x E seen, a lower bound
    ([Step(1, 1, 0.002), Step(2, 2, 0.0021), Step(4, 4, 0.002)], Capacity(0.008, 4, 0.002, False)),
    # E falls as caches warm: the knee is measured against the lowest E before it
    ([Step(1, 1, 0.004), Step(4, 4, 0.001), Step(8, 8, 0.003)], Capacity(0.024, 8, 0.003, True)),
    # steps that aggregated nothing are skipped
    ([Step(1, 0, 0.0), Step(2, 2, 0.001), Step(4, 4, 0.003)], Capacity(0.012, 4, 0.003, True)),
])
def test_capacity_is_k_times_e_at_the_knee(steps: list[Step], expected: Capacity) -> None:
    got = find_capacity(steps)
    assert got.saturated == expected.saturated and got.rate == expected.rate and got.e == expected.e
    assert got.capacity == pytest.approx(expected.capacity)


def test_no_aggregation_at_all_cannot_calibrate() -> None:
    with pytest.raises(ValueError, match="nothing to calibrate"):
        find_capacity([Step(1, 0, 0.0)])


@pytest.mark.slow
def test_calibrate_measures_a_node_and_stores_its_capacity(node: RunningNode) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lifl", "calibrate", "--redis", node.state.url, "--update-mb", "0.25",
         "--step-seconds", "1", "--max-rate", "8", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)[node.node.config.node]
    assert result["capacity"] > 0 and len(result["steps"]) >= 2
    assert all(s["rate"] > 0 for s in result["steps"])
    stored = node.state.capacities()[node.node.config.node]
    assert stored == pytest.approx(result["capacity"])
