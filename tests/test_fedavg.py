"""Streaming FedAvg exactness against a float64 reference, whatever the arrival order and batching."""

from __future__ import annotations

import numpy as np
import pytest

from lifl import format as fmt
from lifl.fedavg import Contribution, StreamingFedAvg, average_into
from lifl.kernels import Tensors

DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64}


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits (nearest even); test data generator."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def make_update(rng: np.random.Generator, dtype: str, n: int) -> tuple[bytes, np.ndarray]:
    """A blob holding tensors of `dtype` (split in 3 tensors), and its values as float64 / int."""
    if dtype in ("I32", "I64"):
        values = rng.integers(-(10**6), 10**6, n).astype(DTYPES[dtype])
        exact = values.astype(object)
    elif dtype == "BF16":
        bits = to_bf16(rng.standard_normal(n).astype(np.float32))
        values, exact = bits, from_bf16(bits)
    else:
        values = rng.standard_normal(n).astype(DTYPES[dtype])
        exact = values.astype(np.float64)
    cut = [0, n // 3, n // 2, n]
    tensors = {f"t{i}": values[cut[i] : cut[i + 1]] for i in range(3)}
    return fmt.encode(tensors, dtypes={k: "BF16" for k in tensors} if dtype == "BF16" else None), exact


class Memory:
    """Objects backed by bytearrays: lets the pure fold logic run without the store."""

    def __init__(self, spec: fmt.ModelSpec) -> None:
        self.spec = spec
        self.partial_header = fmt.spec_header(spec.partial())

    def contribution(self, blob: bytes, samples: int) -> Contribution:
        buffer = bytearray(blob)
        return Contribution(Tensors.of(buffer, fmt.parse_layout(buffer), self.spec), samples, 1, False, buffer)

    def accumulator(self) -> tuple[Tensors, bytearray]:
        buffer = bytearray(self.partial_header) + bytearray(self.spec.partial().data_bytes)
        layout = fmt.parse_layout(buffer, allow_partial=True)
        return Tensors.of(buffer, layout, self.spec), buffer

    def average(self, total: Contribution) -> np.ndarray:
        if not total.partial:
            buffer = total.token
        else:
            buffer = bytearray(fmt.spec_header(self.spec)) + bytearray(self.spec.data_bytes)
            average_into(Tensors.of(buffer, fmt.parse_layout(buffer), self.spec), total)
        views = fmt.views(buffer, fmt.parse_layout(buffer))
        return np.concatenate([views[t.name].reshape(-1) for t in self.spec.tensors])


def aggregate(memory: Memory, contributions: list[Contribution], rng: np.random.Generator) -> Contribution:
    """Offer contributions in random-sized batches, as an aggregator's Recv FIFO would."""
    agg = StreamingFedAvg(len(contributions))
    i = 0
    released: list[Contribution] = []
    while i < len(contributions):
        k = int(rng.integers(1, 4))
        released += agg.offer(contributions[i : i + k], memory.accumulator)
        i += k
    assert agg.complete
    result = agg.result()
    if len(contributions) > 1:  # every input is released once folded, and every accumulator but the last
        given = set(map(id, contributions))
        inputs = [c for c in released if id(c) in given]
        accumulators = [c for c in released if id(c) not in given]
        assert sorted(map(id, inputs)) == sorted(given)
        assert result.partial and result not in accumulators and len(set(map(id, accumulators))) == len(accumulators)
    return result


def reference(values: list[np.ndarray], samples: list[int], dtype: str) -> np.ndarray:
    if dtype in ("I32", "I64"):
        total = sum(samples)
        sums = sum(np.array(v, dtype=object) * c for v, c in zip(values, samples))
        return np.array([_round_half_even(s, total) for s in sums])
    return sum(v * c for v, c in zip(values, samples)) / sum(samples)


def _round_half_even(s: int, total: int) -> int:
    q, r = divmod(s, total)
    return q + (1 if 2 * r > total or (2 * r == total and q % 2) else 0)


def check_close(got: np.ndarray, ref: np.ndarray, dtype: str) -> None:
    if dtype in ("I32", "I64"):
        np.testing.assert_array_equal(got.astype(np.int64), ref.astype(np.int64))
    elif dtype in ("F32", "F64"):
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= 1e-5 * (np.abs(ref) + 1e-3)), float(np.max(err / (np.abs(ref) + 1e-3)))
    elif dtype == "F16":  # one rounding of the exact average: numpy rounds float64 -> float16 directly
        np.testing.assert_array_equal(got, ref.astype(np.float16))
    else:
        np.testing.assert_array_equal(got, to_bf16_exact(ref))


