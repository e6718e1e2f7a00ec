"""The top's strategy step: the round's sum becomes the next model the way the job's strategy says.

FedAvg needs nothing but the sum (the handler averages it itself). Every other strategy
(``lifl.strategy``) runs here, once per round, on the top's instance: the agent hands over the
keys of what the step reads besides the sum (the model the round started from, the strategy's
state, and for strategies that are not eager every client update of the round with the model
it was trained from), all mapped read-only in place. The step writes the new model and the new
state into fresh objects of this task; the agent checkpoints the state before the model and
keeps it for the next round's step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.fedavg import Contribution
from lifl.runtime import Context, Invocation
from lifl.shards import TensorShard
from lifl.strategy import StepInputs, Update, mean_spec, partials, state_model_spec, step
from lifl.strategy.step import copy_non_float, floats_of


def _views(ctx: Context, mm: Any) -> dict[str, np.ndarray]:
    return fmt.views(mm, ctx.layout(mm))


def _sliced(views: dict[str, np.ndarray], shard: TensorShard | None) -> dict[str, np.ndarray]:
    return views if shard is None else shard.slices(views)


def run_step(inv: Invocation, ctx: Context, result: Contribution, model_header: bytes,
             average_into: Callable[[Any, fmt.ModelSpec, Contribution], None]) -> tuple[bytes, bytes, dict[str, Any]]:
    """The round's new model: (its key, the strategy state's key or b"", the step's report).
    ``average_into(mapped, spec, result)`` writes the round's FedAvg into a mapped object of ``spec``.
    A top of a sharded round steps its shard: its pieces of every input, written into its slices
    of the next model and state the round's tops share (a strategy that reads whole updates:
    see ``_step_every_shard``)."""
    shard, strategy = inv.shard, inv.strategy  # no bfloat16 tensors: the agent refuses such a model for a strategy
    spec = shard.spec if shard else inv.spec
    inputs = ctx.strategy_inputs(inv, result.updates)

    def whole(key: bytes) -> dict[str, np.ndarray]:  # an object of the whole model (or state)
        return _views(ctx, ctx.open(key))

    if result.partial:  # the sum becomes the round's mean first, in an object of this task
        mean = mean_spec(spec)
        _, mm = ctx.accumulator(inv, fmt.spec_header(mean), mean.data_bytes)
        average_into(mm, mean, result)
        average = _views(ctx, mm)
    else:  # a single update is its own mean
        average = _sliced(whole(result.token), shard)
    current = whole(inputs.current)
    updates = [Update(whole(u.key), u.samples, u.staleness, whole(u.base), u.client) for u in inputs.updates]
    if shard is not None:
        key, mm = ctx.next_model(inv)
    else:
        key, mm = ctx.accumulator(inv, model_header, spec.data_bytes)
    out = _views(ctx, mm)
    state_key, state_out = b"", None
    state = state_model_spec(strategy, inv.spec)
    if state is not None:
        state_key, state_mm = (ctx.next_model(inv, state=True) if shard is not None else
                               ctx.accumulator(inv, fmt.spec_header(state), state.data_bytes))
        state_out = _sliced(_views(ctx, state_mm), shard)
    own = StepInputs(
        current=_sliced(current, shard), version=inv.version, average=average,
        updates=[_pieces_of(u, lambda tensors: _sliced(tensors, shard)) for u in updates],
        state=_sliced(whole(inputs.state), shard) if inputs.state else None, seed=inputs.seed,
        offsets=shard.offsets if shard is not None else {}, count=result.updates,
    )
    if shard is None or not strategy.reads_whole_updates:
        return key, state_key, step(strategy, own, _sliced(out, shard), state_out)
    return key, b"", _step_every_shard(inv, ctx, own, current, updates, out)


def _pieces_of(update: Update, pick: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> Update:
    """The update with ``pick``'s part of its tensors and of its base."""
    return replace(update, tensors=pick(update.tensors), base=pick(update.base) if update.base is not None else None)


def _step_every_shard(inv: Invocation, ctx: Context, own: StepInputs, current: dict[str, np.ndarray],
                      updates: list[Update], out: dict[str, np.ndarray]) -> dict[str, Any]:
    """Krum's distances and dp's norms are sums over the whole model: this top writes its own
    pieces of the tensors no rule aggregates (from its shard's mean), sends its shard's partials
    and is done, unless they complete the round's set: then it steps every shard's float
    tensors with the sum, the unsharded step's numbers. No top waits for another (one may not
    have an instance yet). Returns the step's report ({} from the others)."""
    assert inv.shard is not None and inv.shards is not None
    copy_non_float(own, inv.shard.slices(out))
    sums = ctx.step_partials(inv, partials(inv.strategy, own))
    if sums is None:
        return {}
    report: dict[str, Any] = {}
    for shard in inv.shards.shards:
        def pick(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return floats_of(shard.slices(tensors))

        pieces = replace(own, current=pick(current), average=None, offsets=shard.offsets, partials=sums,
                         updates=[_pieces_of(u, pick) for u in updates])
        report = step(inv.strategy, pieces, pick(out), None)
    return report
