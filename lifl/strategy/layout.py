"""The objects a top's strategy step allocates besides the new model, as lifl.format specs: the
round's mean (float tensors in float64, so Δ = mean − x is not rounded to the model's dtype
first) and the optimiser's state (``state_spec``)."""

from __future__ import annotations

from lifl import format as fmt
from lifl.strategy.spec import StrategySpec
from lifl.strategy.step import state_spec


def mean_spec(spec: fmt.ModelSpec) -> fmt.ModelSpec:
    """The round's mean: float tensors in float64, the others in the model's dtype."""
    return fmt.ModelSpec(tuple(fmt.TensorSpec(t.name, fmt.F64 if t.dtype.kind == "f" else t.dtype, t.shape)
                               for t in spec.tensors))


def state_model_spec(strategy: StrategySpec, spec: fmt.ModelSpec) -> fmt.ModelSpec | None:
    """The strategy's state as an object of float64 tensors; None when it keeps none."""
    layout = state_spec(strategy, [(t.name, t.dtype.storage, t.shape) for t in spec.tensors if t.dtype.kind == "f"])
    return fmt.ModelSpec(tuple(fmt.TensorSpec(name, fmt.F64, shape) for name, _, shape in layout)) if layout else None


def strategy_bytes(strategy: StrategySpec, spec: fmt.ModelSpec) -> int:
    """Shared memory a step allocates besides the model: the mean and the state (fedavg: none)."""
    if not strategy.runs_step:
        return 0
    objects = [mean_spec(spec), state_model_spec(strategy, spec)]
    return sum(len(fmt.spec_header(o)) + o.data_bytes for o in objects if o is not None)
