"""Streaming FedAvg: the Agg step of an aggregator, without I/O.

The result is sum(c_k * w_k) / sum(c_k) over whatever arrived, in any order. The running sum
is kept in accumulator dtypes (float64, int128): float32 sums lose the answer whenever
updates cancel, and dividing only at the end avoids the bias of running-mean updates.

Folding policy, chosen for memory traffic (every fold is one fused pass over memory):
- a lone first input is *held*, not copied: scaling one update into an accumulator is a
  copy, not aggregation. When a second input arrives both are combined in one pass into a
  fresh accumulator, which costs no more traffic per update than a memcpy.
- every later batch is folded as soon as it is offered (eager), all queued inputs together,
  into a *fresh* accumulator together with the previous one (the same traffic as folding in
  place: the old sum is read once, the new one written once). So the latest accumulator is
  always a complete, consistent sum of what it reports folded, even if its process is killed
  mid-fold: a task that dies runs again from it and the inputs not folded yet.
- an aggregator with one input forwards it untouched: a leaf that receives a single update
  passes its key on, and a top with a single client update installs it as the model.

Fixed point (``lifl.fixedpoint``, optional per job): float tensors are summed as integers,
c * round(w * 2^F), so the sum has the same bits whatever the order and grouping of the folds;
each partial sum also carries its overflow bound, checked at every fold. A round of one
update still installs that update untouched: every hierarchy shape does the same for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lifl.fixedpoint import FixedPoint
from lifl.kernels import Tensors, finalize, fold


@dataclass
class Contribution:
    """One input or output of an aggregator: a client update or a partial sum."""

    tensors: Tensors
    samples: int  # sum of the clients' sample counts it stands for
    updates: int  # number of client updates it stands for
    partial: bool  # True: tensors hold sum(c*w) in accumulator dtypes; False: a client's w
    token: Any = None  # the caller's handle (object key, mapping) for releasing it
    bound: int = 0  # fixed-point partial sums: sum of c * max|q| over the updates in it (lifl.fixedpoint)

    @property
    def weight(self) -> int:
        return 1 if self.partial else self.samples


class StreamingFedAvg:
    """``fan_in`` None: not known yet (``resize`` tells it once the round has closed).
    ``fixed_point``: sum float tensors in integers (the accumulators must be of
    ``partial_spec(spec, fixed_point)``; partial inputs must say their ``bound``). ``masked``:
    every input is a secure round's masked input or a sum of them (``lifl.secagg``), whose bound
    slot holds a masked sample count: it sums modulo 2^64, and no bound can be checked."""

    def __init__(self, fan_in: int | None, fixed_point: FixedPoint | None = None, *, masked: bool = False) -> None:
        if fan_in is not None and fan_in < 1:
            raise ValueError(f"fan-in must be at least 1, got {fan_in}")
        if masked and fixed_point is None:
            raise ValueError("masked inputs are fixed-point sums")
        self.fan_in = fan_in
        self.fixed_point = fixed_point
        self.masked = masked
        self.received = 0
        self._held: Contribution | None = None
        self._acc: Contribution | None = None

    @property
    def complete(self) -> bool:
        return self.complete_with(0)

    def complete_with(self, more: int) -> bool:
        """Whether ``more`` inputs beyond those received would complete it."""
        return self.fan_in is not None and self.received + more >= self.fan_in

    def resize(self, fan_in: int) -> None:
        """Set how many inputs arrive in all (the round closed, or a lost input lowered it)."""
        if fan_in < max(self.received, 1):
            raise ValueError(f"cannot set the fan-in to {fan_in}: {self.received} inputs arrived already")
        self.fan_in = fan_in

    def offer(self, batch: Sequence[Contribution], new_accumulator: Callable[[], tuple[Tensors, Any]]) -> list[Contribution]:
        """Fold a batch of arrived inputs; returns those now folded in (the previous accumulator
        among them), which the caller may release."""
        if not batch:
            return []
        if self.fan_in is not None and self.received + len(batch) > self.fan_in:
            raise ValueError(f"received {self.received + len(batch)} inputs for a fan-in of {self.fan_in}")
        self.received += len(batch)
        if self._acc is None:
            pending = ([self._held] if self._held else []) + list(batch)
            if len(pending) == 1:  # hold it: a second input or completion (forward) comes next
                self._held = pending[0]
                return []
            self._held = None
            folded = pending
        else:
            folded = [self._acc, *batch]
        tensors, token = new_accumulator()
        frac_bits = self.fixed_point.frac_bits if self.fixed_point else 0
        max_abs = fold(tensors, [(c.tensors, c.weight) for c in folded], init=True, frac_bits=frac_bits)
        self._acc = Contribution(tensors, sum(c.samples for c in folded), sum(c.updates for c in folded), True, token,
                                 self._bound(folded, max_abs))
        return folded

    def _bound(self, folded: Sequence[Contribution], max_abs: np.ndarray) -> int:
        """The fixed-point overflow bound of the sum of ``folded`` (0 without fixed point); raises
        if it may have overflowed. Checked after the pass, which found the max|w| it needs: a
        wrapped sum is never forwarded or installed."""
        fp = self.fixed_point
        if fp is None:
            return 0
        if self.masked:  # as int64 two's complement, as the slot holds it
            total = sum(c.bound for c in folded) % (1 << 64)
            return total - (1 << 64) if total >= 1 << 63 else total
        bound = sum(c.bound if c.partial else c.samples * fp.quantised_max(float(m)) for c, m in zip(folded, max_abs))
        fp.check_bound(bound, float(max_abs.max()))
        return bound

    @property
    def state(self) -> Contribution | None:
        """The accumulator holding everything folded so far (None while nothing was)."""
        return self._acc

    def result(self) -> Contribution:
        """The sum once complete: the accumulator, or the single input itself."""
        if not self.complete:
            raise RuntimeError(f"aggregation has {self.received} of {self.fan_in} inputs")
        result = self._acc or self._held
        if result is None:
            raise RuntimeError("aggregation closed with no inputs")
        return result


def average_into(out: Tensors, total: Contribution, fixed_point: FixedPoint | None = None) -> None:
    """Write the FedAvg result of a partial sum into ``out`` (model dtypes)."""
    if not total.partial:
        raise ValueError("a single client update is already its own average")
    finalize(out, total.tensors, total.samples, frac_bits=fixed_point.frac_bits if fixed_point else 0)
