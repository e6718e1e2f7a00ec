"""Aggregation strategies chosen per job (issue 14): the pure step that turns a round into the
next model, with Flower's formulas. ``spec``: what a job asks for; ``step``: the math;
``partials``: what a sharded step sums over its shards; ``privacy``: dp_fedavg's budget; ``layout``: the objects a top allocates for a step."""

from lifl.strategy.layout import mean_spec, state_model_spec, strategy_bytes
from lifl.strategy.privacy import privacy
from lifl.strategy.spec import NAMES, StrategySpec
from lifl.strategy.step import StepInputs, Update, partials, state_spec, step

__all__ = ["NAMES", "StepInputs", "StrategySpec", "Update", "mean_spec", "partials", "privacy", "state_model_spec", "state_spec",
           "step", "strategy_bytes"]
