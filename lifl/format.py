"""The update format: safetensors layout, identical on the wire, in shared memory and on disk.

A blob is an 8-byte little-endian header length N, a JSON header of N bytes, then raw
little-endian tensor bytes. Readers map tensors in place (``views``); nothing is copied.

Validation is split so that a streaming receiver can reject early: ``header_length`` and
``parse_header`` need only the first 8 + N bytes; ``check_matches`` compares against the
job's model; the tensor bytes are checked for finiteness as they arrive (``lifl.kernels``, or
``check_finite`` where the C kernels are not installed: the client SDK).

Aggregators keep their running sums in *partial* objects: the same layout with accumulator
dtypes (F64 for float tensors, or integers under fixed point, and I128 for integer ones),
which never come from outside.
"""

from __future__ import annotations

import json
import reprlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from lifl.errors import BadRequest, PayloadTooLarge, Unprocessable

PREFIX_BYTES = 8
MAX_HEADER_BYTES = 16 << 20
HEADER_SPACING = 4  # how many times its compact form a header of a model's tensors may take...
MAX_METADATA_BYTES = 64 << 10  # ...plus this much for __metadata__ (see ModelSpec.max_header_bytes)
MAX_RANK = 32
MAX_NAME_BYTES = 1024
MAX_OFFSET = 1 << 62  # bound on dimensions, offsets and tensor sizes: no blob comes near, and sizes stay small integers
DATA_ALIGN = 64  # headers are space-padded so tensor data starts on a cache line
FINITE_BLOCK = 1 << 20  # elements check_finite looks at in one pass
BF16_EXPONENT = 0x7F80  # a bfloat16 whose exponent bits are all set is NaN or infinite


@dataclass(frozen=True)
class DType:
    name: str
    code: int  # shared with kernels.c
    itemsize: int
    kind: str  # "f" float, "i" integer
    storage: np.dtype  # numpy dtype of the raw bytes (BF16 is stored as uint16)

    def __repr__(self) -> str:
        return self.name


F16 = DType("F16", 1, 2, "f", np.dtype("<f2"))
BF16 = DType("BF16", 2, 2, "f", np.dtype("<u2"))
F32 = DType("F32", 3, 4, "f", np.dtype("<f4"))
F64 = DType("F64", 4, 8, "f", np.dtype("<f8"))
I32 = DType("I32", 5, 4, "i", np.dtype("<i4"))
I64 = DType("I64", 6, 8, "i", np.dtype("<i8"))
I128 = DType("I128", 7, 16, "i", np.dtype("V16"))  # partial sums of integer tensors only

WIRE_DTYPES: dict[str, DType] = {d.name: d for d in (F16, BF16, F32, F64, I32, I64)}
_PARTIAL_DTYPES: dict[str, DType] = {**WIRE_DTYPES, I128.name: I128}
_NUMPY_TO_DTYPE = {F16.storage: F16, F32.storage: F32, F64.storage: F64, I32.storage: I32, I64.storage: I64}


ACCUMULATORS: dict[str, DType] = {"float64": F64, "float32": F32}  # a job's "accumulator" for float tensors


def accumulator_dtype(dtype: DType, floats: DType = F64) -> DType:
    """The dtype in which an aggregator sums tensors of ``dtype`` exactly enough (``floats``:
    float tensors' accumulator, a job's choice)."""
    return floats if dtype.kind == "f" else I128


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """Tensor names, dtypes and shapes of a job's model, in the order of the initial model."""

    tensors: tuple[TensorSpec, ...]
    _by_name: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @cached_property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @cached_property
    def max_header_bytes(self) -> int:
        """The longest header a blob of these tensors may have: other writers' spacing and key
        order, and metadata, fit easily; a receiver refuses a longer one before reading it."""
        return min(MAX_HEADER_BYTES, HEADER_SPACING * len(spec_header(self)) + MAX_METADATA_BYTES)

    def partial(self, floats: DType = F64) -> ModelSpec:
        """The spec of this model's partial sums in float accumulators of ``floats`` (under fixed
        point: ``lifl.fixedpoint.partial_spec``)."""
        return ModelSpec(tuple(TensorSpec(t.name, accumulator_dtype(t.dtype, floats), t.shape) for t in self.tensors))

    def to_json(self) -> list[list[Any]]:
        return [[t.name, t.dtype.name, list(t.shape)] for t in self.tensors]

    @classmethod
    def from_json(cls, obj: list[list[Any]]) -> ModelSpec:
        return cls(tuple(TensorSpec(n, _PARTIAL_DTYPES[d], tuple(s)) for n, d, s in obj))


