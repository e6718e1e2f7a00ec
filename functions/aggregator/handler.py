"""The aggregator function: LIFL's step-based processing model (appendix G).

Recv takes object keys from the task's FIFO; Agg folds them into the running FedAvg sum as
they arrive (eager; see ``lifl.fedavg`` for the folding policy); Send hands the result's key
on to the parent, or, for the top of the hierarchy, writes the averaged model and installs it.
Recv and Agg overlap: whatever queued while a fold ran is folded together next. (A lazy
invocation, the baseline of the comparisons, folds everything at once after the last input.)

The same code serves every role; the invocation says which one and the fan-in (open until
the round closes); where the result goes is the runtime's business.

A task of a sharded job (``lifl.shards``) sees only its shard: the pieces of each client
update it folds (mapped where they lie in the update's object), partial sums of the shard's
size, and, as a top, its slice of the next model, in the object the round's tops share.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from lifl import format as fmt
from lifl import secagg
from lifl.keys.record import KIND_CLOSE, KIND_PREPARE, now_ns
from lifl.fedavg import Contribution, StreamingFedAvg, average_into
from lifl.fixedpoint import FixedPoint, partial_spec, read_bound, write_bound
from lifl.errors import NotFound
from lifl.kernels import TensorTable, Tensors, copy
from lifl.shards import TensorShard
from lifl.protocol import TOP
from lifl.functions.aggregator import top
from lifl.runtime import Context, Invocation

_tables: dict[tuple[int, int], tuple[fmt.Layout, fmt.ModelSpec | TensorShard, TensorTable]] = {}
_headers: dict[tuple[int, FixedPoint | None, fmt.DType], tuple[fmt.ModelSpec, bytes, bytes, int]] = {}


def _table(layout: fmt.Layout, spec: fmt.ModelSpec | TensorShard) -> TensorTable:
    """Where ``spec``'s tensors (or a shard's pieces of a whole model's) lie in ``layout``."""
    key = (id(layout), id(spec))
    hit = _tables.get(key)
    if hit is None:
        if len(_tables) > 256:
            _tables.clear()
        table = TensorTable.ranges(layout, spec.ranges) if isinstance(spec, TensorShard) else TensorTable(layout, spec)
        hit = _tables[key] = (layout, spec, table)
    return hit[2]


def _spec_headers(spec: fmt.ModelSpec, fixed_point: FixedPoint | None, floats: fmt.DType) -> tuple[bytes, bytes, int]:
    """(model header, partial-sum header, partial-sum data bytes) for a job's model, made once."""
    hit = _headers.get((id(spec), fixed_point, floats))
    if hit is None or hit[0] is not spec:
        partial = partial_spec(spec, fixed_point, floats)
        hit = _headers[(id(spec), fixed_point, floats)] = (spec, fmt.spec_header(spec), fmt.spec_header(partial),
                                                           partial.data_bytes)
    return hit[1], hit[2], hit[3]


def _whole_model(layout: fmt.Layout, shard: TensorShard) -> bool:
    """Whether an input of a shard's task is a blob of the whole model (a client update) rather
    than one of the shard's partial sums (where a piece is a whole tensor, both read the same)."""
    numel = {e.spec.name: e.spec.numel for e in layout.entries}
    return any(numel.get(p.tensor) != p.numel for p in shard.pieces)


def _mapped(ctx: Context, mm: Any, spec: fmt.ModelSpec | TensorShard) -> Tensors:
    return Tensors(mm, _table(ctx.layout(mm), spec))


