"""Tensor-sharded aggregation on a real node: each shard's tree folds its slice of every
update, the tops write their slices into one object, and the model equals the unsharded one
(bit for bit under fixed point, within 1e-6 relative in floats)."""

from __future__ import annotations

import numpy as np
import pytest

from lifl import format as fmt
from lifl.errors import BadRequest, Unprocessable
from lifl.format import F32, ModelSpec, TensorSpec
from lifl.jobs import JobSpec
from lifl.kernels import validate
from lifl.node.agent import StepPartialSums, check_split
from lifl.shards import parts_of, split_record

SHAPES = {"embed": (64, 33), "w": (33, 17), "b": (17,), "scale": (1,)}


def encode(arrays: dict[str, np.ndarray]) -> bytearray:
    return fmt.encode(arrays)


def updates(n: int, seed: int = 3) -> tuple[list[bytearray], list[int]]:
    rng = np.random.default_rng(seed)
    blobs = []
    for i in range(n):
        arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        if i % 2:  # blobs may order their tensors differently from the model
            arrays = dict(reversed(list(arrays.items())))
        blobs.append(encode(arrays))
    return blobs, [int(s) for s in rng.integers(1, 300, n)]


def run_round(gw, name: str, blobs: list[bytearray], samples: list[int], **fields) -> dict[str, np.ndarray]:
    from conftest import wait_for

    gw.create_job(name, len(blobs), **fields)
    gw.set_model(name, encode({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}))
    for i, (blob, n) in enumerate(zip(blobs, samples)):
        gw.push(name, blob, client=f"c{i}", samples=n, base_version=0)
    wait_for(lambda: gw.model(name)[0] == 1, what=f"{name}'s round")
    model = bytes(gw.model(name)[1])
    return {k: v.copy() for k, v in fmt.views(model, validate(model)).items()}


@pytest.mark.slow
def test_sharded_rounds_install_the_unsharded_model(node) -> None:
    from lifl.client import Gateway

    gw = Gateway(node.http)
    blobs, samples = updates(7)
    fixed_point = {"frac_bits": 20, "width": 64}
    exact = {name: run_round(gw, name, blobs, samples, leaf_fan_in=fan_in, fixed_point=fixed_point, **extra)
             for name, fan_in, extra in [
                 ("fp-1", 2, {}), ("fp-4", 2, {"shards": 4}), ("fp-3t", 3, {"shards": 3, "shard_alignment": "tensor"}),
                 ("fp-9", 1, {"shards": 9}),
             ]}
    reference = exact.pop("fp-1")
    for name, model in exact.items():  # fixed point: the same bits
        for k in SHAPES:
            assert model[k].tobytes() == reference[k].tobytes(), (name, k)
    floats = run_round(gw, "float-1", blobs, samples)
    sharded = run_round(gw, "float-5", blobs, samples, shards=5)
    for k in SHAPES:
        np.testing.assert_allclose(sharded[k], floats[k], rtol=1e-6, atol=1e-7)
        mean = sum(n * fmt.views(b, validate(b))[k].astype(np.float64) for b, n in zip(blobs, samples)) / sum(samples)
        np.testing.assert_allclose(sharded[k], mean, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_sharded_round_of_one_update_installs_that_update(node) -> None:
    from lifl.client import Gateway

    gw = Gateway(node.http)
    blobs, samples = updates(1, seed=9)
    model = run_round(gw, "one", blobs, samples, shards=4, fixed_point={"frac_bits": 16, "width": 64})
    sent = fmt.views(blobs[0], validate(blobs[0]))
    for k in SHAPES:
        assert model[k].tobytes() == sent[k].tobytes()


@pytest.mark.slow
def test_sharded_jobs_refuse_what_they_cannot_do(node) -> None:
    from lifl.client import Gateway

    gw = Gateway(node.http)
    for fields, needle in [({"shards": 0}, "shards must be"), ({"shards": 65}, "shards must be"),
                           ({"shards": "all"}, "shards must be"), ({"shards": 2, "shard_alignment": "row"}, "shard_alignment")]:
        with pytest.raises(BadRequest, match=needle):
            gw.create_job("refused", 6, **fields)
    with pytest.raises(Exception):
        gw.job("refused")


@pytest.mark.parametrize("count, data_bytes, capacity, nodes, strategy, outcome", [
    (4, 4096, 1 << 30, 1, {}, "whole"),  # one node: its shards stay together
    (4, 4096, 1 << 30, 2, {}, "split"),
    (1, 4096, 1 << 30, 3, {}, "whole"),
    (0, 4096, 1 << 30, 3, {}, "whole"),  # "auto" keeps a small model whole
    (0, 1 << 20, 1 << 20, 3, {}, "split"),  # ...and cuts a large one
    (4, 4, 1 << 30, 2, {}, "whole"),  # a model of one element has one shard however many are asked
    (4, 4096, 1 << 30, 2, {"name": "fedadam"}, "split"),  # coordinate-wise: each node steps its shards
    (4, 4096, 1 << 30, 2, {"name": "krum"}, "refused"),  # distances of whole updates: one node
    (4, 4096, 1 << 30, 2, {"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 0.1}, "refused"),
    (4, 4096, 1 << 30, 1, {"name": "krum"}, "whole"),
])
def test_sharded_jobs_split_across_nodes(count: int, data_bytes: int, capacity: int, nodes: int,
                                          strategy: dict[str, object], outcome: str) -> None:
    spec = JobSpec.from_request({"job": "j", "goal": 4, "shards": count or "auto", **({"strategy": strategy} if strategy else {})})
    model = ModelSpec((TensorSpec("w", F32, (data_bytes // 4,)),))
    record = split_record(spec.shards, spec.shard_alignment, model, capacity, [f"n{k}" for k in range(nodes)])
    assert bool(record) == (outcome != "whole")
    parts = parts_of(model, record)[1] if record else ()
    if outcome == "refused":
        with pytest.raises(Unprocessable, match="reads whole updates"):
            check_split(spec, parts)
    else:
        check_split(spec, parts)


@pytest.mark.parametrize("sends, told", [
    ([0, 1], [False, False]),  # not all in: nobody steps yet
    ([0, 1, 2], [False, False, True]),  # the third completes them and steps
    ([2, 0, 2, 1], [False, False, False, True]),  # a rerun before completion counts once
    ([0, 1, 2, 2, 0], [False, False, True, True, False]),  # the stepper run again is told again, no other
])
def test_step_partial_sums_count_each_shard_once_and_name_one_stepper(sends: list[int], told: list[bool]) -> None:
    """Three shards whose tops send [1], [2] and [4] (shard k sends 2**k), in the order given."""
    sums = StepPartialSums(np.zeros(1))
    assert [sums.add(lane, np.array([2.0 ** lane]), 3) for lane in sends] == told
    assert sums.total.tolist() == [float(sum(1 << lane for lane in set(sends)))]
