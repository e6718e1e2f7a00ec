"""FedAvg over updates held in process memory: what every baseline's aggregators run.

The baselines use lifl's own update format (``lifl.format``), streaming FedAvg
(``lifl.fedavg``) and fold kernels (``lifl.kernels``), so a comparison measures the data and
control planes, never a different aggregation. What differs is where the bytes live: here in
each aggregator's heap (bytearrays it received), in lifl in shared memory.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lifl import format as fmt
from lifl.errors import BadRequest
from lifl.fedavg import Contribution, StreamingFedAvg, average_into
from lifl.kernels import Tensors

# A batch of inputs in one body (SL's invocations): per input, kind (0 update, 1 partial),
# samples, updates it stands for, and the blob's length; then the blob.
_FRAME = struct.Struct("<BQQQ")
MAX_BATCH_INPUTS = 1024


@dataclass
class Input:
    """One input of an aggregator as it arrived: a client update or a partial sum, in bytes."""

    blob: bytes | bytearray | memoryview
    samples: int
    updates: int
    partial: bool


def contribution(item: Input, spec: fmt.ModelSpec) -> Contribution:
    """The tensors of an input, checked against the job's model (a partial in accumulator dtypes)."""
    layout = fmt.parse_layout(item.blob, allow_partial=item.partial)
    fmt.check_matches(layout, spec.partial() if item.partial else spec)
    return Contribution(Tensors.of(item.blob, layout, spec), item.samples, item.updates, item.partial, item.blob)


class Aggregation:
    """One aggregator's task: fold inputs as they are offered (eager), or all at once (lazy:
    ``offer`` them together), and give the result as bytes: a partial sum for a parent, or the
    averaged model at the top."""

    def __init__(self, spec: fmt.ModelSpec, fan_in: int) -> None:
        self.spec = spec
        self._partial_header = fmt.spec_header(spec.partial())
        self._partial_layout = fmt.parse_header(self._partial_header[fmt.PREFIX_BYTES :], allow_partial=True)
        self._fedavg = StreamingFedAvg(fan_in)
        self._live: list[Contribution] = []

    @property
    def complete(self) -> bool:
        return self._fedavg.complete

    def offer(self, items: Sequence[Input]) -> None:
        batch = [contribution(item, self.spec) for item in items]
        self._live.extend(batch)
        folded = self._fedavg.offer(batch, self._new_accumulator)
        for c in folded:
            c.tensors.release()
            self._live.remove(c)
        if self._fedavg.state is not None and self._fedavg.state not in self._live:
            self._live.append(self._fedavg.state)

    def _new_accumulator(self) -> tuple[Tensors, bytearray]:
        buffer = bytearray(len(self._partial_header) + self.spec.partial().data_bytes)
        buffer[: len(self._partial_header)] = self._partial_header
        return Tensors.of(buffer, self._partial_layout, self.spec), buffer

    def result(self) -> Input:
        """The partial sum (or a lone input, untouched) for the parent."""
        total = self._fedavg.result()
        return Input(total.token, total.samples, total.updates, total.partial)

    def model(self) -> tuple[bytearray | bytes | memoryview, Input]:
        """The averaged model (a lone client update is its own average), and what it stands for."""
        total = self.result()
        if not total.partial:
            return total.blob, total
        header = fmt.spec_header(self.spec)
        out = bytearray(len(header) + self.spec.data_bytes)
        out[: len(header)] = header
        tensors = Tensors.of(out, fmt.parse_header(header[fmt.PREFIX_BYTES :]), self.spec)
        try:
            average_into(tensors, self._fedavg.result())
        finally:
            tensors.release()
        return out, total

    def close(self) -> None:
        for c in self._live:
            c.tensors.release()
        self._live.clear()


def frame(items: Sequence[Input]) -> list[bytes | bytearray | memoryview]:
    """A batch as the parts of one body (sent with a gathered write: no copy into one buffer)."""
    parts: list[bytes | bytearray | memoryview] = []
    for item in items:
        parts.append(_FRAME.pack(int(item.partial), item.samples, item.updates, len(item.blob)))
        parts.append(item.blob)
    return parts


def framed_size(items: Sequence[Input]) -> int:
    return sum(_FRAME.size + len(item.blob) for item in items)


def unframe(body: bytes | bytearray | memoryview) -> Iterator[Input]:
    """The inputs of a batch body, as views into it; a malformed batch raises BadRequest."""
    view = memoryview(body)
    offset = count = 0
    while offset < len(view):
        if len(view) - offset < _FRAME.size:
            raise BadRequest(f"batch ends inside an input's frame at byte {offset}", code="bad_batch")
        partial, samples, updates, size = _FRAME.unpack_from(view, offset)
        offset += _FRAME.size
        if partial > 1 or samples < 1 or updates < 1 or size > len(view) - offset:
            raise BadRequest(f"batch input {count} has an invalid frame (kind {partial}, samples {samples}, "
                             f"updates {updates}, {size} bytes with {len(view) - offset} left)", code="bad_batch")
        count += 1
        if count > MAX_BATCH_INPUTS:
            raise BadRequest(f"a batch holds at most {MAX_BATCH_INPUTS} inputs", code="bad_batch")
        yield Input(view[offset : offset + size], samples, updates, bool(partial))
        offset += size