def _unmasked(inv: Invocation, ctx: Context, total: Contribution, streams: list[tuple[int, bytes]], header: bytes,
              data_bytes: int, spec: fmt.ModelSpec, live: list[Tensors]) -> Contribution:
    """A secure task's result with ``streams`` taken off: the masks of its clients' inputs (their
    self masks, and the pair masks they added for neighbours that dropped after sharing), told
    once the round's secrets are rebuilt (``lifl.secagg_round.MaskedInputs``). Each task takes
    off its own clients', so the PRG expansions are spread over the round's leaves and nodes,
    and the top's sum of its children's results is the survivors' plain sum, their sample count
    in the bound's slot. In a fresh object: the task's state stays the masked sum a run of it
    again starts from."""
    if streams:
        key, mm = ctx.accumulator(inv, header, data_bytes)
        out = _mapped(ctx, mm, spec)
        live.append(out)
        copy(out, total.tensors)
        write_bound(mm, ctx.layout(mm), total.bound)
        segments = secagg.segments(mm)
        secagg.add_masks(segments, streams)
        del segments  # views of the mapping: it closes with the task
        total = Contribution(out, total.samples, total.updates, True, key, read_bound(mm, ctx.layout(mm)))
    return dataclasses.replace(total, samples=total.bound) if inv.role == TOP else total


