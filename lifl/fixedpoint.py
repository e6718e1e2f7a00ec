"""Fixed-point (deterministic) aggregation: the job option ``fixed_point`` (docs/fixed-point.md).

A float update w of weight c (its sample count) enters the sum as c * round(w * 2^F), an
integer of ``width`` bits (round half to even: the FPU's default mode, numpy's ``rint``).
Integer addition is associative, so the sum -- and the model the top derives from it by one
float64 division by 2^F * sum(c) -- has the same bits whatever the arrival order, batching and
hierarchy shape. Summing modulo 2^width is also what secure-aggregation schemes compute, so
the same accumulators could carry masked updates.

Overflow is detected by a bound, not by looking at the sums (a masked sum mod 2^width looks
like noise): every partial sum carries ``bound`` = sum over its updates of c * max|q|, an upper
bound of every coordinate's |sum|. The bound is itself an integer sum, so whether a round
overflows does not depend on the order or the hierarchy either. A fold whose bound reaches
2^(width-1) fails (``check_bound``) instead of ever yielding a wrapped model; so does an update
with a |w| * 2^F of 2^51 or more, beyond the kernel's exact (vectorised) rounding. The bound is
global over all tensors (one max per update, found in the quantising pass at no extra memory
traffic), so it is conservative by at most the ratio of the largest tensor's range to the others'.

Partial sums hold the bound in one extra I64 tensor, ``BOUND_TENSOR``, after the model's
(``partial_spec``), so it travels with the object through the hierarchy and
survives a task's restart from its last accumulator.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lifl.errors import BadRequest, Unprocessable
from lifl.format import F64, I32, I64, I128, DType, Layout, ModelSpec, TensorSpec

WIDTHS = (32, 64)
DEFAULT_FRAC_BITS = 24
BOUND_TENSOR = "__fixed_point_bound__"  # I64[1] in fixed-point partial sums: sum of c * max|q|
ROUNDING_LIMIT = 1 << 51  # |w| * 2^F must stay below: the kernel's exact rounding range (lifl/kernels.c)


@dataclass(frozen=True)
class FixedPoint:
    """q = round(w * 2^frac_bits) summed (times c) in ``width``-bit two's complement integers."""

    frac_bits: int = DEFAULT_FRAC_BITS
    width: int = 64

    def __post_init__(self) -> None:
        if self.width not in WIDTHS:
            raise BadRequest(f"fixed_point width must be one of {', '.join(map(str, WIDTHS))}, got {self.width!r}",
                             code="bad_fixed_point")
        # frac_bits <= width - 2 leaves at least one integer bit beside the sign
        if not (type(self.frac_bits) is int and 0 <= self.frac_bits <= self.width - 2):
            raise BadRequest(f"fixed_point frac_bits must be an integer in [0, {self.width - 2}] for width {self.width}, "
                             f"got {self.frac_bits!r}", code="bad_fixed_point")

    @classmethod
    def from_request(cls, obj: Any) -> FixedPoint | None:
        """The job field: None or {} (off), or {"frac_bits": F, "width": 32|64} (either may be left out)."""
        if obj is None or obj == {}:
            return None
        if not isinstance(obj, dict):
            raise BadRequest("fixed_point must be a JSON object such as {\"frac_bits\": 24, \"width\": 64}",
                             code="bad_fixed_point")
        unknown = sorted(set(obj) - {"frac_bits", "width"})
        if unknown:
            raise BadRequest(f"unknown fixed_point field(s): {', '.join(unknown)}", code="bad_fixed_point")
        return cls(**obj)

    def to_json(self) -> dict[str, Any]:
        return {"frac_bits": self.frac_bits, "width": self.width}

    @property
    def limit(self) -> int:
        """Sums must stay strictly below this in magnitude."""
        return 1 << (self.width - 1)

    @property
    def resolution(self) -> float:
        """The quantisation step 2^-F; rounding errs by at most half of it per coordinate."""
        return 2.0 ** -self.frac_bits

    def quantised_max(self, max_abs: float) -> int:
        """max|q| of an update whose largest magnitude is ``max_abs`` (rounding is monotonic)."""
        return round(Fraction(max_abs) * (1 << self.frac_bits))  # exact, half to even, even past float range

    def check_bound(self, bound: int, max_abs: float) -> None:
        """Refuse a sum whose coordinates might not fit (``bound`` is sum(c * max|q|)), or an input
        the kernel cannot round exactly (``max_abs``: the largest |w| among this fold's updates)."""
        if bound >= self.limit or self.quantised_max(max_abs) >= ROUNDING_LIMIT:
            raise Unprocessable(
                f"fixed-point overflow: sum of sample count x largest |quantised value| = {bound} must stay below "
                f"2^{self.width - 1}, and every |value| x 2^{self.frac_bits} below 2^51 (frac_bits {self.frac_bits}, "
                f"width {self.width}; largest |value| in this fold {max_abs:g}): use width 64 or fewer frac_bits",
                code="fixed_point_overflow",
            )

def partial_spec(spec: ModelSpec, fixed_point: FixedPoint | None, floats: DType = F64) -> ModelSpec:
    """The spec of the model's partial sums: float accumulators of ``floats`` without fixed
    point (``ModelSpec.partial``); with it, float tensors sum in integers of its width, and one
    more tensor carries the sum's overflow bound."""
    if fixed_point is None:
        return spec.partial(floats)
    if BOUND_TENSOR in spec:
        raise BadRequest(f"tensor name {BOUND_TENSOR!r} is reserved for fixed-point aggregation", code="bad_fixed_point")
    integer = I64 if fixed_point.width == 64 else I32
    return ModelSpec((*(TensorSpec(t.name, integer if t.dtype.kind == "f" else I128, t.shape) for t in spec.tensors),
                      TensorSpec(BOUND_TENSOR, I64, (1,))))


def _bound_offset(layout: Layout) -> int:
    for entry in reversed(layout.entries):  # partial_spec puts it last
        if entry.spec.name == BOUND_TENSOR:
            return layout.data_start + entry.begin
    raise Unprocessable("a fixed-point partial sum has no overflow bound", code="fixed_point_bound_missing")


def read_bound(buffer: Any, layout: Layout) -> int:
    """The overflow bound a fixed-point partial sum carries (struct, not numpy: no buffer export
    outlives the call, so the mapping can be closed)."""
    return struct.unpack_from("<q", buffer, _bound_offset(layout))[0]


def write_bound(buffer: Any, layout: Layout, bound: int) -> None:
    struct.pack_into("<q", buffer, _bound_offset(layout), bound)
