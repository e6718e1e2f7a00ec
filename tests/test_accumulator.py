"""Float32 accumulators (a job's "accumulator": "float32"): half the memory of float64 partial
sums, each fold rounding an element once, within the documented bound of the float64 result."""

from __future__ import annotations

import numpy as np
import pytest

from lifl import format as fmt
from lifl.errors import BadRequest
from lifl.jobs import JobSpec
from lifl.kernels import validate
from test_fixedpoint import Memory, from_bf16, hierarchy, memory_spec, random_update, to_bf16

EPS32 = 2.0 ** -24  # float32's unit roundoff


def model_values(blob: bytes, spec: fmt.ModelSpec) -> np.ndarray:
    views = fmt.views(blob, fmt.parse_layout(blob))
    parts = [from_bf16(views[t.name]) if t.dtype is fmt.BF16 else views[t.name].astype(np.float64)
             for t in spec.tensors if t.dtype.kind == "f"]
    return np.concatenate([p.ravel() for p in parts])


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32"])
def test_float32_partial_sums_take_half_the_memory(dtype: str) -> None:
    tensors, _ = random_update(np.random.default_rng(0), dtype, 300)
    spec = memory_spec(tensors)
    assert spec.partial(fmt.F32).data_bytes == 4 * 300 + 16 * 5  # the integer tensor keeps its int128 sums
    assert spec.partial().data_bytes == 8 * 300 + 16 * 5


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_float32_sums_stay_within_the_bound_whatever_the_hierarchy(dtype: str) -> None:
    """Each stored fold rounds once: after at most K folds on any path, an element of the sum is
    within K * 2^-24 * sum(c * |w|) of the exact one, and the average within that / sum(c)
    (then both round to the model's dtype)."""
    rng = np.random.default_rng(7)
    updates = [random_update(rng, dtype, 301, scale=10.0) for _ in range(12)]
    samples = [int(s) for s in rng.integers(1, 100, len(updates))]
    spec = memory_spec(updates[0][0])
    exact = sum(s * e for (_, e), s in zip(updates, samples)) / sum(samples)
    magnitude = sum(s * np.abs(e) for (_, e), s in zip(updates, samples)) / sum(samples)
    folds = 2 * len(updates)  # a generous K: no path through `hierarchy` folds more often
    ulp = {"F16": 2.0 ** -11, "BF16": 2.0 ** -8, "F32": 2.0 ** -24, "F64": 2.0 ** -53}[dtype]
    for seed in range(5):
        memory = Memory(spec, None, fmt.F32)
        model = hierarchy(memory, [memory.update(t, s) for (t, _), s in zip(updates, samples)], np.random.default_rng(seed))
        got = model_values(model, spec)
        bound = folds * EPS32 * magnitude + ulp * np.abs(exact) + 1e-300
        assert np.all(np.abs(got - exact) <= bound)


def test_bf16_models_round_to_the_float64_result_or_its_neighbour() -> None:
    rng = np.random.default_rng(3)
    updates = [random_update(rng, "BF16", 3001) for _ in range(16)]
    samples = [int(s) for s in rng.integers(1, 1000, len(updates))]
    spec = memory_spec(updates[0][0])
    models = {}
    for floats in (fmt.F64, fmt.F32):
        memory = Memory(spec, None, floats)
        blob = hierarchy(memory, [memory.update(t, s) for (t, _), s in zip(updates, samples)], np.random.default_rng(1))
        views = fmt.views(blob, fmt.parse_layout(blob))
        models[floats.name] = np.concatenate([views["a"], views["b"]]).astype(np.int32)
    steps = np.abs(models["F32"] - models["F64"])  # bf16 bit patterns of the same sign: 1 = one ulp
    assert steps.max() <= 1 and (steps == 0).mean() > 0.99


@pytest.mark.parametrize("body, needle", [
    ({"accumulator": "float16"}, "must be one of float64, float32"),
    ({"accumulator": 32}, "must be one of"),
    ({"accumulator": None}, "must be one of"),
    ({"accumulator": "float32", "fixed_point": {"frac_bits": 16}}, "fixed point sums in integers"),
    ({"accumulator": "float32", "strategy": {"name": "fedadam"}}, "computes in float64"),
])
def test_bad_accumulators_are_refused(body: dict, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        JobSpec.from_request({"job": "j", "goal": 2, **body})


def test_accumulators_are_accepted() -> None:
    assert JobSpec.from_request({"job": "j", "goal": 2}).float_accumulator is fmt.F64
    assert JobSpec.from_request({"job": "j", "goal": 2, "accumulator": "float32"}).float_accumulator is fmt.F32


@pytest.mark.slow
def test_a_bf16_job_with_float32_accumulators_on_a_node(node) -> None:
    from conftest import wait_for
    from lifl.client import Gateway

    gw = Gateway(node.http)
    rng = np.random.default_rng(4)
    shapes = {"w": (40, 25), "b": (25,)}
    blobs = [fmt.encode({k: to_bf16(rng.standard_normal(s)) for k, s in shapes.items()}, dtypes={"w": "BF16", "b": "BF16"})
             for _ in range(6)]
    samples = [int(s) for s in rng.integers(1, 200, len(blobs))]
    models = {}
    for name, fields in [("f64", {}), ("f32", {"accumulator": "float32"}), ("f32-sharded", {"accumulator": "float32", "shards": 3})]:
        gw.create_job(name, len(blobs), **fields)
        gw.set_model(name, fmt.encode({k: np.zeros(s, np.uint16) for k, s in shapes.items()}, dtypes={"w": "BF16", "b": "BF16"}))
        for i, (blob, n) in enumerate(zip(blobs, samples)):
            gw.push(name, blob, client=f"c{i}", samples=n, base_version=0)
        wait_for(lambda: gw.model(name)[0] == 1, what=f"{name}'s round")
        blob = bytes(gw.model(name)[1])
        views = fmt.views(blob, validate(blob))
        models[name] = np.concatenate([views[k].ravel() for k in shapes]).astype(np.int32)
    for name in ("f32", "f32-sharded"):
        assert np.abs(models[name] - models["f64"]).max() <= 1