def handle(inv: Invocation, ctx: Context) -> dict[str, Any]:
    shard = inv.shard
    spec = shard.spec if shard else inv.spec  # what its partial sums hold
    whole: fmt.ModelSpec | TensorShard = shard or spec  # what it reads of a client update
    fixed_point = inv.fixed_point
    model_header, partial_header, partial_bytes = _spec_headers(spec, fixed_point, inv.accumulator)
    agg = StreamingFedAvg(inv.fan_in or None, fixed_point, masked=inv.secure)
    delivery_us: list[float] = []  # sent -> the message in hand (the channel, and waking up)
    handoff_us: list[float] = []  # sent -> a readable view of the object (delivery, then mapping it)
    recv_s = agg_s = agg_cpu_s = alloc_s = 0.0
    folds = 0
    live: list[Tensors] = []
    prepared: dict[bytes, tuple[Any, Tensors]] = {}  # inputs announced and mapped ahead of their key
    premapped = 0
    queued: list[Contribution] = []  # lazy: everything waits for the last input
    latest: Any = None  # the newest accumulator's mapping (fixed point: its bound is written there)
    last_fold: tuple[list[bytes], bytes, float] | None = None  # a leaf's or middle's final fold, reported with its result
    masked_inputs: set[bytes] = set()  # a secure round's client inputs given to this run
    # a secure round's: the mask streams this task took off, its wait for them, the time taking them off took
    unmasked, unmask_wait_s, unmask_s = 0, 0.0, 0.0

    def new_accumulator() -> tuple[Tensors, bytes]:
        nonlocal alloc_s, latest
        t = time.perf_counter()
        key, latest = ctx.accumulator(inv, partial_header, partial_bytes)
        tensors = _mapped(ctx, latest, spec)
        live.append(tensors)
        alloc_s += time.perf_counter() - t
        if agg.complete and inv.role != TOP and not inv.secure:  # this fold writes the result: the parent may map it now
            ctx.announce(inv, key)
        return tensors, key

    def open_input(key: bytes) -> tuple[Any, Tensors]:
        nonlocal premapped
        hit = prepared.pop(key, None)
        premapped += hit is not None
        if hit is None:
            mm = ctx.open(key)
            layout = ctx.layout(mm)
            hit = mm, Tensors(mm, _table(layout, whole if shard and _whole_model(layout, shard) else spec))
            live.append(hit[1])
        return hit

    try:
        # Recv + Agg
        while not agg.complete:
            t0 = time.perf_counter()
            messages = ctx.receive(inv)
            received_ns = now_ns()
            for msg in messages:
                if msg.kind == KIND_CLOSE:
                    agg.resize(msg.count)
                    continue
                if msg.kind == KIND_PREPARE:  # only a hint: an object that cannot be mapped is left alone
                    if msg.key not in prepared:
                        try:
                            prepared[msg.key] = open_input(msg.key)
                        except (NotFound, PermissionError):
                            pass
                    continue
                mm, tensors = open_input(msg.key)
                delivery_us.append((received_ns - msg.sent_ns) / 1e3)
                handoff_us.append((now_ns() - msg.sent_ns) / 1e3)
                if inv.secure and not msg.partial:
                    masked_inputs.add(msg.key)
                partial = msg.partial or inv.secure  # a masked input is laid out as a partial sum (lifl.secagg)
                bound = read_bound(mm, ctx.layout(mm)) if fixed_point and partial else 0
                queued.append(Contribution(tensors, msg.samples, msg.count, partial, msg.key, bound))
            batch = [] if inv.lazy and not agg.complete_with(len(queued)) else queued
            t1, c1 = time.perf_counter(), time.thread_time()
            folded = agg.offer(batch, new_accumulator)
            t2 = time.perf_counter()
            agg_cpu_s += time.thread_time() - c1
            recv_s += t1 - t0
            agg_s += t2 - t1
            if batch is queued:
                queued = []
            if folded:
                folds += 1
                for c in folded:
                    c.tensors.release()
                    live.remove(c.tensors)
                assert agg.state is not None
                if fixed_point:  # before the accumulator is reported: a restarted task resumes from it
                    write_bound(latest, ctx.layout(latest), agg.state.bound)
                keys = [c.token for c in folded]
                if agg.complete and inv.role != TOP and not inv.secure:  # reported with the result, in one message
                    last_fold = keys, agg.state.token, t2 - t1
                else:  # the next fold's accumulator comes with the answer
                    ctx.folded(inv, keys, sum(c.updates for c in folded if not c.partial), t2 - t1, agg.state.token,
                               next_size=0 if agg.complete else len(partial_header) + partial_bytes)
        result = agg.result()
        if inv.secure:  # its folds are all reported: the agent knows whose inputs it summed up
            lone = agg.state is None and result.token in masked_inputs
            t = time.perf_counter()
            streams = ctx.unmasking_seeds(inv, [result.token] if lone else [])
            t1 = time.perf_counter()
            result = _unmasked(inv, ctx, result, streams, partial_header, partial_bytes, spec, live)
            unmask_wait_s, unmask_s, unmasked = t1 - t, time.perf_counter() - t1, len(streams)

        # Send
        t3 = time.perf_counter()
        if inv.role != TOP:
            ctx.forward(inv, result.token, result.samples, result.updates, result.partial, agg_s, folded=last_fold)
        else:
            def write_mean(mm: Any, out_spec: fmt.ModelSpec | TensorShard, total: Contribution) -> None:
                out = _mapped(ctx, mm, out_spec)
                live.append(out)
                average_into(out, total, fixed_point)

            key, state, report = result.token, b"", None
            if inv.strategy.runs_step:  # lifl.strategy: the sum is one of the step's inputs
                key, state, report = top.run_step(inv, ctx, result, model_header, write_mean)
            elif shard is not None:  # its slice of the one object every top of the round writes
                key, mm = ctx.next_model(inv)
                if result.partial:
                    write_mean(mm, shard, result)
                else:  # a lone client update: its slice is the model's
                    out = _mapped(ctx, mm, shard)
                    live.append(out)
                    copy(out, result.tensors)
            elif result.partial:  # a single client update needs no averaging: it is the model
                key, mm = ctx.accumulator(inv, model_header, spec.data_bytes)
                write_mean(mm, spec, result)
            ctx.install(inv, key, result.samples, result.updates, state=state, report=report)
        send_s = time.perf_counter() - t3
    finally:
        for tensors in live:
            tensors.release()
    return {
        "role": inv.role,
        "inputs": agg.received,
        "folds": folds,  # passes over the accumulator (lazy: one)
        "updates": result.updates,
        "samples": result.samples,
        "delivery_us": delivery_us,
        "handoff_us": handoff_us,
        "premapped": premapped,  # inputs whose hand-off found them mapped already (announced)
        "recv_s": recv_s,
        "agg_s": agg_s,
        "agg_cpu_s": agg_cpu_s,  # the same on this thread's CPU: what folding costs whatever else runs
        "alloc_s": alloc_s,  # part of agg_s: getting (and on first use, mapping) the accumulator
        "send_s": send_s,
        **({"unmasked": unmasked, "unmask_wait_s": unmask_wait_s, "unmask_s": unmask_s} if inv.secure else {}),
        "bytes": spec.data_bytes,  # of its shard, if the job has shards
    }
