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
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.fedavg import Contribution
from lifl.runtime import Context, Invocation
from lifl.shards import TensorShard
from lifl.strategy import StepInputs, Update, mean_spec, state_model_spec, step


def _views(ctx: Context, mm: Any) -> dict[str, np.ndarray]:
    return fmt.views(mm, ctx.layout(mm))


def _sliced(views: dict[str, np.ndarray], shard: TensorShard | None) -> dict[str, np.ndarray]:
    return views if shard is None else shard.slices(views)


def run_step(inv: Invocation, ctx: Context, result: Contribution, model_header: bytes,
             average_into: Callable[[Any, fmt.ModelSpec, Contribution], None]) -> tuple[bytes, bytes, dict[str, Any]]:
    """The round's new model: (its key, the strategy state's key or b"", the step's report).
    ``average_into(mapped, spec, result)`` writes the round's FedAvg into a mapped object of ``spec``.
    A top of a sharded round (a coordinate-wise strategy) steps its shard: its pieces of every
    input, written into its slices of the next model and state the round's tops share."""
    shard, strategy = inv.shard, inv.strategy  # no bfloat16 tensors: the agent refuses such a model for a strategy
    spec = shard.spec if shard else inv.spec
    inputs = ctx.strategy_inputs(inv, result.updates)

    def opened(key: bytes) -> dict[str, np.ndarray]:  # an object of the whole model (or state)
        return _sliced(_views(ctx, ctx.open(key)), shard)

    if result.partial:  # the sum becomes the round's mean first, in an object of this task
        mean = mean_spec(spec)
        _, mm = ctx.accumulator(inv, fmt.spec_header(mean), mean.data_bytes)
        average_into(mm, mean, result)
        average = _views(ctx, mm)
    else:  # a single update is its own mean
        average = opened(result.token)
    updates = [Update(opened(u.key), u.samples, u.staleness, opened(u.base), u.client) for u in inputs.updates]
    if shard is not None:
        key, mm = ctx.next_model(inv)
        out = _sliced(_views(ctx, mm), shard)
    else:
        key, model_mm = ctx.accumulator(inv, model_header, spec.data_bytes)
        out = _views(ctx, model_mm)
    state_key, state_out = b"", None
    state = state_model_spec(strategy, inv.spec)
    if state is not None:
        state_key, state_mm = (ctx.next_model(inv, state=True) if shard is not None else
                               ctx.accumulator(inv, fmt.spec_header(state), state.data_bytes))
        state_out = _sliced(_views(ctx, state_mm), shard)
    report = step(strategy, StepInputs(
        current=opened(inputs.current), version=inv.version, average=average, updates=updates,
        state=opened(inputs.state) if inputs.state else None, seed=inputs.seed,
        offsets=shard.offsets if shard is not None else {},
    ), out, state_out)
    return key, state_key, report
