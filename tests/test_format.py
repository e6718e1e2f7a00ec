"""The update format: round trips, and a battery of malformed blobs each rejected with a precise error."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import numpy as np
import pytest

from lifl import format as fmt
from lifl.errors import BadRequest, LiflError, PayloadTooLarge, Unprocessable
from lifl.kernels import FiniteChecker, validate

MODEL = {
    "conv.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7,
    "conv.bias": np.array([0.5, -1.5], np.float32),
    "bn.num_batches_tracked": np.array(3, np.int64),
}
SPEC = fmt.parse_layout(fmt.encode(MODEL)).spec()


def raw(header: dict | str | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def good_header() -> dict:
    return {
        "conv.weight": {"dtype": "F32", "shape": [2, 3, 4], "data_offsets": [0, 96]},
        "conv.bias": {"dtype": "F32", "shape": [2], "data_offsets": [96, 104]},
        "bn.num_batches_tracked": {"dtype": "I64", "shape": [], "data_offsets": [104, 112]},
    }


def with_tensor(name: str, **changes) -> dict:
    h = good_header()
    h[name] = {**h[name], **changes}
    return h


DATA = bytes(112)

# (case id, blob, error class, error code)
MALFORMED = [
    ("empty", b"", BadRequest, "truncated"),
    ("short-prefix", b"\x10\x00\x00", BadRequest, "truncated"),
    ("header-len-zero", raw(b"", length=0), BadRequest, "bad_header"),
    ("header-len-huge", struct.pack("<Q", 1 << 40) + b"{}", PayloadTooLarge, "header_too_large"),
    ("truncated-header", raw(good_header(), DATA, length=5000)[:200], BadRequest, "truncated"),
    ("not-utf8", raw(b"{\xff\xfe}"), BadRequest, "bad_header"),
    ("not-json", raw("{not json}"), BadRequest, "bad_header"),
    ("json-array", raw("[1, 2]"), BadRequest, "bad_header"),
    ("leading-space", raw(" {}"), BadRequest, "bad_header"),
    ("duplicate-name", raw('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                           '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8)), BadRequest, "bad_header"),
    ("metadata-not-strings", raw({"__metadata__": {"a": 1}, **good_header()}, DATA), BadRequest, "bad_header"),
    ("tensor-not-object", raw({"x": [1, 2]}), BadRequest, "bad_tensor"),
    ("extra-field", raw(with_tensor("conv.bias", extra=1), DATA), BadRequest, "bad_tensor"),
    ("missing-field", raw({"x": {"dtype": "F32", "shape": [1]}}), BadRequest, "bad_tensor"),
    ("unknown-dtype", raw(with_tensor("conv.bias", dtype="F8_E4M3"), DATA), Unprocessable, "unsupported_dtype"),
    ("internal-dtype", raw(with_tensor("conv.bias", dtype="I128", data_offsets=[96, 128]), bytes(136)), Unprocessable, "unsupported_dtype"),
    ("dtype-not-string", raw(with_tensor("conv.bias", dtype=3), DATA), Unprocessable, "unsupported_dtype"),
    ("negative-dim", raw(with_tensor("conv.bias", shape=[-2]), DATA), BadRequest, "bad_tensor"),
    ("float-dim", raw(with_tensor("conv.bias", shape=[2.0]), DATA), BadRequest, "bad_tensor"),
    ("bool-dim", raw(with_tensor("conv.bias", shape=[True, 2]), DATA), BadRequest, "bad_tensor"),
    ("shape-not-list", raw(with_tensor("conv.bias", shape="2"), DATA), BadRequest, "bad_tensor"),
    ("offsets-three", raw(with_tensor("conv.bias", data_offsets=[96, 100, 104]), DATA), BadRequest, "bad_offsets"),
    ("offsets-reversed", raw(with_tensor("conv.bias", data_offsets=[104, 96]), DATA), BadRequest, "bad_offsets"),
    ("offsets-negative", raw(with_tensor("conv.bias", data_offsets=[-8, 0]), DATA), BadRequest, "bad_offsets"),
    ("offsets-wrong-size", raw(with_tensor("conv.bias", data_offsets=[96, 108]), DATA), BadRequest, "bad_offsets"),
    ("offsets-overlap", raw(with_tensor("conv.bias", data_offsets=[92, 100]), DATA), BadRequest, "overlapping_offsets"),
    ("offsets-gap", raw(with_tensor("bn.num_batches_tracked", data_offsets=[112, 120]), bytes(120)), BadRequest, "bad_offsets"),
    ("offsets-not-from-zero", raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), BadRequest, "bad_offsets"),
    ("out-of-bounds", raw(good_header(), DATA[:100]), BadRequest, "truncated"),
    ("trailing-bytes", raw(good_header(), DATA + b"xx"), BadRequest, "trailing_bytes"),
    ("empty-name", raw({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), BadRequest, "bad_tensor"),
]


@pytest.mark.parametrize("blob,error,code", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_blob_is_rejected_with_named_problem(blob: bytes, error: type[LiflError], code: str) -> None:
    with pytest.raises(error) as info:
        validate(blob, SPEC, limit=1 << 20)
    assert info.value.code == code
    assert info.value.message  # a sentence a user can act on


# Well-formed blobs that do not fit the job's model.
MISMATCHED = [
    ("missing-tensor", {k: v for k, v in MODEL.items() if k != "conv.bias"}, "missing_tensor"),
    ("unexpected-tensor", {**MODEL, "extra": np.zeros(1, np.float32)}, "unexpected_tensor"),
    ("renamed-tensor", {("conv.b" if k == "conv.bias" else k): v for k, v in MODEL.items()}, "missing_tensor"),
    ("wrong-shape", {**MODEL, "conv.weight": MODEL["conv.weight"].reshape(3, 2, 4)}, "shape_mismatch"),
    ("wrong-rank", {**MODEL, "conv.bias": MODEL["conv.bias"].reshape(1, 2)}, "shape_mismatch"),
    ("wrong-dtype", {**MODEL, "conv.bias": MODEL["conv.bias"].astype(np.float64)}, "dtype_mismatch"),
    ("int-for-float", {**MODEL, "conv.bias": MODEL["conv.bias"].astype(np.int32)}, "dtype_mismatch"),
]


@pytest.mark.parametrize("tensors,code", [c[1:] for c in MISMATCHED], ids=[c[0] for c in MISMATCHED])
def test_blob_that_does_not_match_the_model_is_unprocessable(tensors: dict, code: str) -> None:
    with pytest.raises(Unprocessable) as info:
        validate(fmt.encode(tensors), SPEC)
    assert info.value.code == code


def _check_in_numpy(blob: bytearray) -> None:
    fmt.check_finite(blob, fmt.parse_layout(blob))


@pytest.mark.parametrize("check", [validate, _check_in_numpy], ids=["kernels", "numpy"])
@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "+Inf"), (-np.inf, "-Inf")])
@pytest.mark.parametrize("position", [0, 2345, 2999])  # vectorised bulk and scalar tail; numpy: past its first block
def test_non_finite_values_are_found_in_every_float_dtype(check: Callable[[bytearray], object], dtype: str, bad: float,
                                                          word: str, position: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt, "FINITE_BLOCK", 1000)
    values = np.linspace(-1, 1, 3000).astype(np.float32)
    values[position] = bad
    if dtype == "BF16":
        array = (values.view(np.uint32) >> 16).astype(np.uint16)
        blob = fmt.encode({"w": array}, dtypes={"w": "BF16"})
    else:
        blob = fmt.encode({"w": values.astype({"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype])})
    with pytest.raises(Unprocessable) as info:
        check(blob)
    assert info.value.code == "non_finite"
    assert info.value.message == f"tensor 'w' element {position} is {word}"


def test_the_numpy_check_passes_finite_blobs_and_skips_integer_tensors() -> None:
    blob = fmt.encode({**MODEL, "n": np.array([np.iinfo(np.int32).max], np.int32)})
    fmt.check_finite(blob, fmt.parse_layout(blob))


def test_size_limit_counts_the_whole_blob() -> None:
    blob = fmt.encode(MODEL)
    assert validate(blob, SPEC, limit=len(blob)).total_size == len(blob)
    with pytest.raises(PayloadTooLarge):
        validate(blob, SPEC, limit=len(blob) - 1)


def test_round_trip_views_are_zero_copy_and_any_tensor_order_is_accepted() -> None:
    reordered = dict(reversed(list(MODEL.items())))
    blob = bytearray(fmt.encode(reordered, {"client": "c1"}))
    layout = validate(blob, SPEC)
    assert layout.metadata == {"client": "c1"}
    assert layout.data_start % fmt.DATA_ALIGN == 0
    views = fmt.views(blob, layout)
    for name, array in MODEL.items():
        np.testing.assert_array_equal(views[name], array)
    blob[layout.data_start + layout.entries[0].begin] ^= 0xFF  # views alias the blob's bytes
    assert not np.array_equal(fmt.views(blob, layout)[layout.entries[0].spec.name], reordered[layout.entries[0].spec.name])


def test_streaming_finite_check_resumes_at_element_boundaries() -> None:
    values = np.ones(1000, np.float64)
    values[999] = np.nan
    blob = fmt.encode({"a": np.ones(3, np.float16), "w": values})
    layout = fmt.parse_layout(blob)
    checker = FiniteChecker(layout)
    for upto in range(layout.data_start, len(blob) - 8, 7):  # arbitrary chunk edges split elements
        checker.check(blob, upto)
    with pytest.raises(Unprocessable, match="element 999 is NaN"):
        checker.check(blob, len(blob))


def test_spec_json_round_trip_and_partial_spec() -> None:
    assert fmt.ModelSpec.from_json(json.loads(json.dumps(SPEC.to_json()))) == SPEC
    partial = SPEC.partial()
    assert [t.dtype.name for t in partial.tensors] == ["F64", "F64", "I128"]
    assert fmt.parse_layout(fmt.spec_header(partial) + bytes(partial.data_bytes), allow_partial=True).spec() == partial


def test_an_update_header_is_bounded_by_its_model() -> None:
    """A receiver refuses, before reading it, a header longer than any header of the model's
    tensors can reasonably be: four times the compact one, plus room for metadata."""
    bound = SPEC.max_header_bytes
    assert bound == 4 * len(fmt.spec_header(SPEC)) + fmt.MAX_METADATA_BYTES
    assert fmt.header_length(struct.pack("<Q", bound), max_header=bound) == bound
    with pytest.raises(PayloadTooLarge) as info:
        fmt.header_length(struct.pack("<Q", bound + 1), max_header=bound)
    assert info.value.code == "header_too_large"
    huge = fmt.ModelSpec(tuple(fmt.TensorSpec(f"{i:0300}", fmt.F32, (1,)) for i in range(16_000)))
    assert huge.max_header_bytes == fmt.MAX_HEADER_BYTES  # never above the format's own limit
