"""The aggregator handler's own tests, run in the function image's test stage (and by the suite).

They drive ``handle`` through the one interface it has, ``Context``, whose object I/O here is
process memory instead of a node's shared memory: each object is an anonymous mapping holding
lifl's update format, exactly as the handler maps them on a node. Every result is checked
against FedAvg computed in float64 with numpy.
"""

from __future__ import annotations

import itertools
import mmap
import secrets
from collections import deque
from typing import Any

import numpy as np
import pytest

from lifl import format as fmt
from lifl import secagg
from lifl.fixedpoint import FixedPoint
from lifl.keys.record import KIND_CLOSE, KIND_PREPARE, KeyMessage
from lifl.errors import NotFound
from lifl.runtime import Context, Invocation

from .handler import handle

SHAPES = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc.weight": (10, 16)}


class MemoryContext(Context):
    """Context with its objects in this process's memory and its messages given up front."""

    def __init__(self, messages: list[KeyMessage]) -> None:
        super().__init__(1, "acme", "node", client=None, channel=None)  # type: ignore[arg-type]
        self.inbox = deque(messages)
        self.objects: dict[bytes, mmap.mmap] = {}
        self.forwarded: dict[str, Any] | None = None
        self.installed: dict[str, Any] | None = None
        self.folds = 0
        self.opened: list[bytes] = []
        self.announced: list[bytes] = []
        self._keys = itertools.count(1)

    def put(self, blob: bytes | bytearray) -> bytes:
        key = next(self._keys).to_bytes(16, "big")
        mm = mmap.mmap(-1, len(blob))
        mm[:] = blob
        self.objects[key] = mm
        return key

    def receive(self, inv: Invocation) -> list[KeyMessage]:
        assert self.inbox, "the handler waited for more inputs than were sent"
        batch = list(self.inbox)
        self.inbox.clear()
        return batch

    def open(self, key: bytes) -> mmap.mmap:
        self.opened.append(key)
        if key not in self.objects:
            raise NotFound(f"shared-memory object {key.hex()} does not exist", code="no_such_object")
        return self.objects[key]

    def announce(self, inv: Invocation, key: bytes) -> None:
        self.announced.append(key)

    def accumulator(self, inv: Invocation, header: bytes, data_bytes: int) -> tuple[bytes, mmap.mmap]:
        key = self.put(bytes(len(header) + data_bytes))
        self.objects[key][: len(header)] = header
        return key, self.objects[key]

    def folded(self, inv: Invocation, keys: list[bytes], updates: int, seconds: float, state: bytes,
               next_size: int = 0) -> None:
        self.folds += 1

    def forward(self, inv: Invocation, key: bytes, samples: int, updates: int, partial: bool,
                agg_seconds: float = 0.0, folded: tuple[list[bytes], bytes, float] | None = None) -> None:
        self.folds += folded is not None  # a leaf's or middle's last fold is reported with its result
        self.forwarded = {"key": key, "tensors": self.tensors(key), "samples": samples, "updates": updates,
                          "partial": partial, "last_fold": folded}

    def install(self, inv: Invocation, key: bytes, samples: int, updates: int, *, state: bytes = b"",
                report: dict | None = None) -> int:
        self.installed = {"tensors": self.tensors(key), "samples": samples, "updates": updates, "state": state}
        return inv.version + 1

    def tensors(self, key: bytes) -> dict[str, np.ndarray]:
        mm = self.objects[key]
        layout = fmt.parse_layout(mm, allow_partial=True)
        return {name: np.array(view) for name, view in fmt.views(mm, layout).items()}


def updates(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()} for _ in range(count)]


