"""Thin wrappers around the C kernels (lifl/kernels.c). The GIL is released inside every call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from lifl._kernels import ffi, lib
from lifl.errors import Internal
from lifl import format as fmt
from lifl.format import Layout, ModelSpec

_ITEMSIZE = {d.code: d.itemsize for d in (*fmt.WIRE_DTYPES.values(), fmt.I128)}


def _ptr(ctype: str, array: np.ndarray) -> Any:
    """A C pointer into ``array``'s memory (``ctype`` its element type): cffi reads the buffer,
    with none of numpy's ctypes machinery (several microseconds per array, per call)."""
    return ffi.from_buffer(ctype, array)


def address(buffer: Any) -> tuple[int, Any]:
    """Base address of a (read-only or writable) buffer, and the handle that keeps it exported."""
    handle = ffi.from_buffer(buffer)
    return int(ffi.cast("uintptr_t", handle)), handle


class FiniteChecker:
    """Checks float tensors for NaN/Inf incrementally, as bytes of a blob arrive.

    ``check(buffer, upto)`` examines everything between the previous call and ``upto`` while
    those bytes are still hot in cache, so validation adds no extra pass over memory.
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        start = layout.data_start
        self._begin = np.array([start + e.begin for e in layout.entries], np.int64)
        self._end = np.array([start + e.end for e in layout.entries], np.int64)
        self._dtype = np.array([e.spec.dtype.code for e in layout.entries], np.int32)
        self._bad_tensor = ffi.new("int32_t *")
        self._bad_elem = ffi.new("int64_t *")
        self._args = (len(self._begin), _ptr("int64_t[]", self._begin), _ptr("int64_t[]", self._end), _ptr("int32_t[]", self._dtype))
        self.cursor = start

    def check(self, buffer: Any, upto: int) -> None:
        if upto <= self.cursor or not len(self._begin):
            return
        cursor = lib.lifl_check_finite_range(ffi.from_buffer(buffer), *self._args, self.cursor, upto, self._bad_tensor, self._bad_elem)
        if cursor < 0:
            raise fmt.non_finite(buffer, self._layout, self._layout.entries[self._bad_tensor[0]], int(self._bad_elem[0]))
        self.cursor = cursor


def validate(blob: bytes | bytearray | memoryview, spec: ModelSpec | None = None, *, limit: int | None = None) -> Layout:
    """Full validation of a complete blob: structure, model match and finite floats."""
    layout = fmt.parse_layout(blob, limit=limit)
    if spec is not None:
        fmt.check_matches(layout, spec)
    FiniteChecker(layout).check(blob, layout.total_size)
    return layout


class TensorTable:
    """Where a layout's tensors lie, listed in a model's tensor order; shared by every object
    with that layout (blobs with the same tensors may order them differently)."""

    def __init__(self, layout: Layout, spec: ModelSpec) -> None:
        self._place(layout, [(t.name, 0, t.numel) for t in spec.tensors])

    @classmethod
    def ranges(cls, layout: Layout, ranges: Sequence[tuple[str, int, int]]) -> TensorTable:
        """Runs of elements instead of whole tensors: (tensor, first element, elements) each,
        which is how a tensor shard (``lifl.shards``) sees a blob of the whole model."""
        table = cls.__new__(cls)
        table._place(layout, ranges)
        return table

    def _place(self, layout: Layout, ranges: Sequence[tuple[str, int, int]]) -> None:
        by_name = {e.spec.name: e for e in layout.entries}
        entries = [by_name[name] for name, _, _ in ranges]
        self.layout = layout
        self.offsets = np.array([layout.data_start + e.begin + first * e.spec.dtype.itemsize
                                 for e, (_, first, _) in zip(entries, ranges)], np.uint64)
        self.dtypes = np.array([e.spec.dtype.code for e in entries], np.int32)
        self.numel = np.array([numel for _, _, numel in ranges], np.uint64)
        self.c_dtypes, self.c_numel = _ptr("int32_t[]", self.dtypes), _ptr("uint64_t[]", self.numel)  # made once


class Tensors:
    """The tensors of one mapped object: a table plus the object's base address."""

    def __init__(self, buffer: Any, table: TensorTable) -> None:
        base, self._handle = address(buffer)
        self.pointers = table.offsets + np.uint64(base)
        self.dtypes = table.dtypes
        self.numel = table.numel
        self.table = table

    @classmethod
    def of(cls, buffer: Any, layout: Layout, spec: ModelSpec) -> Tensors:
        return cls(buffer, TensorTable(layout, spec))

    def release(self) -> None:
        """Drop the buffer export so the underlying mapping can be closed."""
        ffi.release(self._handle)


def fold(acc: Tensors, inputs: Sequence[tuple[Tensors, int]], *, init: bool, frac_bits: int = 0) -> np.ndarray:
    """acc = (0 if init else acc) + sum(weight * input), one fused pass over memory.

    Into integer accumulators of float tensors (fixed point, lifl.fixedpoint) a float input adds
    weight * round(input * 2^frac_bits), wrapping modulo 2^width. Returns each input's largest
    |value| among the tensors it quantised (0 for the others), for the overflow bound."""
    max_abs = np.zeros(len(inputs), np.float64)
    if not inputs:
        return max_abs
    pointers = np.concatenate([t.pointers for t, _ in inputs])  # row-major: input by input, tensor by tensor
    dtypes = np.concatenate([t.dtypes for t, _ in inputs])
    weights = np.array([w for _, w in inputs], np.int64)
    rc = lib.lifl_fold(
        len(acc.numel), acc.table.c_numel, acc.table.c_dtypes, _ptr("void *[]", acc.pointers),
        len(inputs), _ptr("int32_t[]", dtypes), _ptr("void *[]", pointers), _ptr("int64_t[]", weights), int(init),
        frac_bits, _ptr("double[]", max_abs),
    )
    if rc:
        raise Internal("fold received tensors whose dtypes do not match their accumulators")
    return max_abs


def copy(out: Tensors, source: Tensors) -> None:
    """out = source, tensor by tensor, in the same dtypes (a lone update's slice of a sharded
    round's next model)."""
    if not (np.array_equal(out.dtypes, source.dtypes) and np.array_equal(out.numel, source.numel)):
        raise Internal("copy between tensors of different dtypes or sizes")
    for dst, src, code, numel in zip(out.pointers, source.pointers, out.dtypes, out.numel):
        ctypes.memmove(int(dst), int(src), int(numel) * _ITEMSIZE[int(code)])


def finalize(out: Tensors, acc: Tensors, total: int, *, frac_bits: int = 0) -> None:
    """out = acc / total in the model's dtypes, rounding once per element (fixed-point sums:
    acc / (total * 2^frac_bits))."""
    rc = lib.lifl_finalize(
        len(out.numel), out.table.c_numel, out.table.c_dtypes, _ptr("void *[]", out.pointers),
        acc.table.c_dtypes, _ptr("void *[]", acc.pointers), int(total), frac_bits,
    )
    if rc:
        raise Internal(f"finalize failed (total weight {total})")
