"""Fixed-point aggregation: the job option, the kernels against numpy, order- and shape-independence
of the bits, overflow detection, the error against float64 FedAvg, and rounds on a real node."""

from __future__ import annotations

import numpy as np
import pytest

from lifl import format as fmt
from lifl.errors import BadRequest, Unprocessable
from lifl.fedavg import Contribution, StreamingFedAvg, average_into
from lifl.fixedpoint import BOUND_TENSOR, FixedPoint, partial_spec, read_bound, write_bound
from lifl.kernels import Tensors, finalize, fold, validate

FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------- the job option ----------

@pytest.mark.parametrize("obj, expected", [
    (None, None),
    ({}, None),
    ({"frac_bits": 16, "width": 32}, FixedPoint(16, 32)),
    ({"width": 32}, FixedPoint(24, 32)),
    ({"frac_bits": 62}, FixedPoint(62, 64)),
    ({"frac_bits": 0, "width": 64}, FixedPoint(0, 64)),
])
def test_from_request_accepts(obj: object, expected: FixedPoint | None) -> None:
    fp = FixedPoint.from_request(obj)
    assert fp == expected
    if fp is not None:
        assert FixedPoint.from_request(fp.to_json()) == fp


@pytest.mark.parametrize("obj", [
    "24", [24], 24, {"width": 16}, {"width": "64"}, {"frac_bits": 31, "width": 32}, {"frac_bits": 63},
    {"frac_bits": -1}, {"frac_bits": 1.5}, {"frac_bits": True}, {"scale": 24},
])
def test_from_request_refuses(obj: object) -> None:
    with pytest.raises(BadRequest) as e:
        FixedPoint.from_request(obj)
    assert e.value.code == "bad_fixed_point"


def test_partial_spec_sums_floats_in_integers_of_the_width_and_carries_the_bound() -> None:
    spec = fmt.ModelSpec((fmt.TensorSpec("w", fmt.F32, (3, 2)), fmt.TensorSpec("n", fmt.I32, (2,)),
                          fmt.TensorSpec("h", fmt.BF16, (4,))))
    for fp, integer in ((FixedPoint(24, 64), fmt.I64), (FixedPoint(16, 32), fmt.I32)):
        partial = partial_spec(spec, fp)
        assert [(t.name, t.dtype, t.shape) for t in partial.tensors] == [
            ("w", integer, (3, 2)), ("n", fmt.I128, (2,)), ("h", integer, (4,)), (BOUND_TENSOR, fmt.I64, (1,))]
    assert partial_spec(spec, None) == spec.partial()  # the float path is unchanged
    with pytest.raises(BadRequest):
        partial_spec(fmt.ModelSpec((fmt.TensorSpec(BOUND_TENSOR, fmt.F32, (1,)),)), FixedPoint())


# ---------- kernels against numpy ----------

class Memory:
    """Objects in bytearrays, so that the pure fold logic runs without the store."""

    def __init__(self, spec: fmt.ModelSpec, fp: FixedPoint | None, floats: fmt.DType = fmt.F64) -> None:
        self.spec, self.fp = spec, fp
        self.partial = partial_spec(spec, fp, floats)
        self.partial_header = fmt.spec_header(self.partial)

    def update(self, tensors: dict[str, np.ndarray], samples: int) -> Contribution:
        buffer = fmt.encode(tensors, dtypes={k: "BF16" for k, v in tensors.items() if v.dtype == np.uint16})
        return Contribution(Tensors.of(buffer, fmt.parse_layout(buffer), self.spec), samples, 1, False, buffer)

    def accumulator(self) -> tuple[Tensors, bytearray]:
        buffer = bytearray(self.partial_header) + bytearray(self.partial.data_bytes)
        return Tensors.of(buffer, fmt.parse_layout(buffer, allow_partial=True), self.spec), buffer

    def reopen(self, total: Contribution) -> Contribution:
        """A partial sum as its parent sees it: only the object, its bound read from it."""
        buffer = total.token
        layout = fmt.parse_layout(buffer, allow_partial=True)
        if self.fp is not None:
            write_bound(buffer, layout, total.bound)  # what the handler does after every fold
        bound = read_bound(buffer, layout) if self.fp is not None else 0
        return Contribution(Tensors.of(buffer, layout, self.spec), total.samples, total.updates, True, buffer, bound)

    def model(self, total: Contribution) -> bytes:
        """The installed model's bytes: a lone update as it is, a sum averaged."""
        if not total.partial:
            return bytes(total.token)
        buffer = bytearray(fmt.spec_header(self.spec)) + bytearray(self.spec.data_bytes)
        average_into(Tensors.of(buffer, fmt.parse_layout(buffer), self.spec), total, self.fp)
        return bytes(buffer)

    def values(self, blob: bytes | bytearray) -> dict[str, np.ndarray]:
        return fmt.views(blob, fmt.parse_layout(blob, allow_partial=True))


