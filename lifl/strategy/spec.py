"""A job's aggregation strategy: its name and parameters, checked once when the job is created.

Defaults are Flower 1.41's where Flower has the strategy, so results compare. A spec holds every
parameter filled in (the job's status shows what runs), plus what follows from the job's goal
(dp_fedavg's ``sampling_rate``), so a spec read back from its JSON needs nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lifl.params import REQUIRED, Checks, Param, show

NAMES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "median", "trimmed_mean", "krum", "multi_krum",
         "dp_fedavg", "fedbuff")
EAGER = frozenset({"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"})  # need only the round's mean
STATEFUL = frozenset({"fedavgm", "fedadam", "fedyogi", "fedadagrad"})  # a server optimiser's state across versions
MEAN_ONLY = frozenset({"fedavg"})  # the next model is the round's mean itself: no step
PRIVATE = frozenset({"dp_fedavg"})  # spend a privacy budget each round (lifl.strategy.privacy)
# steps that read norms or distances of whole updates: on tensor shards, the shards' partial sums are added first
WHOLE_UPDATES = frozenset({"krum", "multi_krum", "dp_fedavg"})
GRAM = frozenset({"krum", "multi_krum"})  # of those, what read every pair of updates
# a sharded round's tops send their n x n Gram blocks through the node's control channel (16 MiB a
# message, bytes as hex): rounds of at most this many updates keep each within a quarter of it
MAX_SHARDED_GRAM_UPDATES = 512

# dp_fedavg's clipping: the top clips every update it reads, or each client clips its own change
# before sending it (a secure job's: no update reaches the top unmasked), the top adding only noise
CLIP_ON_SERVER, CLIP_ON_CLIENT = "server", "client"
MAX_STALENESS = 100  # fedbuff keeps max_staleness + 1 models: a bound on that memory
MAX_POPULATION = 1 << 40

_CHECKS = Checks("bad_strategy", "strategy parameter")

_POSITIVE = _CHECKS.number(0.0, low_open=True)
_FRACTION = _CHECKS.number(0.0, 1.0, high_open=True)  # a decay rate: 1 would never forget, nor correct its bias
_MALICIOUS = Param(0, _CHECKS.integer(0, 1 << 20))

_PARAMS: dict[str, dict[str, Param]] = {
    "fedavg": {},
    "fedavgm": {"server_learning_rate": Param(1.0, _POSITIVE), "server_momentum": Param(0.0, _FRACTION)},
    "fedadam": {"eta": Param(1e-1, _POSITIVE), "beta_1": Param(0.9, _FRACTION), "beta_2": Param(0.99, _FRACTION),
                "tau": Param(1e-9, _POSITIVE)},
    "fedyogi": {"eta": Param(1e-2, _POSITIVE), "beta_1": Param(0.9, _FRACTION), "beta_2": Param(0.99, _FRACTION),
                "tau": Param(1e-3, _POSITIVE)},
    "fedadagrad": {"eta": Param(1e-1, _POSITIVE), "tau": Param(1e-9, _POSITIVE)},
    "median": {},
    "trimmed_mean": {"beta": Param(0.2, _CHECKS.number(0.0, 0.5, high_open=True))},
    "krum": {"num_malicious": _MALICIOUS},
    "multi_krum": {"num_malicious": _MALICIOUS, "num_selected": Param(None, _CHECKS.integer(1, 1 << 20))},
    "dp_fedavg": {"clipping_norm": Param(REQUIRED, _POSITIVE), "noise_multiplier": Param(REQUIRED, _POSITIVE),
                  "delta": Param(1e-5, _CHECKS.number(0.0, 1.0, low_open=True, high_open=True)),
                  "population": Param(None, _CHECKS.integer(1, MAX_POPULATION)), "weighted": Param(False, _CHECKS.boolean),
                  "clip_on": Param(CLIP_ON_SERVER, _CHECKS.choice(CLIP_ON_SERVER, CLIP_ON_CLIENT))},
    "fedbuff": {"max_staleness": Param(10, _CHECKS.integer(0, MAX_STALENESS)),
                "staleness_exponent": Param(0.5, _CHECKS.number(0.0, 10.0)),
                "server_learning_rate": Param(1.0, _POSITIVE)},
}
# what follows from the goal, kept in the spec: not a request's to give
_DERIVED: dict[str, tuple[str, ...]] = {"dp_fedavg": ("sampling_rate",)}


def _fill(name: str, given: Mapping[str, Any], goal: int) -> dict[str, Any]:
    """Every parameter of ``name``, checked, defaults filled in, then checked against the goal."""
    params = _CHECKS.fill(name, _PARAMS[name], given)
    f = params.get("num_malicious", 0)
    if name == "krum" or name == "multi_krum":
        if goal <= 2 * f + 2:  # Krum's guarantee: n > 2f + 2 (and at least one neighbour to score by)
            raise _CHECKS.bad(f"{name} with num_malicious={f} needs more than {2 * f + 2} updates per round; the goal is {goal}")
    if name == "multi_krum":
        if params["num_selected"] is None:  # from the goal: all but the malicious
            params["num_selected"] = goal - f
        if params["num_selected"] > goal:
            raise _CHECKS.bad(f"multi_krum's num_selected={params['num_selected']} exceeds the goal of {goal} updates per round")
    if name == "dp_fedavg":
        if params["population"] is None:  # from the goal: every client in every round
            params["population"] = goal
        if params["population"] < goal:
            raise _CHECKS.bad(f"dp_fedavg's population={params['population']} is smaller than the {goal} updates of a round")
        params["sampling_rate"] = goal / params["population"]
    return params


@dataclass(frozen=True)
class StrategySpec:
    name: str = "fedavg"
    params: tuple[tuple[str, Any], ...] = ()  # sorted, every default filled in

    @classmethod
    def from_request(cls, obj: Any, *, goal: int) -> StrategySpec:
        """The job's ``strategy`` field, {"name": ..., params...}; None or {}: fedavg. ``goal``:
        the job's updates per round."""
        if isinstance(goal, bool) or not isinstance(goal, int) or goal < 1:
            raise _CHECKS.bad(f"a strategy needs a goal of at least one update per round, got {show(goal)}")
        if obj is None:
            return cls()
        if not isinstance(obj, Mapping):
            raise _CHECKS.bad(f"strategy must be an object with a name, got {show(obj)}")
        if not obj:
            return cls()
        if "name" not in obj:
            raise _CHECKS.bad(f"strategy needs a name; choose one of {', '.join(NAMES)}")
        name = obj["name"]
        if not isinstance(name, str) or name not in NAMES:
            raise _CHECKS.bad(f"unknown strategy {show(name)}; choose one of {', '.join(NAMES)}")
        params = _fill(name, {key: value for key, value in obj.items() if key != "name"}, goal)
        return cls(name, tuple(sorted(params.items())))

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> StrategySpec:
        """The inverse of ``to_json``: a spec this module filled in, read back as it was."""
        name = obj.get("name", "fedavg")
        if name not in NAMES:
            raise ValueError(f"unknown strategy {show(name)}")
        params = {key: value for key, value in obj.items() if key != "name"}
        expected = {key for key in _PARAMS[name]} | set(_DERIVED.get(name, ()))
        if set(params) != expected:
            raise ValueError(f"strategy {name} has parameters {sorted(params)}, expected {sorted(expected)}")
        return cls(name, tuple(sorted(params.items())))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}

    def param(self, name: str) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"strategy {self.name} has no parameter {name!r}")

    @property
    def eager(self) -> bool:
        """Only the hierarchy's weighted average of the round is needed."""
        return self.name in EAGER or self.clips_on_client

    @property
    def clips_on_client(self) -> bool:
        """dp_fedavg whose clients clip their own changes: its step adds noise to the round's mean."""
        return self.name == "dp_fedavg" and dict(self.params).get("clip_on", CLIP_ON_SERVER) == CLIP_ON_CLIENT

    @property
    def needs_updates(self) -> bool:
        """Every client update of the round is needed."""
        return not self.eager

    @property
    def stateful(self) -> bool:
        """Carries a server optimiser's state from version to version."""
        return self.name in STATEFUL

    @property
    def runs_step(self) -> bool:
        """The top runs a step on the round's sum (``lifl.strategy.step``), in float64, instead of
        installing the mean as the next model."""
        return self.name not in MEAN_ONLY

    @property
    def reads_update_pairs(self) -> bool:
        """Its step reads the distance between every pair of updates (Krum): on tensor shards the
        shards' n x n Gram blocks are summed, for at most MAX_SHARDED_GRAM_UPDATES updates."""
        return self.name in GRAM

    @property
    def reads_whole_updates(self) -> bool:
        """Its step reads norms or distances of whole updates: on tensor shards (``lifl.shards``)
        each shard's top computes its ``lifl.strategy.partials`` and one top steps every shard
        with their sum. Other steps read each coordinate apart and run shard by shard."""
        return self.name in WHOLE_UPDATES and not self.clips_on_client

    @property
    def spends_privacy(self) -> bool:
        """Each round spends a differential-privacy budget (``lifl.strategy.privacy``)."""
        return self.name in PRIVATE

    @property
    def max_staleness(self) -> int:
        """fedbuff: updates whose base is older than this many versions are refused; 0 otherwise."""
        return int(self.param("max_staleness")) if self.name == "fedbuff" else 0
