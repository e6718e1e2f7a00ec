"""Shard plans as tables: how a model's data section is cut into slices."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lifl import format as fmt
from lifl.errors import BadRequest
from lifl.format import BF16, F32, F64, I64, ModelSpec, TensorSpec
from lifl.kernels import TensorTable
from lifl.shards import ELEMENT, MAX_SHARDS, TENSOR, assign_nodes, auto_count, check_request, part_blob, part_of, part_ranges, plan


def model(*tensors: tuple[str, fmt.DType, tuple[int, ...]]) -> ModelSpec:
    return ModelSpec(tuple(TensorSpec(*t) for t in tensors))


def pieces(spec: ModelSpec, count: int, alignment: str) -> list[list[tuple[str, int, int]]]:
    return [[(p.tensor, p.begin, p.end) for p in s.pieces] for s in plan(spec, count, alignment).shards]


ONE = model(("w", F32, (100,)))
THREE = model(("a", F32, (16,)), ("b", F32, (32,)), ("c", F32, (16,)))  # 64, 128, 64 bytes
MIXED = model(("h", BF16, (3,)), ("w", F32, (5,)), ("n", I64, (1,)))  # 6, 20, 8 bytes: odd offsets


@pytest.mark.parametrize("spec, count, alignment, expected", [
    (ONE, 1, ELEMENT, [[("w", 0, 100)]]),
    (ONE, 1, TENSOR, [[("w", 0, 100)]]),
    (ONE, 4, ELEMENT, [[("w", 0, 25)], [("w", 25, 50)], [("w", 50, 75)], [("w", 75, 100)]]),
    # slices of 1 KiB or more are cut on cache lines: 4,000 bytes in 2 -> target 2,000 -> 1,984
    (model(("w", F32, (1000,))), 2, ELEMENT, [[("w", 0, 496)], [("w", 496, 1000)]]),
    (ONE, 4, TENSOR, [[("w", 0, 100)]]),  # one tensor: one shard whatever is asked
    # uneven shards: 256 bytes in 3 -> targets 85, 170 -> element boundaries 84, 168
    (THREE, 3, ELEMENT, [[("a", 0, 16), ("b", 0, 5)], [("b", 5, 26)], [("b", 26, 32), ("c", 0, 16)]]),
    (THREE, 3, TENSOR, [[("a", 0, 16)], [("b", 0, 32)], [("c", 0, 16)]]),
    (THREE, 2, TENSOR, [[("a", 0, 16)], [("b", 0, 32), ("c", 0, 16)]]),  # target 128: nearest boundary 64
    # more shards than tensors: tensor cuts stop at the tensor count, element cuts go on
    (THREE, 8, TENSOR, [[("a", 0, 16)], [("b", 0, 32)], [("c", 0, 16)]]),
    (THREE, 8, ELEMENT, [[("a", 0, 8)], [("a", 8, 16)], [("b", 0, 8)], [("b", 8, 16)], [("b", 16, 24)], [("b", 24, 32)],
                         [("c", 0, 8)], [("c", 8, 16)]]),
    # mixed dtypes: cuts fall on each tensor's element boundaries (no cache line within reach)
    (MIXED, 2, ELEMENT, [[("h", 0, 3), ("w", 0, 2)], [("w", 2, 5), ("n", 0, 1)]]),
    (MIXED, 3, ELEMENT, [[("h", 0, 3), ("w", 0, 1)], [("w", 1, 4)], [("w", 4, 5), ("n", 0, 1)]]),
    # more shards than elements: at most one per element
    (model(("x", F64, (3,))), 5, ELEMENT, [[("x", 0, 1)], [("x", 1, 2)], [("x", 2, 3)]]),
    # tensors without elements stay in the shard at their offset, or the last one at the end
    (model(("e", F32, (0,)), ("w", F32, (32,)), ("z", F32, (0, 4))), 2, ELEMENT,
     [[("e", 0, 0), ("w", 0, 16)], [("w", 16, 32), ("z", 0, 0)]]),
    (model(("e", F32, (0,))), 3, ELEMENT, [[("e", 0, 0)]]),
])
def test_plans(spec: ModelSpec, count: int, alignment: str, expected: list[list[tuple[str, int, int]]]) -> None:
    assert pieces(spec, count, alignment) == expected


@pytest.mark.parametrize("spec", [ONE, THREE, MIXED, model(("a", BF16, (1001,)), ("b", F64, (7, 3)), ("c", F32, (333,)))])
@pytest.mark.parametrize("count", [1, 2, 3, 7, MAX_SHARDS])
@pytest.mark.parametrize("alignment", [ELEMENT, TENSOR])
def test_a_plan_covers_the_data_once_in_order(spec: ModelSpec, count: int, alignment: str) -> None:
    p = plan(spec, count, alignment)
    assert 1 <= len(p) <= count
    assert p[0].data_begin == 0 and p[len(p) - 1].data_end == spec.data_bytes
    for before, after in zip(p.shards, p.shards[1:]):
        assert before.data_end == after.data_begin and after.nbytes > 0
    covered = [(piece.tensor, e) for s in p.shards for piece in s.pieces for e in range(piece.begin, piece.end)]
    assert covered == [(t.name, e) for t in spec.tensors for e in range(t.numel)]
    for s in p.shards:
        assert sum(piece.nbytes for piece in s.pieces) == s.nbytes == s.spec.data_bytes
        if alignment == TENSOR:
            assert all(piece.begin == 0 and piece.end == spec[piece.tensor].numel for piece in s.pieces)


def test_element_shards_are_balanced() -> None:
    p = plan(model(("w", F32, (1 << 20,))), 7, ELEMENT)
    sizes = [s.nbytes for s in p.shards]
    assert max(sizes) - min(sizes) <= 2 * 64


def test_a_shard_views_its_slice_of_any_blob_of_the_model() -> None:
    """Blobs may order tensors differently: a shard finds its pieces by name."""
    rng = np.random.default_rng(1)
    arrays = {"b": rng.standard_normal((7, 3)), "a": rng.standard_normal(40).astype(np.float32)}
    spec = model(("a", F32, (40,)), ("b", F64, (7, 3)))
    blob = fmt.encode(arrays)  # b first: not the canonical order
    layout = fmt.parse_layout(blob)
    flat = np.concatenate([arrays["a"].astype(np.float64), arrays["b"].ravel()])
    seen = []
    for s in plan(spec, 3, ELEMENT).shards:
        table = TensorTable.ranges(layout, s.ranges)
        for piece, offset, numel in zip(s.pieces, table.offsets, table.numel):
            values = np.frombuffer(blob, piece.dtype.storage, int(numel), int(offset))
            seen.extend(values.astype(np.float64))
    np.testing.assert_array_equal(seen, flat)


@pytest.mark.parametrize("data_bytes, memory, expected", [
    (0, 1 << 30, 1),
    (100 << 20, 16 << 30, 1),
    (2 << 30, 16 << 30, 8),  # slices of 256 MiB
    (2 << 30, 1 << 30, 32),  # the node's memory asks for slices of 64 MiB
    (1 << 40, 1 << 30, MAX_SHARDS),
])
def test_auto_count(data_bytes: int, memory: int, expected: int) -> None:
    assert auto_count(data_bytes, memory) == expected


@pytest.mark.parametrize("value, alignment, expected", [
    (1, ELEMENT, (1, ELEMENT)), (MAX_SHARDS, TENSOR, (MAX_SHARDS, TENSOR)), ("auto", ELEMENT, (0, ELEMENT)),
])
def test_requests(value: object, alignment: object, expected: tuple[int, str]) -> None:
    assert check_request(value, alignment) == expected


@pytest.mark.parametrize("value, alignment, needle", [
    (0, ELEMENT, "shards must be"), (MAX_SHARDS + 1, ELEMENT, "shards must be"), (-1, ELEMENT, "shards must be"),
    (True, ELEMENT, "shards must be"), (2.0, ELEMENT, "shards must be"), ("4", ELEMENT, "shards must be"),
    ("AUTO", ELEMENT, "shards must be"), (None, ELEMENT, "shards must be"), (2, "bytes", "shard_alignment"),
    (2, None, "shard_alignment"), (2, ["tensor"], "shard_alignment"),
])
def test_bad_requests(value: object, alignment: object, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        check_request(value, alignment)


def test_plan_refuses_counts_out_of_range() -> None:
    for count in (0, MAX_SHARDS + 1):
        with pytest.raises(ValueError):
            plan(ONE, count)


NODES = ["n1", "n2", "n3", "n4"]
UNEVEN = model(("a", F32, (25,)), ("b", F32, (2,)), ("c", F32, (3,)), ("d", F32, (25,)))  # 100, 8, 12, 100 bytes


@pytest.mark.parametrize("spec, count, alignment, nodes, expected", [
    (ONE, 4, ELEMENT, NODES, [("n1", 0, 1), ("n2", 1, 2), ("n3", 2, 3), ("n4", 3, 4)]),
    (ONE, 4, ELEMENT, NODES[:2], [("n1", 0, 2), ("n2", 2, 4)]),
    (ONE, 4, ELEMENT, NODES[:1], [("n1", 0, 4)]),
    (ONE, 2, ELEMENT, NODES, [("n1", 0, 1), ("n2", 1, 2)]),  # fewer shards than nodes: some hold none
    (ONE, 4, ELEMENT, NODES[:3], [("n1", 0, 1), ("n2", 1, 3), ("n3", 3, 4)]),  # targets 133, 266 bytes: ends 100/200/300
    # whole tensors of uneven sizes: the runs even out the bytes (110 and 110), not the shard counts
    (UNEVEN, 4, TENSOR, NODES[:2], [("n1", 0, 2), ("n2", 2, 4)]),
    # one large shard first: every later node still gets a shard
    (UNEVEN, 4, TENSOR, NODES[:3], [("n1", 0, 1), ("n2", 1, 3), ("n3", 3, 4)]),
    (UNEVEN, 4, TENSOR, NODES, [("n1", 0, 1), ("n2", 1, 2), ("n3", 2, 3), ("n4", 3, 4)]),
])
def test_node_parts(spec: ModelSpec, count: int, alignment: str, nodes: list[str],
                    expected: list[tuple[str, int, int]]) -> None:
    cut = plan(spec, count, alignment)
    parts = assign_nodes(cut, nodes)
    assert [(p.node, p.first, p.stop) for p in parts] == expected
    assert [p.data_begin for p in parts] == [cut[p.first].data_begin for p in parts]
    assert parts[0].data_begin == 0 and parts[-1].data_end == spec.data_bytes
    assert all(a.data_end == b.data_begin for a, b in zip(parts, parts[1:]))  # one range each, the data once


@pytest.mark.parametrize("nodes, needle", [([], "no node"), (["n1", "n2", "n1"], "twice")])
def test_node_parts_refuse(nodes: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        assign_nodes(plan(ONE, 4), nodes)


def test_a_parts_ranges_in_any_blob_are_its_blobs_data_and_cover_the_data_once() -> None:
    spec = model(("a", BF16, (1001,)), ("b", F64, (7, 3)), ("c", F32, (333,)))
    cut = plan(spec, 7, ELEMENT)
    rng = np.random.default_rng(5)
    tensors = {t.name: rng.standard_normal(t.shape).astype(np.float32 if t.dtype is F32 else np.float64) for t in spec.tensors}
    tensors["a"] = rng.integers(0, 1 << 15, size=(1001,), dtype=np.uint16)
    for order in (["a", "b", "c"], ["c", "a", "b"]):  # canonical, and laid out otherwise
        blob = bytes(fmt.encode({name: tensors[name] for name in order}, dtypes={"a": "BF16"}))
        layout = fmt.parse_layout(blob)
        covered = bytearray(len(blob))
        for part in assign_nodes(cut, NODES):
            ranges = part_ranges(layout, part)
            if order[0] == "a":
                assert len(ranges) == 1  # canonical: one run per node
            own = part_blob(blob, part)
            data = own[fmt.parse_layout(own).data_start:]
            assert b"".join(blob[offset:offset + size] for offset, size in ranges) == data  # its blob, after its header
            for offset, size in ranges:
                assert covered[offset:offset + size] == bytes(size)
                covered[offset:offset + size] = b"\x01" * size
        assert covered[layout.data_start:] == b"\x01" * layout.data_len  # every data byte once, the header in none
        assert not any(covered[:layout.data_start])


@pytest.mark.parametrize("spec", [THREE, MIXED, model(("a", BF16, (1001,)), ("b", F64, (7, 3)), ("e", F32, (0,)), ("c", F32, (333,)))])
@pytest.mark.parametrize("count, nodes", [(2, 2), (7, 3), (8, 4), (5, 1)])
@pytest.mark.parametrize("alignment", [ELEMENT, TENSOR])
def test_a_part_is_a_model_whose_blobs_hold_its_canonical_bytes_and_its_shards_slices(
        spec: ModelSpec, count: int, nodes: int, alignment: str) -> None:
    cut = plan(spec, count, alignment)
    rng = np.random.default_rng(count)
    whole = {t.name: rng.integers(-1000, 1000, size=t.shape).astype(t.dtype.storage) for t in spec.tensors}
    blob = bytes(fmt.encode(whole, dtypes={t.name: t.dtype.name for t in spec.tensors}))
    layout = fmt.parse_layout(blob)
    data = blob[layout.data_start:]
    for part in assign_nodes(cut, NODES[:nodes]):
        assert part_of(cut, part.first, part.stop) == dataclasses.replace(part, node="")
        assert part.spec.data_bytes == part.nbytes
        # the part's own blob: the whole model's canonical bytes of its range, in its own layout
        flat = {p.tensor: whole[p.tensor].reshape(-1)[p.begin:p.end] for p in part.pieces}
        encoded = bytes(fmt.encode(flat, dtypes={t.name: t.dtype.name for t in part.spec.tensors}))
        assert part_blob(blob, part) == encoded  # what a node takes of a whole model
        reordered = bytes(fmt.encode(dict(reversed(whole.items())), dtypes={t.name: t.dtype.name for t in spec.tensors}))
        assert part_blob(reordered, part) == encoded  # from a whole blob in any order
        part_layout = fmt.parse_layout(encoded)
        fmt.check_matches(part_layout, part.spec)
        assert encoded[part_layout.data_start:] == data[part.data_begin:part.data_end]
        # each of its shards finds in the part's blob what it finds in the whole model's
        assert [s.index for s in part.plan.shards] == list(range(part.stop - part.first))
        for mine, theirs in zip(part.plan.shards, cut.shards[part.first:part.stop]):
            assert mine.spec == theirs.spec and mine.nbytes == theirs.nbytes
            got = mine.slices(fmt.views(encoded, part_layout))
            want = theirs.slices(fmt.views(blob, layout))
            assert got.keys() == want.keys()
            for name in want:
                assert np.array_equal(got[name], want[name])


@pytest.mark.parametrize("first, stop", [(0, 0), (-1, 2), (2, 1), (0, 5)])
def test_part_of_refuses_what_is_not_a_run(first: int, stop: int) -> None:
    with pytest.raises(ValueError, match="not a run"):
        part_of(plan(ONE, 4), first, stop)