@dataclass(frozen=True)
class Entry:
    spec: TensorSpec
    begin: int  # relative to the start of the data section
    end: int


@dataclass(frozen=True)
class Layout:
    """Where every tensor of one blob lies; ``entries`` are in data order."""

    header_len: int
    entries: tuple[Entry, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return PREFIX_BYTES + self.header_len

    @property
    def data_len(self) -> int:
        return self.entries[-1].end if self.entries else 0

    @property
    def total_size(self) -> int:
        return self.data_start + self.data_len

    def spec(self) -> ModelSpec:
        return ModelSpec(tuple(e.spec for e in self.entries))


def header_length(prefix: bytes | bytearray | memoryview, limit: int | None = None, *,
                  max_header: int = MAX_HEADER_BYTES) -> int:
    """Decode and bound-check the 8-byte header length (``max_header``: see ModelSpec.max_header_bytes)."""
    if len(prefix) < PREFIX_BYTES:
        raise BadRequest(f"blob is {len(prefix)} bytes, shorter than its 8-byte header length", code="truncated")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n < 2:
        raise BadRequest(f"header length {n} is too small for a JSON object", code="bad_header")
    if n > max_header:
        raise PayloadTooLarge(f"header length {n} exceeds the maximum of {max_header} bytes", code="header_too_large")
    if limit is not None and PREFIX_BYTES + n > limit:
        raise PayloadTooLarge(f"header of {n} bytes alone exceeds the size limit of {limit} bytes")
    return n


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise BadRequest(f"header names {k!r} twice", code="bad_header")
        out[k] = v
    return out


def _utf8_size(v: Any) -> int | None:
    """Bytes of a string in UTF-8; None for anything else, or a string with a lone surrogate
    (JSON can escape one, and it would fail wherever the name is written later)."""
    if not isinstance(v, str):
        return None
    try:
        return len(v.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(header: bytes | bytearray | memoryview, *, allow_partial: bool = False, limit: int | None = None) -> Layout:
    """Parse and structurally validate a JSON header (without the 8-byte prefix). Whatever the
    bytes, it returns a Layout or raises BadRequest, Unprocessable or PayloadTooLarge."""
    n = len(header)
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"header is not UTF-8 ({e.reason} at byte {e.start})", code="bad_header") from None
    if not text.startswith("{"):
        raise BadRequest("header must be a JSON object starting with '{'", code="bad_header")
    try:
        obj = json.loads(text.rstrip(" "), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise BadRequest(f"header is not valid JSON: {e.msg} at position {e.pos}", code="bad_header") from None
    except (ValueError, RecursionError):  # a number of thousands of digits, nesting too deep
        raise BadRequest("header is not acceptable JSON (a number too long or nesting too deep)", code="bad_header") from None
    if not isinstance(obj, dict):
        raise BadRequest("header must be a JSON object", code="bad_header")
    dtypes = _PARTIAL_DTYPES if allow_partial else WIRE_DTYPES
    metadata = obj.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(_utf8_size(k) is not None and _utf8_size(v) is not None for k, v in metadata.items()):
        raise BadRequest("__metadata__ must map strings to strings", code="bad_header")
    entries = []
    for name, info in obj.items():
        if not 1 <= (_utf8_size(name) or 0) <= MAX_NAME_BYTES:
            raise BadRequest(f"tensor name {reprlib.repr(name)} must be 1..{MAX_NAME_BYTES} bytes of UTF-8", code="bad_tensor")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise BadRequest(f"tensor {name!r} must have exactly dtype, shape and data_offsets", code="bad_tensor")
        dname, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dname, str) or dname not in dtypes:
            raise Unprocessable(
                f"tensor {name!r} has unsupported dtype {reprlib.repr(dname)}; supported: {', '.join(WIRE_DTYPES)}",
                code="unsupported_dtype",
            )
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and 0 <= d <= MAX_OFFSET for d in shape):
            raise BadRequest(f"tensor {name!r} shape must be a list of at most {MAX_RANK} integers in [0, 2^62]", code="bad_tensor")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and abs(o) <= MAX_OFFSET for o in offsets)):
            raise BadRequest(f"tensor {name!r} data_offsets must be [begin, end] integers of at most 2^62", code="bad_offsets")
        begin, end = offsets
        spec = TensorSpec(name, dtypes[dname], tuple(shape))
        if spec.nbytes > MAX_OFFSET:
            raise BadRequest(f"tensor {name!r} of shape {list(shape)} would take more than 2^62 bytes", code="bad_tensor")
        if begin < 0 or end < begin:
            raise BadRequest(f"tensor {name!r} data_offsets [{begin}, {end}] are out of order or negative", code="bad_offsets")
        if end - begin != spec.nbytes:
            raise BadRequest(
                f"tensor {name!r} spans {end - begin} bytes but {dname}{list(shape)} needs {spec.nbytes}",
                code="bad_offsets",
            )
        entries.append(Entry(spec, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.begin < cursor:
            raise BadRequest(f"tensor {e.spec.name!r} at [{e.begin}, {e.end}] overlaps the previous tensor", code="overlapping_offsets")
        if e.begin > cursor:
            raise BadRequest(f"tensor {e.spec.name!r} starts at {e.begin}, leaving a gap after byte {cursor}", code="bad_offsets")
        cursor = e.end
    layout = Layout(n, tuple(entries), metadata)
    if limit is not None and layout.total_size > limit:
        raise PayloadTooLarge(f"blob declares {layout.total_size} bytes, over the limit of {limit} bytes")
    return layout


def check_matches(layout: Layout, spec: ModelSpec) -> None:
    """The blob's tensors must be exactly the model's: same names, dtypes and shapes."""
    have = {e.spec.name: e.spec for e in layout.entries}
    for t in spec.tensors:
        got = have.get(t.name)
        if got is None:
            raise Unprocessable(f"tensor {t.name!r} of the model is missing", code="missing_tensor")
        if got.dtype != t.dtype:
            raise Unprocessable(f"tensor {t.name!r} is {got.dtype.name}, the model's is {t.dtype.name}", code="dtype_mismatch")
        if got.shape != t.shape:
            raise Unprocessable(f"tensor {t.name!r} has shape {list(got.shape)}, the model's is {list(t.shape)}", code="shape_mismatch")
    for name in have:
        if name not in spec:
            raise Unprocessable(f"tensor {name!r} is not part of the model", code="unexpected_tensor")


def parse_layout(blob: bytes | bytearray | memoryview, *, allow_partial: bool = False, limit: int | None = None) -> Layout:
    """Parse the header of a complete blob and check that its length is exactly the declared one."""
    n = header_length(blob, limit)
    if len(blob) < PREFIX_BYTES + n:
        raise BadRequest(f"blob of {len(blob)} bytes ends inside its {n}-byte header", code="truncated")
    layout = parse_header(memoryview(blob)[PREFIX_BYTES : PREFIX_BYTES + n], allow_partial=allow_partial, limit=limit)
    if len(blob) < layout.total_size:
        raise BadRequest(f"blob has {len(blob)} bytes but its header declares {layout.total_size}", code="truncated")
    if len(blob) > layout.total_size:
        raise BadRequest(f"blob has {len(blob) - layout.total_size} bytes after the last tensor", code="trailing_bytes")
    return layout


def non_finite(buffer: Any, layout: Layout, entry: Entry, index: int) -> Unprocessable:
    """The refusal of a float tensor's element ``index`` that is NaN or infinite."""
    dtype = entry.spec.dtype
    offset = layout.data_start + entry.begin + index * dtype.itemsize
    raw = np.frombuffer(buffer, dtype.storage, count=1, offset=offset)
    value = (raw.astype(np.uint32) << 16).view(np.float32)[0] if dtype is BF16 else raw[0]
    what = "NaN" if np.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return Unprocessable(f"tensor {entry.spec.name!r} element {index} is {what}", code="non_finite")


def check_finite(buffer: Any, layout: Layout) -> None:
    """Refuse the first NaN or infinity of a float tensor, in data order: what
    ``lifl.kernels.FiniteChecker`` finds, in numpy, for readers without the C kernels (the
    client SDK). Works through ``FINITE_BLOCK`` elements at a time to bound its scratch."""
    for entry in layout.entries:
        dtype = entry.spec.dtype
        if dtype.kind != "f" or entry.spec.numel == 0:
            continue
        values = np.frombuffer(buffer, dtype.storage, entry.spec.numel, layout.data_start + entry.begin)
        for start in range(0, len(values), FINITE_BLOCK):
            block = values[start : start + FINITE_BLOCK]
            bad = (block & BF16_EXPONENT) == BF16_EXPONENT if dtype is BF16 else ~np.isfinite(block)
            if bad.any():
                raise non_finite(buffer, layout, entry, start + int(np.argmax(bad)))


def encode_header(entries: list[tuple[str, DType, tuple[int, ...]]], metadata: Mapping[str, str] | None = None) -> bytes:
    """Prefix + space-padded JSON header for tensors laid out contiguously in the given order."""
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        nbytes = TensorSpec(name, dtype, shape).nbytes
        obj[name] = {"dtype": dtype.name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(obj, separators=(",", ":")).encode()
    padded = len(text) + (-(PREFIX_BYTES + len(text)) % DATA_ALIGN)
    return struct.pack("<Q", padded) + text.ljust(padded, b" ")


def spec_header(spec: ModelSpec, metadata: Mapping[str, str] | None = None) -> bytes:
    return encode_header([(t.name, t.dtype, t.shape) for t in spec.tensors], metadata)


def _dtype_of(name: str, array: np.ndarray, dtypes: Mapping[str, str] | None) -> DType:
    if dtypes and name in dtypes:
        dtype = WIRE_DTYPES[dtypes[name]]
        if array.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"{name}: {array.dtype} cannot hold {dtype.name}")
        return dtype
    try:
        return _NUMPY_TO_DTYPE[array.dtype.newbyteorder("<")]
    except KeyError:
        raise ValueError(f"{name}: numpy dtype {array.dtype} has no update-format dtype") from None


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None, *, dtypes: Mapping[str, str] | None = None) -> bytearray:
    """Serialize arrays (in mapping order) into one blob, copying each tensor's bytes once.
    ``dtypes`` marks uint16 arrays as BF16."""
    arrays = []
    entries = []
    for name, array in tensors.items():
        a = np.asarray(array)
        dtype = _dtype_of(name, a, dtypes)
        entries.append((name, dtype, tuple(a.shape)))
        arrays.append(a)
    header = encode_header(entries, metadata)
    out = bytearray(len(header) + sum(TensorSpec(*e).nbytes for e in entries))
    out[: len(header)] = header
    offset = len(header)
    for (_, dtype, shape), a in zip(entries, arrays):
        n = TensorSpec("", dtype, shape).nbytes
        np.copyto(np.frombuffer(out, dtype.storage, a.size, offset).reshape(a.shape), a, casting="same_kind" if dtype is not BF16 else "unsafe")
        offset += n
    return out


def views(buffer: Any, layout: Layout) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of every tensor (BF16 as uint16, I128 as 16-byte voids)."""
    out = {}
    for e in layout.entries:
        out[e.spec.name] = np.frombuffer(
            buffer, dtype=e.spec.dtype.storage, count=e.spec.numel, offset=layout.data_start + e.begin
        ).reshape(e.spec.shape)
    return out
