"""`lifl bench large` in a small configuration: every system completes its round, and the
figures say what sharding and float32 accumulators change (full figures: `lifl bench large`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifl.bench import large
from lifl.format import BF16, TensorSpec


@pytest.mark.parametrize("parameters, shapes", [
    (8 * 4096 * 3, [(3, 4096)] * 8),
    (8 * 4096 * 3 + 5, [(3, 4096)] * 8 + [(5,)]),
    (100, [(100,)]),
])
def test_model_tensors(parameters: int, shapes: list[tuple[int, ...]]) -> None:
    tensors = large.model_tensors(parameters)
    assert [shape for _, _, shape in tensors] == shapes
    assert all(dtype is BF16 for _, dtype, _ in tensors)
    assert sum(TensorSpec(*t).numel for t in tensors) == parameters


@pytest.mark.slow
def test_a_small_large_run() -> None:
    result = large.run(300_000, clients=3, shards=3, nodes=3)
    assert result["update_bytes"] > 600_000 and result["memcpy_gbps"] > 0
    for name in large.SYSTEMS:
        r = result[name]
        assert r["round_s"] > 0 and r["ingest_gbps"] > 0 and r["aggregate_gbps"] > 0
        assert r["max_abs_error"] < 2 ** -4  # the model's bf16 rounding of averages below 4 in magnitude
    assert result["sharded"]["tasks"]["leaf"] == 3 * result["unsharded"]["tasks"]["leaf"]
    assert result["sharded"]["tasks"]["top"] == 3
    assert {"sharded_round_ratio", "sharded_aggregator_rss_ratio", "split_peak_ratio"} <= set(result)
    split = result["split"]  # three nodes in namespaces, each holding its shard of every update
    assert split["nodes"] == 3 and split["round_s"] > 0 and split["max_abs_error"] < 2 ** -4, split
    assert 0 < split["peak_shm_bytes_per_node"] < result["unsharded"]["peak_shm_bytes_per_node"]
    # what was in flight at the cut (socket buffers: all of this small file's second half) goes
    # again, never what the gateway had (the first half but for the requests' heads)
    resume, update_bytes = result["resume"], result["update_bytes"]
    assert resume["cuts"] == 1 and resume["resumes"] == 1
    assert 0 <= resume["resume_overhead_bytes"] < update_bytes - update_bytes // 2 + 4096
    flower = result["flower"]
    assert flower["completed"] and flower["replies_held"] == 3 and flower["round_s"] >= 0, flower
    assert set(result["flower_peak_ratio"]) == set(large.SYSTEMS)


@pytest.mark.slow
def test_a_round_flower_cannot_hold_fails_within_its_cap_and_says_how_many_replies_it_held(tmp_path: Path) -> None:
    """Replies of 12 MB widened to float32, Flower capped at 30 MB beyond its global model."""
    tensors = large.model_tensors(3_000_000)
    files = [tmp_path / f"update{i}" for i in range(3)]
    for i, path in enumerate(files):
        large.write_update(path, tensors, seed=i)
    large.write_update(tmp_path / "model", tensors, seed=None)
    capped = large.flower_system(files, tmp_path / "model", [1, 2, 3], 30 << 20)
    assert capped["completed"] is False and capped["round_s"] is None and 1 <= capped["replies_held"] < 3, capped
    assert capped["peak_above_baseline_bytes"] <= 30 << 20
