"""Tensor shards: a model's flat data range cut into slices that aggregate apart.

A sharded job (``"shards": M``) aggregates each slice of its updates in a hierarchy of its
own, so one aggregator holds about 1/M of an update and its accumulator, and the M
hierarchies fold in parallel. A slice is a contiguous byte range of the model's canonical
data section (its tensors in the initial model's order, packed as ``format.spec_header``
lays them out), made of *pieces*: runs of consecutive elements of one tensor. Cuts fall

- on tensor boundaries (``"tensor"`` alignment): no tensor is split, so there are at most as
  many shards as tensors that hold data, and a tensor larger than a slice makes its shard
  larger; or
- on element boundaries (``"element"``): M slices of nearly equal bytes, each cut moved down
  to a cache line of the data section where the tensor's elements allow it (in slices of at
  least CUT_ALIGN_MIN_SLICE bytes).

Cuts that would leave a slice empty are dropped, so a plan may have fewer shards than asked
(a model of 3 elements has at most 3). Tensors without elements belong to the shard their
offset falls in. The plan is a pure function of the model's spec, the count and the
alignment: every node and every aggregator derives the same one.

(``lifl.cluster_types.Shard`` is something else: a round's per-node record in Redis.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from lifl.errors import BadRequest
from lifl import format as fmt
from lifl.format import DType, Layout, ModelSpec, TensorSpec

TENSOR = "tensor"
ELEMENT = "element"
ALIGNMENTS = (ELEMENT, TENSOR)
MAX_SHARDS = 64  # hierarchies per round: each costs a task per role and a hand-off per update
AUTO_SHARD_BYTES = 256 << 20  # "shards": "auto" aims at slices of at most this many bytes...
AUTO_MEMORY_FRACTION = 16  # ...and at most this fraction of the node's shared memory
CUT_ALIGN_BYTES = 64  # element cuts prefer cache-line boundaries (the data section starts on one)...
CUT_ALIGN_MIN_SLICE = 16 * CUT_ALIGN_BYTES  # ...in slices large enough that a line makes no imbalance


@dataclass(frozen=True)
class Piece:
    """Elements [begin, end) of one tensor."""

    tensor: str
    dtype: DType
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.begin

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorShard:
    index: int
    pieces: tuple[Piece, ...]
    data_begin: int  # bytes of the canonical data section this shard covers
    data_end: int

    @property
    def nbytes(self) -> int:
        return self.data_end - self.data_begin

    @cached_property
    def spec(self) -> ModelSpec:
        """The shard as a model of its own: one flat tensor per piece, named after its tensor
        (a shard holds at most one piece of each), which is how its partial sums are laid out."""
        return ModelSpec(tuple(TensorSpec(p.tensor, p.dtype, (p.numel,)) for p in self.pieces))

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Where each piece starts in its tensor (elements): how a shard's step places its blocks."""
        return {p.tensor: p.begin for p in self.pieces}

    def slices(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The shard's pieces of a whole model's ``tensors`` (or of a strategy state's, named
        "<prefix>/<tensor>") as flat views, named as ``tensors`` names them; tensors with no
        piece here are left out."""
        pieces = {p.tensor: p for p in self.pieces}
        out = {}
        for name, array in tensors.items():
            piece = pieces.get(name) or pieces.get(name.split("/", 1)[-1])
            if piece is not None:
                out[name] = array.reshape(-1)[piece.begin : piece.end]
        return out

    @property
    def ranges(self) -> list[tuple[str, int, int]]:
        """(tensor, first element, elements) of each piece: where it lies in any blob of the model."""
        return [(p.tensor, p.begin, p.numel) for p in self.pieces]


@dataclass(frozen=True)
class ShardPlan:
    alignment: str
    shards: tuple[TensorShard, ...]

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> TensorShard:
        return self.shards[index]


def check_request(value: object, alignment: object) -> tuple[int, str]:
    """A job's ``shards`` (a count, or "auto": 0) and ``shard_alignment``, validated."""
    if alignment not in ALIGNMENTS:
        raise BadRequest(f"shard_alignment must be one of {', '.join(ALIGNMENTS)}, got {alignment!r}", code="bad_job")
    if value == "auto":
        return 0, str(alignment)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SHARDS:
        raise BadRequest(f"shards must be an integer in [1, {MAX_SHARDS}] or \"auto\", got {value!r}", code="bad_job")
    return value, str(alignment)


def auto_count(data_bytes: int, memory_bytes: int) -> int:
    """How many shards ``"auto"`` asks for: slices of at most AUTO_SHARD_BYTES and of at most
    1/AUTO_MEMORY_FRACTION of the node's shared memory (``memory_bytes``)."""
    target = max(1, min(AUTO_SHARD_BYTES, memory_bytes // AUTO_MEMORY_FRACTION))
    return max(1, min(MAX_SHARDS, -(-data_bytes // target)))


@lru_cache(maxsize=64)  # the controller asks every tick for every job: 14 ms for 300 tensors in 64 shards
def resolve(requested: int, alignment: str, spec: ModelSpec, memory_bytes: int) -> ShardPlan | None:
    """A job's plan: ``requested`` shards (0: "auto", from the model's size and the node's
    ``memory_bytes``); None when the model stays whole (one shard asked, or possible)."""
    count = requested or auto_count(spec.data_bytes, memory_bytes)
    cut = plan(spec, count, alignment) if count > 1 else None
    return cut if cut is not None and len(cut) > 1 else None


def split_record(requested: int, alignment: str, spec: ModelSpec, memory_bytes: int, nodes: Sequence[str]) -> str:
    """The parts of a sharded job's model across ``nodes`` (``assign_nodes`` over them sorted),
    as the job keeps them in Redis: "" when the model stays whole or there is one node. The
    record names the count the plan was cut with ("auto" is resolved here, on the node setting
    the model, once), so every node derives the same plan from it (``parts_of``)."""
    cut = resolve(requested, alignment, spec, memory_bytes)
    if cut is None or len(nodes) < 2:
        return ""
    count = requested or auto_count(spec.data_bytes, memory_bytes)
    parts = assign_nodes(cut, sorted(nodes))
    return json.dumps({"count": count, "alignment": alignment, "parts": [[p.node, p.first, p.stop] for p in parts]},
                      separators=(",", ":"))


def split_cut(record: str) -> tuple[int, str]:
    """The count and the alignment a ``split_record``'s plan was cut with (``plan``'s arguments)."""
    doc = json.loads(record)
    return doc["count"], doc["alignment"]


@lru_cache(maxsize=64)
def parts_of(spec: ModelSpec, record: str) -> tuple[ShardPlan, tuple[NodePart, ...]]:
    """The plan and the parts a ``split_record`` describes."""
    doc = json.loads(record)
    cut = plan(spec, *split_cut(record))
    return cut, tuple(NodePart(node, cut.alignment, cut.shards[first:stop]) for node, first, stop in doc["parts"])


def plan(spec: ModelSpec, count: int, alignment: str = ELEMENT) -> ShardPlan:
    """Cut ``spec``'s canonical data section into at most ``count`` non-empty slices."""
    if not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"a plan has 1..{MAX_SHARDS} shards, not {count}")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"unknown shard alignment {alignment!r}")
    spans: list[tuple[TensorSpec, int]] = []  # each tensor with its canonical offset
    total = 0
    for t in spec.tensors:
        spans.append((t, total))
        total += t.nbytes
    lined = total // count >= CUT_ALIGN_MIN_SLICE
    cuts = sorted({_cut(spans, total * k // count, alignment, lined) for k in range(1, count)} - {0, total}) if total else []
    bounds = [0, *cuts, total]
    shards = []
    for index, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        last = index == len(bounds) - 2
        pieces = tuple(_piece(t, offset, begin, end) for t, offset in spans if _overlaps(t, offset, begin, end, last))
        shards.append(TensorShard(index, pieces, begin, end))
    return ShardPlan(alignment, tuple(shards))


def _cut(spans: list[tuple[TensorSpec, int]], target: int, alignment: str, lined: bool) -> int:
    """The cut nearest ``target`` allowed by the alignment (``lined``: on a cache line if it can)."""
    if alignment == TENSOR:
        boundaries = [offset for t, offset in spans if t.nbytes]
        return min(boundaries, key=lambda b: (abs(b - target), b))  # 0 among them: dropped by the caller
    for t, offset in spans:
        if offset <= target < offset + t.nbytes:
            size = t.dtype.itemsize
            cut = offset + (target - offset) // size * size
            line = cut - cut % CUT_ALIGN_BYTES
            return line if lined and line >= offset and (line - offset) % size == 0 else cut
    return target  # the end of the data: dropped by the caller


def _overlaps(t: TensorSpec, offset: int, begin: int, end: int, last: bool) -> bool:
    """Whether the tensor has elements in [begin, end), or, without elements, lies there (the
    last shard also takes those at its end)."""
    if t.nbytes:
        return offset < end and offset + t.nbytes > begin
    return begin <= offset and (offset < end or last)


def _piece(t: TensorSpec, offset: int, begin: int, end: int) -> Piece:
    size = t.dtype.itemsize
    first = max(begin, offset)
    last = min(end, offset + t.nbytes)
    return Piece(t.name, t.dtype, (first - offset) // size, (last - offset) // size)


@dataclass(frozen=True)
class NodePart:
    """The shards one node holds of every update and of every version: a contiguous run of a
    plan's shards, so one byte range of the canonical data section. The node sees the part as a
    model of its own (``spec``: a flat tensor per tensor it has elements of, named after it), in
    which its shards lie as ``plan`` says; a blob of that model holds exactly the canonical bytes
    [data_begin, data_end) of the whole model's."""

    node: str
    alignment: str  # the whole plan's
    shards: tuple[TensorShard, ...]

    @property
    def first(self) -> int:
        return self.shards[0].index

    @property
    def stop(self) -> int:
        return self.shards[-1].index + 1

    @property
    def data_begin(self) -> int:
        return self.shards[0].data_begin

    @property
    def data_end(self) -> int:
        return self.shards[-1].data_end

    @property
    def nbytes(self) -> int:
        return self.data_end - self.data_begin

    def holds(self, shard: int) -> bool:
        return self.first <= shard < self.stop

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """One piece per tensor: its shards' pieces of that tensor, which are consecutive."""
        merged: dict[str, Piece] = {}
        for p in (p for shard in self.shards for p in shard.pieces):
            prior = merged.get(p.tensor)
            merged[p.tensor] = p if prior is None else Piece(p.tensor, p.dtype, prior.begin, p.end)
        return tuple(merged.values())

    @cached_property
    def spec(self) -> ModelSpec:
        return ModelSpec(tuple(TensorSpec(p.tensor, p.dtype, (p.numel,)) for p in self.pieces))

    @cached_property
    def plan(self) -> ShardPlan:
        """Its shards, numbered from 0, with their pieces and bytes counted from the part's."""
        begins = {p.tensor: p.begin for p in self.pieces}
        return ShardPlan(self.alignment, tuple(
            TensorShard(i, tuple(Piece(p.tensor, p.dtype, p.begin - begins[p.tensor], p.end - begins[p.tensor])
                                 for p in shard.pieces),
                        shard.data_begin - self.data_begin, shard.data_end - self.data_begin)
            for i, shard in enumerate(self.shards)))


def assign_nodes(plan: ShardPlan, nodes: Sequence[str]) -> tuple[NodePart, ...]:
    """Each of ``nodes`` (in the order given: every caller passes the same, sorted) takes a
    contiguous run of the plan's shards, the runs as even in bytes as whole shards allow, every
    run at least one shard: as many parts as nodes, or as shards when there are fewer."""
    if not nodes:
        raise ValueError("no node to hold the shards")
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"nodes appear twice in {list(nodes)}")
    count = min(len(nodes), len(plan))
    ends = [s.data_end for s in plan.shards]  # cumulative: shard i ends where the data section's bytes reach ends[i]
    total = ends[-1] if ends else 0
    stops = []
    first = 0
    for k in range(1, count):
        target = total * k // count
        lowest, highest = first + 1, len(plan) - (count - k)  # leave each later part a shard at least
        stop = min(range(lowest, highest + 1), key=lambda i: (abs(ends[i - 1] - target), i))
        stops.append(stop)
        first = stop
    bounds = [0, *stops, len(plan)]
    return tuple(NodePart(node, plan.alignment, plan.shards[a:b]) for node, a, b in zip(nodes, bounds, bounds[1:]))


def part_ranges(layout: Layout, part: NodePart) -> list[tuple[int, int]]:
    """Where a node's part lies in one blob of the model, laid out as ``layout`` says (a client's
    update need not be canonical): (offset from the blob's start, bytes) in the order of the
    part's own blob (``part_blob``: its pieces in the model's order), runs that follow each other
    in both merged. After the part's header, these bytes are its blob: what a client sends the
    node, streamed from a file (one run when the update is in the model's order)."""
    entries = {e.spec.name: e for e in layout.entries}
    merged: list[tuple[int, int]] = []
    for p in part.pieces:
        if not p.nbytes:
            continue
        offset = layout.data_start + entries[p.tensor].begin + p.begin * p.dtype.itemsize
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + p.nbytes)
        else:
            merged.append((offset, p.nbytes))
    return merged


def part_of(plan: ShardPlan, first: int, stop: int, node: str = "") -> NodePart:
    """The part of ``plan`` made of shards [first, stop): how a function instance, told its
    node's run, sees the model (``NodePart.spec``) and its shards (``NodePart.plan``)."""
    if not 0 <= first < stop <= len(plan):
        raise ValueError(f"shards [{first}, {stop}) are not a run of a plan of {len(plan)}")
    return NodePart(node, plan.alignment, plan.shards[first:stop])


def part_blob(blob: bytes | memoryview, part: NodePart) -> bytearray:
    """A node's part of a whole model's ``blob`` (in any tensor order) as a blob of its own
    (``NodePart.spec``): how a node that holds a part takes it from a whole model (the first,
    or one restored from a whole checkpoint)."""
    layout = fmt.parse_layout(blob)
    views = fmt.views(blob, layout)
    header = fmt.spec_header(part.spec)
    out = bytearray(len(header) + part.nbytes)
    out[: len(header)] = header
    offset = len(header)
    for p in part.pieces:
        piece = views[p.tensor].reshape(-1)[p.begin : p.end]
        out[offset : offset + p.nbytes] = piece.tobytes()
        offset += p.nbytes
    return out