def to_bf16_exact(ref: np.ndarray) -> np.ndarray:
    """bf16 bits of float64 values rounded once (via exact rational arithmetic on the float64)."""
    out = np.empty(ref.shape, np.uint16)
    for i, x in enumerate(ref):
        m, e = np.frexp(x)
        q = 2.0 ** (max(int(e) - 1, -126) - 7)
        out[i] = to_bf16(np.array([np.round(x / q) * q], np.float32))[0]
    return out


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64", "I32", "I64"])
@pytest.mark.parametrize("seed", range(4))
def test_fedavg_matches_float64_reference_in_any_arrival_order(dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_updates = int(rng.integers(1, 12))
    blobs, values = zip(*(make_update(rng, dtype, 4099) for _ in range(n_updates)))
    samples = [int(s) for s in rng.integers(1, 5000, n_updates)]
    memory = Memory(fmt.parse_layout(blobs[0]).spec())
    ref = reference(list(values), samples, dtype)
    for _ in range(3):  # the same inputs in different orders give the same answer
        order = rng.permutation(n_updates)
        contributions = [memory.contribution(blobs[i], samples[i]) for i in order]
        check_close(memory.average(aggregate(memory, contributions, rng)), ref, dtype)


def test_cancelling_updates_keep_absolute_accuracy() -> None:
    """Updates that nearly cancel: a float32 running sum would miss the tolerance here."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal(10000).astype(np.float32) * 100
    blobs = [fmt.encode({"w": base}), fmt.encode({"w": -base}), fmt.encode({"w": np.full(10000, 1e-3, np.float32)})]
    memory = Memory(fmt.parse_layout(blobs[0]).spec())
    contributions = [memory.contribution(b, 1) for b in blobs]
    got = memory.average(aggregate(memory, contributions, rng))
    ref = (base.astype(np.float64) - base.astype(np.float64) + np.float64(np.float32(1e-3))) / 3
    check_close(got, ref, "F32")


def test_hierarchy_leaf_middle_top_equals_flat_average() -> None:
    """Leaves of fan-in 2 (and a last leaf of 1) feed a middle, which feeds the top."""
    rng = np.random.default_rng(3)
    blobs, values = zip(*(make_update(rng, "F32", 5000) for _ in range(7)))
    samples = [int(s) for s in rng.integers(1, 100, 7)]
    memory = Memory(fmt.parse_layout(blobs[0]).spec())
    leaves = []
    for i in range(0, 7, 2):
        group = [memory.contribution(blobs[j], samples[j]) for j in range(i, min(i + 2, 7))]
        leaves.append(aggregate(memory, group, rng))
    assert [c.partial for c in leaves] == [True, True, True, False]  # the single update is forwarded as is
    middle = aggregate(memory, leaves[::-1], rng)
    top = aggregate(memory, [middle], rng)
    assert top is middle and top.samples == sum(samples) and top.updates == 7
    check_close(memory.average(top), reference(list(values), samples, "F32"), "F32")


def test_single_update_is_its_own_average() -> None:
    rng = np.random.default_rng(1)
    blob, values = make_update(rng, "F32", 100)
    memory = Memory(fmt.parse_layout(blob).spec())
    result = aggregate(memory, [memory.contribution(blob, 5)], rng)
    assert not result.partial
    np.testing.assert_array_equal(memory.average(result), values.astype(np.float32))


def test_fan_in_is_enforced_and_resize_finishes_early() -> None:
    rng = np.random.default_rng(2)
    blob, _ = make_update(rng, "F32", 10)
    memory = Memory(fmt.parse_layout(blob).spec())
    agg = StreamingFedAvg(3)
    agg.offer([memory.contribution(blob, 1), memory.contribution(blob, 2)], memory.accumulator)
    with pytest.raises(ValueError, match="fan-in of 3"):
        agg.offer([memory.contribution(blob, 1)] * 2, memory.accumulator)
    assert not agg.complete
    with pytest.raises(ValueError, match="2 inputs arrived"):
        agg.resize(1)
    agg.resize(2)
    assert agg.complete and agg.result().samples == 3


def test_inputs_with_tensors_in_another_order_fold_by_name() -> None:
    """Contiguous tensors are folded as one run; a blob listing them in another order must not be."""
    rng = np.random.default_rng(11)
    tensors = {f"t{i}": rng.standard_normal(100 + i).astype(np.float32) for i in range(6)}
    forward = fmt.encode(tensors)
    backward = fmt.encode(dict(reversed(list(tensors.items()))))
    other = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in tensors.items()}
    memory = Memory(fmt.parse_layout(forward).spec())
    contributions = [memory.contribution(forward, 2), memory.contribution(backward, 3), memory.contribution(fmt.encode(other), 5)]
    got = memory.average(aggregate(memory, contributions, rng))
    flat = lambda d: np.concatenate([d[f"t{i}"].astype(np.float64) for i in range(6)])  # noqa: E731
    check_close(got, (flat(tensors) * 5 + flat(other) * 5) / 10, "F32")