def random_update(rng: np.random.Generator, dtype: str, n: int, scale: float = 1.0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Tensors of ``dtype`` (2 of them, and an integer one), and the float values as float64."""
    x = rng.standard_normal(n) * scale
    if dtype == "BF16":
        bits = to_bf16(x)
        values, exact = bits, from_bf16(bits)
    else:
        values = x.astype(FLOATS[dtype])
        exact = values.astype(np.float64)
    return {"a": values[: n // 3], "b": values[n // 3:], "k": rng.integers(-1000, 1000, 5).astype(np.int32)}, exact


def quantise(exact: np.ndarray, fp: FixedPoint) -> np.ndarray:
    return np.rint(exact * 2.0 ** fp.frac_bits).astype(np.int64)  # rint: half to even


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
@pytest.mark.parametrize("fp", [FixedPoint(24, 64), FixedPoint(12, 32), FixedPoint(0, 32)])
@pytest.mark.parametrize("ninputs", [1, 2, 3])
def test_fold_and_finalize_match_numpy(dtype: str, fp: FixedPoint, ninputs: int) -> None:
    rng = np.random.default_rng(ninputs)
    n = 1001
    scale = 1000.0 if fp.frac_bits == 0 else 1.0  # values that do not all round to 0
    updates = [random_update(rng, dtype, n, scale) for _ in range(ninputs)]
    weights = [int(w) for w in rng.integers(1, 50, ninputs)]
    memory = Memory(memory_spec(updates[0][0]), fp)
    inputs = [memory.update(tensors, w) for (tensors, _), w in zip(updates, weights)]
    acc, buffer = memory.accumulator()
    max_abs = fold(acc, [(c.tensors, c.weight) for c in inputs], init=True, frac_bits=fp.frac_bits)

    assert list(max_abs) == [float(np.abs(exact).max()) for _, exact in updates]
    expected = sum(w * quantise(exact, fp) for (_, exact), w in zip(updates, weights))
    integer = np.int64 if fp.width == 64 else np.int32
    sums = memory.values(buffer)
    got = np.concatenate([sums["a"], sums["b"]])
    assert got.dtype == integer
    np.testing.assert_array_equal(got, expected.astype(integer))

    out = bytearray(fmt.spec_header(memory.spec)) + bytearray(memory.spec.data_bytes)
    finalize(Tensors.of(out, fmt.parse_layout(out), memory.spec), acc, sum(weights), frac_bits=fp.frac_bits)
    mean = expected / (sum(weights) * 2.0 ** fp.frac_bits)  # exact division of exact integers (< 2^53)
    average = memory.values(out)
    if dtype == "BF16":
        np.testing.assert_array_equal(np.concatenate([average["a"], average["b"]]), to_bf16(mean))
    else:
        np.testing.assert_array_equal(np.concatenate([average["a"], average["b"]]), mean.astype(FLOATS[dtype]))
    # integer tensors keep the exact I128 path: the rounded (half to even) weighted mean
    ks = sum(w * tensors["k"].astype(np.int64) for (tensors, _), w in zip(updates, weights))
    np.testing.assert_array_equal(average["k"], np.rint(ks / sum(weights)).astype(np.int32))


def memory_spec(tensors: dict[str, np.ndarray]) -> fmt.ModelSpec:
    blob = fmt.encode(tensors, dtypes={k: "BF16" for k, v in tensors.items() if v.dtype == np.uint16})
    return fmt.parse_layout(blob).spec()


def test_partial_inputs_add_without_quantising_again() -> None:
    fp = FixedPoint(8, 32)
    rng = np.random.default_rng(7)
    (tensors, exact), (tensors2, exact2) = random_update(rng, "F32", 30), random_update(rng, "F32", 30)
    memory = Memory(memory_spec(tensors), fp)
    agg = StreamingFedAvg(2, fp)
    agg.offer([memory.update(tensors, 3), memory.update(tensors2, 4)], memory.accumulator)
    first = memory.reopen(agg.state)
    acc, buffer = memory.accumulator()
    fold(acc, [(first.tensors, first.weight), (first.tensors, first.weight)], init=True, frac_bits=fp.frac_bits)
    sums = memory.values(buffer)
    np.testing.assert_array_equal(np.concatenate([sums["a"], sums["b"]]), 2 * (3 * quantise(exact, fp) + 4 * quantise(exact2, fp)))


# ---------- the same bits whatever the order and the hierarchy ----------

def aggregate(memory: Memory, inputs: list[Contribution], rng: np.random.Generator) -> Contribution:
    """One aggregator: inputs offered in random-sized batches, as its Recv FIFO would."""
    agg = StreamingFedAvg(len(inputs), memory.fp)
    i = 0
    while i < len(inputs):
        k = int(rng.integers(1, 4))
        agg.offer(inputs[i: i + k], memory.accumulator)
        i += k
    result = agg.result()
    return memory.reopen(result) if result.partial else result


def hierarchy(memory: Memory, updates: list[Contribution], rng: np.random.Generator) -> bytes:
    """A random tree: updates shuffled into leaves of random fan-in, leaves into middles, one top."""
    level = [updates[i] for i in rng.permutation(len(updates))]
    while len(level) > 1:
        groups, i = [], 0
        while i < len(level):
            k = int(rng.integers(1, 5))
            groups.append(level[i: i + k])
            i += k
        if len(groups) == len(level) == 2:  # make progress: two singletons become one pair
            groups = [level]
        level = [aggregate(memory, g, rng) for g in groups]
        level = [level[i] for i in rng.permutation(len(level))]
    return memory.model(level[0])


@pytest.mark.parametrize("fp", [FixedPoint(24, 64), FixedPoint(16, 32)])
@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_the_model_has_the_same_bits_whatever_the_order_and_the_hierarchy(fp: FixedPoint, dtype: str) -> None:
    rng = np.random.default_rng(11)
    updates = [random_update(rng, dtype, 301) for _ in range(9)]
    samples = [int(s) for s in rng.integers(1, 100, len(updates))]
    memory = Memory(memory_spec(updates[0][0]), fp)
    models = {hierarchy(memory, [memory.update(t, s) for (t, _), s in zip(updates, samples)], np.random.default_rng(seed))
              for seed in range(25)}
    assert len(models) == 1


def test_the_float_path_is_not_bit_identical_across_shapes() -> None:
    """What fixed point is for: the same updates summed in float64 in other groupings differ in the last bits."""
    rng = np.random.default_rng(11)
    updates = [random_update(rng, "F64", 301) for _ in range(9)]
    memory = Memory(memory_spec(updates[0][0]), None)
    models = {hierarchy(memory, [memory.update(t, 7) for t, _ in updates], np.random.default_rng(seed)) for seed in range(25)}
    assert len(models) > 1


# ---------- overflow ----------

def offer_all(fp: FixedPoint, values: list[float], samples: list[int], groups: list[int]) -> Contribution:
    """Updates of one coordinate, folded in leaves of ``groups`` sizes, then at a top."""
    memory = Memory(memory_spec({"w": np.zeros(1, np.float64)}), fp)
    updates = [memory.update({"w": np.array([v])}, s) for v, s in zip(values, samples)]
    leaves, i = [], 0
    for size in groups:
        agg = StreamingFedAvg(size, fp)
        agg.offer(updates[i: i + size], memory.accumulator)
        i += size
        result = agg.result()
        leaves.append(memory.reopen(result) if result.partial else result)
    top = StreamingFedAvg(len(leaves), fp)
    top.offer(leaves, memory.accumulator)
    return top.result()


LIMIT32 = 1 << 31


@pytest.mark.parametrize("values, samples, groups, overflows", [
    # width 32, frac_bits 0: the bound is sum(c * |round(w)|); the sum must stay below 2^31
    ([2.0 ** 30, -(2.0 ** 30 - 1)], [1, 1], [1, 1], False),  # bound 2^31 - 1: the limit, accepted
    ([2.0 ** 30, -(2.0 ** 30)], [1, 1], [1, 1], True),  # one past it (though the true sum is 0)
    ([2.0 ** 29, 2.0 ** 29 - 1, 2.0 ** 30], [1, 1, 1], [2, 1], False),  # a partial's bound travels up
    ([2.0 ** 29, 2.0 ** 29, 2.0 ** 30], [1, 1, 1], [2, 1], True),
    ([1024.0, 1024.0], [2 ** 20, 2 ** 20 - 1], [1, 1], False),  # sample counts weigh in
    ([1024.0, 1024.0], [2 ** 20, 2 ** 20], [1, 1], True),
    ([0.5, 1e300], [1, 1], [1, 1], True),  # far beyond any width: refused, never an OverflowError
])
def test_overflow_is_detected_at_the_limit_and_one_past_it(values: list[float], samples: list[int], groups: list[int],
                                                            overflows: bool) -> None:
    fp = FixedPoint(0, 32)
    if not overflows:
        total = offer_all(fp, values, samples, groups)
        assert total.bound == sum(s * abs(round(v)) for v, s in zip(values, samples)) < LIMIT32
        return
    with pytest.raises(Unprocessable) as e:
        offer_all(fp, values, samples, groups)
    assert e.value.code == "fixed_point_overflow"
    assert "frac_bits 0, width 32" in e.value.message


def test_quantised_values_beyond_the_rounding_range_are_refused_even_in_64_bits() -> None:
    fp = FixedPoint(0, 64)
    assert offer_all(fp, [2.0 ** 51 - 1, 1.0], [1, 1], [1, 1]).bound == 2 ** 51
    with pytest.raises(Unprocessable) as e:
        offer_all(fp, [2.0 ** 51, 1.0], [1, 1], [1, 1])
    assert e.value.code == "fixed_point_overflow"


# ---------- error against float64 FedAvg ----------

@pytest.mark.parametrize("fp", [FixedPoint(24, 64), FixedPoint(16, 32), FixedPoint(8, 32)])
def test_error_against_float64_fedavg_is_within_half_a_step(fp: FixedPoint) -> None:
    rng = np.random.default_rng(fp.frac_bits)
    updates = [random_update(rng, "F64", 3000) for _ in range(6)]
    samples = [int(s) for s in rng.integers(1, 200, len(updates))]
    memory = Memory(memory_spec(updates[0][0]), fp)
    model = memory.values(hierarchy(memory, [memory.update(t, s) for (t, _), s in zip(updates, samples)], rng))
    reference = sum(s * exact for (_, exact), s in zip(updates, samples)) / sum(samples)
    error = np.abs(np.concatenate([model["a"], model["b"]]) - reference)
    assert error.max() <= 2.0 ** -(fp.frac_bits + 1) * (1 + 1e-9)
    assert error.max() > 0  # quantisation does cost something


# ---------- rounds on a real node ----------

@pytest.mark.slow
def test_rounds_on_a_node_install_the_same_bits_whatever_the_push_order_and_leaf_fan_in(node) -> None:
    from conftest import wait_for
    from lifl.client import Gateway

    rng = np.random.default_rng(5)
    shapes = {"w": (17, 5), "b": (5,)}
    updates = [fmt.encode({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}) for _ in range(7)]
    samples = [int(s) for s in rng.integers(1, 500, len(updates))]
    gw = Gateway(node.http)
    models: dict[str, bytes] = {}
    fixed_point = {"frac_bits": 20, "width": 64}
    for name, leaf_fan_in, order, option in [("fp-a", 2, range(7), fixed_point), ("fp-b", 3, reversed(range(7)), fixed_point),
                                             ("fp-c", 1, [3, 0, 6, 2, 5, 1, 4], fixed_point),
                                             ("fp-d", 7, [6, 4, 2, 0, 1, 3, 5], fixed_point), ("float", 2, range(7), None)]:
        gw.create_job(name, len(updates), leaf_fan_in=leaf_fan_in, fixed_point=option)
        gw.set_model(name, fmt.encode({k: np.zeros(s, np.float32) for k, s in shapes.items()}))
        for i in order:
            gw.push(name, updates[i], client=f"c{i}", samples=samples[i], base_version=0)
        wait_for(lambda: gw.model(name)[0] == 1, what=f"{name}'s round")
        models[name] = bytes(gw.model(name)[1])
    float_model = models.pop("float")
    assert len(set(models.values())) == 1
    assert float_model != models["fp-a"]  # the option reached the aggregators: float64 sums round differently
    model = fmt.views(models["fp-a"], validate(models["fp-a"]))
    for k in shapes:  # and it is FedAvg, to within half a quantisation step (plus float32's rounding)
        reference = sum(s * fmt.views(u, validate(u))[k].astype(np.float64) for u, s in zip(updates, samples)) / sum(samples)
        np.testing.assert_allclose(model[k], reference, atol=2.0 ** -21, rtol=2.0 ** -23)


@pytest.mark.slow
def test_a_round_that_would_overflow_is_abandoned_saying_why(node) -> None:
    """Never a wrapped model: the fold refuses, the round is abandoned with the reason, and the
    job goes on from the version it had."""
    from conftest import wait_for
    from lifl.client import Gateway

    gw = Gateway(node.http)
    gw.create_job("over", 2, fixed_point={"frac_bits": 24, "width": 32})
    gw.set_model("over", fmt.encode({"w": np.zeros(8, np.float32)}))
    for i in range(2):  # 100 * 2^24 > 2^31: a single update's integers do not fit in 32 bits
        gw.push("over", fmt.encode({"w": np.full(8, 100.0, np.float32)}), client=f"c{i}", samples=1, base_version=0)
    wait_for(lambda: (gw.job("over")["last_round"] or {}).get("outcome") == "abandoned", what="the round abandoned")
    status = gw.job("over")
    assert "fixed_point_overflow" in status["last_round"]["reason"] or "overflow" in status["last_round"]["reason"], status
    assert status["version"] == 0 and gw.model("over")[0] == 0