def fedavg64(models: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    total = sum(samples)
    return {name: sum(m[name].astype(np.float64) * s for m, s in zip(models, samples)) / total for name in SHAPES}


def run(role: str, models: list[dict[str, np.ndarray]], samples: list[int], *, fan_in: int | None = None,
        lazy: bool = False, close_at: int | None = None) -> tuple[MemoryContext, dict[str, Any]]:
    """``handle`` one task over these client updates; ``close_at``: the task starts open (fan-in 0)
    and a close message after that many inputs sets its fan-in."""
    ctx = MemoryContext([])
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    for i, (model, s) in enumerate(zip(models, samples)):
        if close_at == i:
            ctx.inbox.append(KeyMessage(dest=1, task=7, kind=KIND_CLOSE, count=close_at))
        ctx.inbox.append(KeyMessage(dest=1, task=7, key=ctx.put(fmt.encode(model)), samples=s, count=1))
    if close_at == len(models):
        ctx.inbox.append(KeyMessage(dest=1, task=7, kind=KIND_CLOSE, count=close_at))
    inv = Invocation(7, "job", 3, role, len(models) if fan_in is None else fan_in, lazy, spec)
    return ctx, handle(inv, ctx)


@pytest.mark.parametrize("lazy", [False, True])
def test_top_installs_the_weighted_average(lazy: bool) -> None:
    models, samples = updates(3), [5, 1, 30]
    ctx, stats = run("top", models, samples, lazy=lazy)
    assert ctx.installed is not None and ctx.forwarded is None
    assert (ctx.installed["samples"], ctx.installed["updates"]) == (36, 3)
    expected = fedavg64(models, samples)
    for name, tensor in ctx.installed["tensors"].items():
        assert tensor.dtype == np.float32
        np.testing.assert_allclose(tensor, expected[name], rtol=1e-6, atol=1e-6)
    assert stats["inputs"] == 3 and stats["updates"] == 3
    assert stats["folds"] == 1 if lazy else stats["folds"] >= 1


def test_leaf_forwards_the_exact_weighted_sum() -> None:
    models, samples = updates(2, seed=1), [3, 4]
    ctx, _ = run("leaf", models, samples)
    assert ctx.installed is None and ctx.forwarded is not None
    assert (ctx.forwarded["samples"], ctx.forwarded["updates"], ctx.forwarded["partial"]) == (7, 2, True)
    for name, tensor in ctx.forwarded["tensors"].items():
        assert tensor.dtype == np.float64  # partial sums keep float64: nothing is lost before the top divides
        np.testing.assert_allclose(tensor, fedavg64(models, samples)[name] * 7, rtol=1e-12)
    # its one fold is reported with its result, in one message: both inputs summed up in the result itself
    keys, state, _ = ctx.forwarded["last_fold"]
    assert len(keys) == 2 and state == ctx.forwarded["key"] and ctx.folds == 1


def test_a_single_update_is_the_model() -> None:
    models = updates(1, seed=2)
    ctx, stats = run("top", models, [9])
    assert ctx.installed is not None and ctx.folds == 0
    for name, tensor in ctx.installed["tensors"].items():
        np.testing.assert_array_equal(tensor, models[0][name])


def test_an_open_task_finishes_when_the_round_closes() -> None:
    models, samples = updates(2, seed=3), [1, 2]
    ctx, stats = run("top", models, samples, fan_in=0, close_at=2)
    assert ctx.installed is not None and stats["inputs"] == 2
    for name, tensor in ctx.installed["tensors"].items():
        np.testing.assert_allclose(tensor, fedavg64(models, samples)[name], rtol=1e-6, atol=1e-6)


def test_a_leaf_announces_the_object_its_last_fold_writes() -> None:
    """The parent may map a leaf's result while the leaf still writes it; only the last fold's
    accumulator is announced, and only below the top."""
    models, samples = updates(4, seed=5), [1, 2, 3, 4]
    ctx = MemoryContext([])
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    for model, s in zip(models, samples):  # one at a time: three folds
        ctx.inbox.append(KeyMessage(dest=1, task=7, key=ctx.put(fmt.encode(model)), samples=s, count=1))
    inv = Invocation(7, "job", 3, "leaf", 4, False, spec)
    original = ctx.receive
    ctx.receive = lambda inv: [ctx.inbox.popleft()] if ctx.inbox else original(inv)  # type: ignore[method-assign]
    handle(inv, ctx)
    assert ctx.forwarded is not None
    assert len(ctx.announced) == 1 and ctx.objects[ctx.announced[0]] is not None
    for name, tensor in ctx.tensors(ctx.announced[0]).items():  # the forwarded result is the announced object
        np.testing.assert_array_equal(tensor, ctx.forwarded["tensors"][name])
    top, _ = run("top", models, samples)
    assert top.announced == []


def test_an_announced_input_is_mapped_once_and_a_bad_hint_is_ignored() -> None:
    models, samples = updates(2, seed=6), [2, 5]
    ctx = MemoryContext([])
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    keys = [ctx.put(fmt.encode(m)) for m in models]
    ctx.inbox.extend([KeyMessage(dest=1, task=7, kind=KIND_PREPARE, key=keys[1]),
                      KeyMessage(dest=1, task=7, kind=KIND_PREPARE, key=b"\xff" * 16),  # no such object
                      KeyMessage(dest=1, task=7, kind=KIND_PREPARE, key=keys[1])])  # twice: mapped once
    ctx.inbox.extend(KeyMessage(dest=1, task=7, key=k, samples=s, count=1) for k, s in zip(keys, samples))
    stats = handle(Invocation(7, "job", 3, "top", 2, False, spec), ctx)
    assert sorted(ctx.opened) == sorted([keys[0], keys[1], b"\xff" * 16])
    assert stats["premapped"] == 1 and stats["inputs"] == 2
    expected = fedavg64(models, samples)
    assert ctx.installed is not None
    for name, tensor in ctx.installed["tensors"].items():
        np.testing.assert_allclose(tensor, expected[name], rtol=1e-6, atol=1e-6)


class SecureContext(MemoryContext):
    """A task of a secure round is told the streams that take off the masks of the client
    inputs it reported folded, or holds (here, each client's self mask: the pair masks cancel,
    no client dropped); what a task asks without having reported all its folds stays masked."""

    def __init__(self, streams: dict[bytes, tuple[int, bytes]]) -> None:
        super().__init__([])
        self.streams = streams
        self.summed: list[bytes] = []
        self.taken_off = 0

    def folded(self, inv: Invocation, keys: list[bytes], updates: int, seconds: float, state: bytes,
               next_size: int = 0) -> None:
        super().folded(inv, keys, updates, seconds, state, next_size)
        self.summed += keys

    def unmasking_seeds(self, inv: Invocation, held: list[bytes]) -> list[tuple[int, bytes]]:
        mine = [self.streams[k] for k in self.summed + held if k in self.streams]
        self.taken_off += len(mine)
        return mine


@pytest.mark.parametrize("clients, fan_in", [(3, 3), (1, 1), (4, 2), (5, 2)])
def test_a_secure_round_installs_the_fixed_point_average_of_its_masked_inputs(clients: int, fan_in: int) -> None:
    """Masked inputs fold as partial sums through leaves and the top; each task takes off the
    masks of the inputs it folded (the top: none, but those given to it directly), and the top
    installs, bit for bit, the model a plain fixed-point round of the same updates installs."""
    fp = FixedPoint(20, 64)
    models, samples = updates(clients, seed=9), [3, 8, 1, 5, 2][:clients]
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    self_seeds = [secrets.token_bytes(32) for _ in models]
    pair = secrets.token_bytes(32)  # one pair mask between the first two clients, + and -
    ctx = SecureContext({})
    keys = []
    for i, (model, s, seed) in enumerate(zip(models, samples, self_seeds)):
        blob = secagg.plain_input(model, s, spec, fp, clients)
        streams = [(1, seed)] + ([(1 if i == 0 else -1, pair)] if clients > 1 and i < 2 else [])
        secagg.add_masks(secagg.segments(blob), streams)
        keys.append(ctx.put(blob))
        ctx.streams[keys[-1]] = (-1, seed)
    groups = [keys[i:i + fan_in] for i in range(0, clients, fan_in)]
    leaves = []
    for group in groups:  # leaves take their clients' masks off and forward their sums to the top
        if len(groups) == 1:
            ctx.inbox.extend(KeyMessage(dest=1, task=7, key=k, samples=1, count=1) for k in group)
            continue
        leaf = SecureContext(ctx.streams)
        leaf.objects, leaf._keys = ctx.objects, ctx._keys
        leaf.inbox.extend(KeyMessage(dest=1, task=8, key=k, samples=1, count=1) for k in group)
        stats = handle(Invocation(8, "job", 3, "leaf", len(group), False, spec, fixed_point=fp, secure=True), leaf)
        assert leaf.forwarded is not None and leaf.forwarded["partial"] and leaf.forwarded["last_fold"] is None
        assert stats["unmasked"] == leaf.taken_off == len(group) and leaf.forwarded["key"] not in group
        leaves.append(leaf)
        ctx.inbox.append(KeyMessage(dest=1, task=7, key=leaf.forwarded["key"], samples=len(group), count=len(group),
                                    partial=True))
    stats = handle(Invocation(7, "job", 3, "top", len(groups) if len(groups) > 1 else clients, False, spec, fixed_point=fp,
                             secure=True), ctx)
    assert stats["unmasked"] == (0 if leaves else clients)
    plain = MemoryContext([])
    for model, s in zip(models, samples):
        plain.inbox.append(KeyMessage(dest=1, task=7, key=plain.put(fmt.encode(model)), samples=s, count=1))
    handle(Invocation(7, "job", 3, "top", clients, False, spec, fixed_point=fp), plain)
    assert ctx.installed is not None and plain.installed is not None
    assert ctx.installed["samples"] == sum(samples)
    for name, tensor in plain.installed["tensors"].items():
        if clients > 1:
            np.testing.assert_array_equal(ctx.installed["tensors"][name], tensor)
        else:  # a plain round of one update installs it untouched; a secure one its fixed-point rounding
            np.testing.assert_allclose(ctx.installed["tensors"][name], tensor, atol=2.0 ** -fp.frac_bits)
