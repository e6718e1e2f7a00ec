"""lifl.strategy: job strategy specs, and every step against an independent numpy reference
(stacking the updates, which is fine at these sizes). Flower's own functions: test_strategy_flower.py."""

from __future__ import annotations

import math
import tracemalloc
from dataclasses import replace
from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from lifl import format as fmt
from lifl.errors import BadRequest
from lifl.fedavg import StreamingFedAvg
from lifl.shards import ELEMENT, TENSOR, plan
from lifl.strategy import NAMES, StepInputs, StrategySpec, Update, partials, privacy, state_spec, step
from lifl.strategy.step import BLOCK
from test_fedavg import Memory

Tensors = dict[str, np.ndarray]
REQUIRED = {"dp_fedavg": {"clipping_norm": 1.0, "noise_multiplier": 1.0}}


def spec(name: str, goal: int = 10, **params: Any) -> StrategySpec:
    return StrategySpec.from_request({"name": name, **REQUIRED.get(name, {}), **params}, goal=goal)


# -- specs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_name_fills_in_its_defaults_and_round_trips(name: str) -> None:
    s = spec(name)
    assert s.name == name and [k for k, _ in s.params] == sorted(k for k, _ in s.params)
    assert StrategySpec.from_json(s.to_json()) == s
    assert s.eager != s.needs_updates


@pytest.mark.parametrize("obj, expected", [
    (None, {"name": "fedavg"}),
    ({}, {"name": "fedavg"}),
    ({"name": "fedavgm"}, {"name": "fedavgm", "server_learning_rate": 1.0, "server_momentum": 0.0}),
    ({"name": "fedadam", "eta": 1}, {"name": "fedadam", "eta": 1.0, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9}),
    ({"name": "fedyogi"}, {"name": "fedyogi", "eta": 1e-2, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    ({"name": "fedadagrad"}, {"name": "fedadagrad", "eta": 1e-1, "tau": 1e-9}),
    ({"name": "trimmed_mean"}, {"name": "trimmed_mean", "beta": 0.2}),
    ({"name": "krum"}, {"name": "krum", "num_malicious": 0}),
    ({"name": "multi_krum", "num_malicious": 2}, {"name": "multi_krum", "num_malicious": 2, "num_selected": 8}),
    ({"name": "dp_fedavg", "clipping_norm": 2, "noise_multiplier": 0.5, "population": 40},
     {"name": "dp_fedavg", "clipping_norm": 2.0, "noise_multiplier": 0.5, "delta": 1e-5, "population": 40,
      "sampling_rate": 0.25, "weighted": False, "clip_on": "server"}),
    ({"name": "fedbuff"}, {"name": "fedbuff", "max_staleness": 10, "staleness_exponent": 0.5, "server_learning_rate": 1.0}),
])
def test_from_request_fills_in_flowers_defaults(obj: Any, expected: dict[str, Any]) -> None:
    assert StrategySpec.from_request(obj, goal=10).to_json() == expected


@pytest.mark.parametrize("obj, goal, message", [
    ("fedavg", 10, "must be an object"),
    ({"eta": 0.1}, 10, "needs a name"),
    ({"name": "fedprox"}, 10, "unknown strategy 'fedprox'"),
    ({"name": 3}, 10, "unknown strategy 3"),
    ({"name": "fedavg", "eta": 0.1}, 10, "eta for fedavg; it takes no parameters"),
    ({"name": "fedadam", "lr": 0.1}, 10, "unknown strategy parameter(s) lr for fedadam"),
    ({"name": "fedadam", "eta": "0.1"}, 10, "eta must be a finite number"),
    ({"name": "fedadam", "eta": True}, 10, "eta must be a finite number"),
    ({"name": "fedadam", "eta": math.nan}, 10, "eta must be a finite number"),
    ({"name": "fedadam", "eta": math.inf}, 10, "eta must be a finite number"),
    ({"name": "fedadam", "eta": 0}, 10, "eta must be in (0, inf)"),
    ({"name": "fedadam", "beta_1": 1.0}, 10, "beta_1 must be in [0, 1)"),
    ({"name": "fedyogi", "tau": -1e-3}, 10, "tau must be in (0, inf)"),
    ({"name": "fedavgm", "server_momentum": -0.1}, 10, "server_momentum must be in [0, 1)"),
    ({"name": "trimmed_mean", "beta": 0.5}, 10, "beta must be in [0, 0.5)"),
    ({"name": "krum", "num_malicious": 1.0}, 10, "num_malicious must be an integer"),
    ({"name": "krum", "num_malicious": False}, 10, "num_malicious must be an integer"),
    ({"name": "krum", "num_malicious": -1}, 10, "num_malicious must be in 0.."),
    ({"name": "krum", "num_malicious": 4}, 10, "needs more than 10 updates per round; the goal is 10"),
    ({"name": "krum"}, 2, "needs more than 2 updates per round"),
    ({"name": "multi_krum", "num_selected": 11}, 10, "num_selected=11 exceeds the goal of 10"),
    ({"name": "multi_krum", "num_selected": 0}, 10, "num_selected must be in 1.."),
    ({"name": "dp_fedavg", "noise_multiplier": 1.0}, 10, "needs the parameter clipping_norm"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0}, 10, "needs the parameter noise_multiplier"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 0}, 10, "noise_multiplier must be in (0, inf)"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 1, "delta": 1}, 10, "delta must be in (0, 1)"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 1, "population": 9}, 10, "population=9 is smaller"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 1, "weighted": 1}, 10, "weighted must be true or false"),
    ({"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 1, "sampling_rate": 0.1}, 10, "sampling_rate"),
    ({"name": "fedbuff", "max_staleness": 1000}, 10, "max_staleness must be in 0..100"),
    ({"name": "fedbuff", "staleness_exponent": -0.5}, 10, "staleness_exponent must be in [0, 10]"),
    ({"name": "fedavg"}, 0, "goal of at least one"),
])
def test_from_request_refuses_bad_strategies(obj: Any, goal: int, message: str) -> None:
    with pytest.raises(BadRequest) as e:
        StrategySpec.from_request(obj, goal=goal)
    assert e.value.code == "bad_strategy" and message in e.value.message


@pytest.mark.parametrize("name, eager, stateful, max_staleness, runs_step, spends_privacy, whole, pairs", [
    ("fedavg", True, False, 0, False, False, False, False), ("fedavgm", True, True, 0, True, False, False, False),
    ("fedadam", True, True, 0, True, False, False, False), ("fedyogi", True, True, 0, True, False, False, False),
    ("fedadagrad", True, True, 0, True, False, False, False),
    ("median", False, False, 0, True, False, False, False), ("trimmed_mean", False, False, 0, True, False, False, False),
    ("krum", False, False, 0, True, False, True, True), ("multi_krum", False, False, 0, True, False, True, True),
    ("dp_fedavg", False, False, 0, True, True, True, False), ("fedbuff", False, False, 10, True, False, False, False),
])
def test_kinds(name: str, eager: bool, stateful: bool, max_staleness: int, runs_step: bool, spends_privacy: bool,
               whole: bool, pairs: bool) -> None:
    s = spec(name)
    assert (s.eager, s.needs_updates, s.stateful, s.max_staleness) == (eager, not eager, stateful, max_staleness)
    assert (s.runs_step, s.spends_privacy, s.reads_whole_updates, s.reads_update_pairs) == (runs_step, spends_privacy, whole, pairs)
    model = [("w", np.dtype(np.float32), (3, 2)), ("steps", np.dtype(np.int64), ())]
    assert bool(state_spec(s, model)) == stateful
    assert all(dtype == np.float64 and shape == (3, 2) for _, dtype, shape in state_spec(s, model))


# -- references ------------------------------------------------------------------------------------


def make_round(seed: int = 0, n: int = 7, dtype: Any = np.float32,
               current: Tensors | None = None) -> tuple[Tensors, list[Update]]:
    """The model (``current`` if given) and ``n`` updates trained from it."""
    rng = np.random.default_rng(seed)
    if current is None:
        shapes = {"conv": (4, 3, 5), "bias": (11,), "big": (BLOCK * 2 + 17,)}  # blocks: several, and a tail
        current = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
        current["steps"] = np.array(100, np.int64)
    updates = []
    for i in range(n):
        tensors = {k: (v + rng.standard_normal(v.shape) * (0.1 + 0.05 * i)).astype(dtype) for k, v in current.items()
                   if k != "steps"}
        tensors["steps"] = np.array(100 + i, np.int64)
        updates.append(Update(read_only(tensors), int(rng.integers(1, 100)), client=f"c{i}"))
    return read_only(current), updates


def read_only(tensors: Tensors) -> Tensors:
    for array in tensors.values():
        array.setflags(write=False)
    return tensors


def floats(tensors: Tensors) -> list[str]:
    return [k for k, v in tensors.items() if v.dtype.kind == "f"]


def stack(updates: list[Update], name: str) -> np.ndarray:
    return np.stack([u.tensors[name].astype(np.float64) for u in updates])


def weighted_average(updates: list[Update], current: Tensors) -> Tensors:
    samples = np.array([u.samples for u in updates], np.float64)
    return {k: np.tensordot(samples, stack(updates, k), axes=1) / samples.sum() for k in current}


def run(s: StrategySpec, current: Tensors, updates: list[Update], *, version: int = 0, state: Tensors | None = None,
        seed: int = 0, average: Tensors | None = None) -> tuple[Tensors, Tensors | None, dict[str, Any]]:
    out = {k: np.empty_like(v) for k, v in current.items()}
    layout = state_spec(s, [(k, v.dtype, v.shape) for k, v in current.items()])
    state_out = {name: np.empty(shape, dtype) for name, dtype, shape in layout} or None
    if average is None and s.eager:
        average = weighted_average(updates, current)
    report = step(s, StepInputs(current, version, average, updates if s.needs_updates else (), state, seed,
                                count=len(updates)), out, state_out)
    return out, state_out, report


def assert_close(got: Tensors, expected: Tensors, names: list[str], rtol: float = 1e-6, atol: float = 1e-6) -> None:
    for k in names:
        assert got[k].dtype == np.float32 or got[k].dtype == np.float64
        np.testing.assert_allclose(got[k], expected[k], rtol=rtol, atol=atol, err_msg=k)


def fedopt_reference(name: str, p: dict[str, Any], x: Tensors, delta: Tensors, m: Tensors, v: Tensors,
                     server_round: int) -> Tensors:
    """Flower 1.41's FedAvgM/FedAdam/FedYogi/FedAdagrad aggregate_fit, on float64 copies; m, v updated in place."""
    new = {}
    for k in delta:
        d = delta[k]
        if name == "fedavgm":
            m[k] = p["server_momentum"] * m[k] + d if server_round > 1 else d
            new[k] = x[k] + p["server_learning_rate"] * m[k]
            continue
        beta_1 = 0.0 if name == "fedadagrad" else p["beta_1"]
        m[k] = beta_1 * m[k] + (1 - beta_1) * d
        if name == "fedadam":
            v[k] = p["beta_2"] * v[k] + (1 - p["beta_2"]) * d * d
            eta = p["eta"] * np.sqrt(1 - p["beta_2"] ** (server_round + 1.0)) / (1 - p["beta_1"] ** (server_round + 1.0))
        elif name == "fedyogi":
            v[k] = v[k] - (1 - p["beta_2"]) * d * d * np.sign(v[k] - d * d)
            eta = p["eta"]
        else:
            v[k] = v[k] + d * d
            eta = p["eta"]
        new[k] = x[k] + eta * m[k] / (np.sqrt(v[k]) + p["tau"])
    return new


@pytest.mark.parametrize("name, params", [
    ("fedavg", {}), ("fedavgm", {}), ("fedavgm", {"server_momentum": 0.9, "server_learning_rate": 0.7}),
    ("fedadam", {}), ("fedadam", {"eta": 0.01, "beta_1": 0.5, "tau": 1e-3}), ("fedyogi", {}), ("fedadagrad", {}),
])
def test_eager_strategies_follow_flowers_formulas_over_rounds(name: str, params: dict[str, Any]) -> None:
    s = spec(name, **params)
    p = dict(s.params)
    current, _ = make_round()
    names = floats(current)
    x = {k: current[k].astype(np.float64) for k in names}
    m = {k: np.zeros_like(x[k]) for k in names}
    v = {k: np.zeros_like(x[k]) for k in names}
    state = None
    for version in range(4):
        _, updates = make_round(seed=version + 1, current=current)
        average = weighted_average(updates, current)
        out, state, report = run(s, current, updates, version=version, state=state, average=average)
        assert report == {}
        if name == "fedavg":
            expected = average
        else:
            delta = {k: average[k] - current[k].astype(np.float64) for k in names}
            expected = fedopt_reference(name, p, {k: current[k].astype(np.float64) for k in names}, delta, m, v, version + 1)
        assert_close(out, expected, names)
        assert out["steps"] == np.rint(average["steps"])
        if s.stateful:
            assert state is not None
            for k in names:
                if "m/" + k in state:
                    np.testing.assert_allclose(state["m/" + k], m[k], rtol=1e-12, atol=1e-15)
                if "v/" + k in state:
                    np.testing.assert_allclose(state["v/" + k], v[k], rtol=1e-12, atol=1e-15)
        current = read_only(out)


def krum_reference(updates: list[Update], names: list[str], f: int, keep: int) -> tuple[list[int], Tensors]:
    flat = np.stack([np.concatenate([u.tensors[k].astype(np.float64).ravel() for k in names]) for u in updates])
    n = len(updates)
    distances = np.array([[np.sum((flat[i] - flat[j]) ** 2) for j in range(n)] for i in range(n)])
    closest = max(1, n - f - 2)
    scores = [np.sort(np.delete(distances[i], i))[:closest].sum() for i in range(n)]
    if keep == 0:
        best = [int(np.argmin(scores))]
        return best, {k: updates[best[0]].tensors[k] for k in names}
    best = [int(i) for i in np.argsort(scores, kind="stable")[:keep]]
    return best, weighted_average([updates[i] for i in best], {k: None for k in names})


def trimmed_reference(updates: list[Update], name: str, beta: float) -> np.ndarray:
    cut = int(beta * len(updates))
    return np.sort(stack(updates, name), axis=0)[cut: len(updates) - cut].mean(axis=0)


@pytest.mark.parametrize("name, params, n", [
    ("median", {}, 7), ("median", {}, 6), ("trimmed_mean", {}, 7), ("trimmed_mean", {"beta": 0.45}, 9),
    ("trimmed_mean", {"beta": 0.0}, 4), ("krum", {}, 7), ("krum", {"num_malicious": 2}, 7),
    ("multi_krum", {"num_malicious": 1}, 7), ("multi_krum", {"num_malicious": 2, "num_selected": 3}, 7),
])
def test_robust_rules_match_the_reference(name: str, params: dict[str, Any], n: int) -> None:
    s = spec(name, goal=n, **params)
    current, updates = make_round(n=n)
    names = floats(current)
    out, state, report = run(s, current, updates)
    assert state is None
    if name == "median":
        expected = {k: np.median(stack(updates, k), axis=0) for k in names}
    elif name == "trimmed_mean":
        expected = {k: trimmed_reference(updates, k, s.param("beta")) for k in names}
    else:
        keep = s.param("num_selected") if name == "multi_krum" else 0
        best, expected = krum_reference(updates, names, s.param("num_malicious"), keep)
        assert report == {"selected": [updates[i].client for i in best]}
    assert_close(out, expected, names)
    if name == "krum":  # the winner's weights themselves
        assert all(np.array_equal(out[k], updates[best[0]].tensors[k]) for k in names)
    assert out["steps"] == updates[0].tensors["steps"]  # no average given: the first update's


def test_krum_rejects_an_outlier() -> None:
    current, updates = make_round(n=7)
    bad = Update({k: (v * 50 if v.dtype.kind == "f" else v) for k, v in updates[3].tensors.items()}, 10, client="evil")
    updates[3] = bad
    _, _, report = run(spec("multi_krum", goal=7, num_malicious=1), current, updates)
    assert "evil" not in report["selected"] and len(report["selected"]) == 6


def test_non_float_tensors_come_from_the_average_when_given() -> None:
    current, updates = make_round()
    average = weighted_average(updates, current)
    average["steps"] = np.array(103.5)  # rounds half to even
    out, _, _ = run(spec("median"), current, updates, average=average)
    assert out["steps"].dtype == np.int64 and out["steps"] == 104


def dp_reference(current: Tensors, updates: list[Update], names: list[str], clip: float, weighted: bool) -> tuple[Tensors, int]:
    deltas = [{k: u.tensors[k].astype(np.float64) - current[k] for k in names} for u in updates]
    norms = [math.sqrt(sum(float(np.sum(d[k] ** 2)) for k in names)) for d in deltas]
    samples = np.array([u.samples for u in updates], np.float64)
    weights = samples / samples.sum() if weighted else np.full(len(updates), 1 / len(updates))
    mean = {k: current[k] + sum(w * min(1.0, clip / norm) * d[k] for w, norm, d in zip(weights, norms, deltas))
            for k in names}
    return mean, sum(norm > clip for norm in norms)


@pytest.mark.parametrize("clip, weighted, clipped", [(50.0, False, 5), (50.0, True, 5), (1e3, False, 0), (1e-3, True, 7)])
def test_dp_clipping_is_exact(clip: float, weighted: bool, clipped: int) -> None:
    """A negligible noise multiplier: what remains is the clipped mean."""
    current, updates = make_round(dtype=np.float64)
    names = floats(current)
    s = spec("dp_fedavg", goal=7, clipping_norm=clip, noise_multiplier=1e-12, weighted=weighted)
    out, _, report = run(s, current, updates)
    expected, over = dp_reference(current, updates, names, clip, weighted)
    assert_close(out, expected, names, rtol=1e-12, atol=1e-9)
    assert report["clipped"] == over == clipped


def test_dp_noise_statistics_and_determinism() -> None:
    size = 100_000
    current = read_only({"w": np.zeros(size, np.float64)})
    updates = [Update(current, 10, client=f"c{i}") for i in range(4)]  # no change: all that moves is noise
    s = spec("dp_fedavg", goal=4, clipping_norm=2.0, noise_multiplier=1.0)
    out, _, report = run(s, current, updates, seed=7, version=3)
    assert report["noise_std"] == pytest.approx(0.5)
    assert np.std(out["w"]) == pytest.approx(0.5, rel=0.02) and abs(np.mean(out["w"])) < 0.01
    again, _, _ = run(s, current, updates, seed=7, version=3)
    assert np.array_equal(out["w"], again["w"])
    for other in ({"seed": 8, "version": 3}, {"seed": 7, "version": 4}):
        assert not np.array_equal(out["w"], run(s, current, updates, **other)[0]["w"])


@pytest.mark.parametrize("clip_on, eager, needs_updates, reads_whole_updates", [
    ("server", False, True, True), ("client", True, False, False)])
def test_where_dp_clips_decides_what_its_step_reads(clip_on: str, eager: bool, needs_updates: bool,
                                                    reads_whole_updates: bool) -> None:
    s = spec("dp_fedavg", goal=4, clip_on=clip_on)
    assert (s.eager, s.needs_updates, s.reads_whole_updates, s.spends_privacy) == (eager, needs_updates, reads_whole_updates,
                                                                                  True)


@pytest.mark.parametrize("weighted", [False, True])
def test_dp_clipping_on_the_clients_adds_the_server_steps_noise_to_the_rounds_mean(weighted: bool) -> None:
    """The clients clipped their changes already (here: none is over the norm): the step adds to the
    round's mean the very noise the server-clipping step draws, N(0, (zC/n)^2), n the round's updates."""
    current, updates = make_round(dtype=np.float64, n=5)
    names = floats(current)
    on_client = spec("dp_fedavg", goal=5, clipping_norm=1e6, noise_multiplier=0.7, clip_on="client", weighted=weighted)
    on_server = spec("dp_fedavg", goal=5, clipping_norm=1e6, noise_multiplier=0.7, weighted=weighted)
    average = weighted_average(updates, current) if weighted else \
        {k: np.mean([u.tensors[k].astype(np.float64) for u in updates], axis=0) for k in current}
    out, _, report = run(on_client, current, updates, seed=3, version=2, average=average)
    assert report == {"clipped_on": "client", "noise_std": pytest.approx(0.7 * 1e6 / 5)}
    reference, _, _ = run(on_server, current, updates, seed=3, version=2)
    assert_close(out, reference, names, rtol=1e-9, atol=1e-6)
    with pytest.raises(ValueError, match="count of updates"):
        step(on_client, StepInputs(current, 2, average, (), None, 3, count=0), {k: np.empty_like(v) for k, v in current.items()},
             None)


def direct_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("goal, population, z, rounds", [(10, 10, 1.0, 1), (10, 100, 1.1, 100), (5, 1000, 0.8, 500)])
def test_privacy_is_the_libraries_rdp_epsilon(goal: int, population: int, z: float, rounds: int) -> None:
    s = spec("dp_fedavg", goal=goal, noise_multiplier=z, population=population)
    assert privacy(s, rounds) == {"epsilon": pytest.approx(direct_epsilon(goal / population, z, rounds, 1e-5), rel=1e-12),
                                  "delta": 1e-5}
    assert privacy(s, 0)["epsilon"] == 0.0
    more_noise = spec("dp_fedavg", goal=goal, noise_multiplier=2 * z, population=population)
    assert privacy(more_noise, rounds)["epsilon"] < privacy(s, rounds)["epsilon"] < privacy(s, rounds + 10)["epsilon"]


def test_dp_reports_what_it_clipped_and_its_noise() -> None:
    current, updates = make_round(n=4)
    s = spec("dp_fedavg", goal=4, population=40)
    report = run(s, current, updates, version=9)[2]
    assert set(report) == {"clipped", "noise_std"} and 0 <= report["clipped"] <= 4
    assert report["noise_std"] == pytest.approx(s.param("noise_multiplier") * s.param("clipping_norm") / 4)


def test_fedbuff_weights_stale_updates_by_their_own_change() -> None:
    rng = np.random.default_rng(3)
    models = [read_only({"w": rng.standard_normal(50).astype(np.float32), "steps": np.array(5)}) for _ in range(4)]
    current = models[-1]
    stale = [0, 1, 3, 2]
    updates = [Update(read_only({"w": (models[3 - st]["w"] + rng.standard_normal(50) * 0.1).astype(np.float32),
                                 "steps": np.array(5)}), int(rng.integers(1, 50)), st, models[3 - st], f"c{i}")
               for i, st in enumerate(stale)]
    s = spec("fedbuff", goal=4, server_learning_rate=0.8, staleness_exponent=0.5)
    out, _, report = run(s, current, updates, version=3)
    a = np.array([u.samples / math.sqrt(1 + u.staleness) for u in updates])
    change = sum(ak * (u.tensors["w"].astype(np.float64) - u.base["w"]) for ak, u in zip(a, updates)) / a.sum()
    np.testing.assert_allclose(out["w"], current["w"] + 0.8 * change, rtol=1e-6, atol=1e-7)
    assert report == {"staleness": stale, "weights": pytest.approx(list(a / a.sum()))}


def test_fedbuff_with_fresh_updates_is_fedavg_to_the_last_bit() -> None:
    current, updates = make_round(n=5)
    fresh = [Update(u.tensors, u.samples, 0, current if i % 2 else None, u.client) for i, u in enumerate(updates)]
    out, _, _ = run(spec("fedbuff", goal=5), current, fresh, average=weighted_average(updates, current))
    blobs = [bytes(fmt.encode(u.tensors)) for u in updates]
    memory = Memory(fmt.parse_layout(blobs[0]).spec())
    fedavg = StreamingFedAvg(len(updates))
    fedavg.offer([memory.contribution(blob, u.samples) for blob, u in zip(blobs, updates)], memory.accumulator)
    expected = memory.average(fedavg.result())
    got = np.concatenate([out[t.name].reshape(-1).astype(np.float64) for t in memory.spec.tensors])
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("change, message", [
    (lambda i: i.__class__(i.current, i.version, None, i.updates), "needs the round's average"),
    (lambda i: i.__class__(i.current, i.version, {"conv": i.current["conv"]}), "the average has tensors"),
    (lambda i: i.__class__(i.current, i.version, i.average, [Update({**i.updates[0].tensors, "bias": np.zeros(3)}, 1)]),
     "shape"),
    (lambda i: i.__class__(i.current, i.version, i.average, [Update(i.updates[0].tensors, -1)]), "samples=-1"),
    (lambda i: i.__class__(i.current, i.version, i.average, [Update(i.updates[0].tensors, 1, 1, i.current)]),
     "staleness 1; strategy median takes 0..0"),
])
def test_inconsistent_inputs_are_refused(change: Any, message: str) -> None:
    current, updates = make_round(n=3)
    inputs = change(StepInputs(current, 0, weighted_average(updates, current), updates))
    s = spec("fedavg" if inputs.updates is updates or not inputs.updates else "median")
    out = {k: np.empty_like(v) for k, v in current.items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        step(s, inputs, out, None)


def test_a_stale_update_needs_its_base_and_a_stateful_step_its_state_out() -> None:
    current, updates = make_round(n=3)
    out = {k: np.empty_like(v) for k, v in current.items()}
    with pytest.raises(ValueError, match="no base model"):
        step(spec("fedbuff", goal=3), StepInputs(current, 2, None, [Update(updates[0].tensors, 1, 1)]), out, None)
    with pytest.raises(ValueError, match="state_out is needed"):
        step(spec("fedadam"), StepInputs(current, 0, weighted_average(updates, current)), out, None)


# -- sharded steps ---------------------------------------------------------------------------------

SHARD_PARAMS: dict[str, dict[str, Any]] = {"dp_fedavg": {"clipping_norm": 60.0, "noise_multiplier": 0.7},  # clips some
                                           "multi_krum": {"num_malicious": 1}, "krum": {"num_malicious": 1}}


def sharded_step(s: StrategySpec, inputs: StepInputs, out: Tensors, state_out: Tensors | None,
                 count: int, alignment: str) -> list[dict[str, Any]]:
    """What the tops of a round cut into ``count`` shards do: each slices every input and steps
    its pieces, with the sum of every shard's partials; their reports."""
    cut = plan(fmt.parse_layout(fmt.encode(inputs.current)).spec(), count, alignment)
    lanes = []
    for shard in cut.shards:
        piece = shard.slices
        lanes.append((shard, StepInputs(
            piece(inputs.current), inputs.version, piece(inputs.average) if inputs.average is not None else None,
            [Update(piece(u.tensors), u.samples, u.staleness, piece(u.base) if u.base is not None else None, u.client)
             for u in inputs.updates],
            piece(inputs.state) if inputs.state is not None else None, inputs.seed, shard.offsets)))
    shares = [partials(s, lane) for _, lane in lanes]
    total = None if shares[0] is None else np.sum(shares, axis=0)
    return [step(s, replace(lane, partials=total), shard.slices(out),
                 shard.slices(state_out) if state_out is not None else None) for shard, lane in lanes]


@pytest.mark.parametrize("count, alignment", [(2, ELEMENT), (5, ELEMENT), (3, TENSOR), (64, ELEMENT)])
@pytest.mark.parametrize("name", NAMES)
def test_a_sharded_step_is_the_unsharded_step(name: str, count: int, alignment: str) -> None:
    """Every strategy cut into shards: each shard's blocks, noise and (summed) norms and
    distances are the whole model's, so the model is the same to the last bit (dp_fedavg's
    clipping scales, from norms summed in another order, to 1e-12)."""
    current, updates = make_round(seed=3)
    s = spec(name, goal=len(updates), **SHARD_PARAMS.get(name, {}))
    if name == "fedbuff":  # one stale update, with the model it trained from
        base = read_only({k: (v + 0.5).astype(v.dtype) for k, v in current.items()})
        updates[2] = Update(updates[2].tensors, updates[2].samples, 1, base, updates[2].client)
    layout = state_spec(s, [(k, v.dtype, v.shape) for k, v in current.items()])
    rng = np.random.default_rng(4)
    state = read_only({k: np.abs(rng.standard_normal(shape)) for k, _, shape in layout}) if layout else None
    inputs = StepInputs(current, 6, weighted_average(updates, current) if s.eager else None,
                        updates if s.needs_updates else (), state, seed=11)
    whole = {k: np.empty_like(v) for k, v in current.items()}
    whole_state = {k: np.empty(shape, dtype) for k, dtype, shape in layout} or None
    report = step(s, inputs, whole, whole_state)
    out = {k: np.full_like(v, 7) for k, v in current.items()}
    state_out = {k: np.full(shape, 7, dtype) for k, dtype, shape in layout} or None
    reports = sharded_step(s, inputs, out, state_out, count, alignment)
    assert all(r == report for r in reports)
    for k in current:
        if name == "dp_fedavg":
            np.testing.assert_allclose(out[k], whole[k], rtol=1e-12, atol=1e-12, err_msg=k)
        else:
            np.testing.assert_array_equal(out[k], whole[k], err_msg=k)
    for k in whole_state or {}:
        np.testing.assert_array_equal(state_out[k], whole_state[k], err_msg=k)
    if name == "dp_fedavg":
        assert 0 < report["clipped"] < len(updates)


@pytest.mark.parametrize("name, partial_shape, message", [
    ("krum", (7,), r"partials of 7 updates have shape \(7, 7\), not \(7,\)"),
    ("dp_fedavg", (7, 7), r"shape \(7,\), not \(7, 7\)"),
    ("median", (7,), "takes no partials"),
])
def test_partials_of_the_wrong_kind_are_refused(name: str, partial_shape: tuple[int, ...], message: str) -> None:
    current, updates = make_round()
    out = {k: np.empty_like(v) for k, v in current.items()}
    with pytest.raises(ValueError, match=message):
        step(spec(name, goal=7), StepInputs(current, 0, None, updates, partials=np.zeros(partial_shape)), out, None)
    with pytest.raises(ValueError, match="offsets are element counts"):
        step(spec(name, goal=7), StepInputs(current, 0, None, updates, offsets={"bias": -1}), out, None)


# -- memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params", [
    ("median", {}), ("trimmed_mean", {}), ("krum", {}), ("multi_krum", {}), ("dp_fedavg", {}), ("fedbuff", {}),
])
def test_rules_keep_scratch_to_blocks_not_updates(name: str, params: dict[str, Any]) -> None:
    n, size = 20, 1 << 20
    rng = np.random.default_rng(0)
    current = read_only({"w": rng.standard_normal(size, np.float32)})
    updates = [Update(read_only({"w": current["w"] + np.float32(0.01 * i)}), 10, client=f"c{i}") for i in range(n)]
    out = {"w": np.empty_like(current["w"])}
    s = spec(name, goal=n, **params)
    tracemalloc.start()
    try:
        step(s, StepInputs(current, 0, None, updates), out, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    block_scratch = n * BLOCK * 8  # one float64 block per update: 5 MB
    assert peak < 3 * block_scratch < n * size * 4 // 5  # an update is 4 MB: all of them, 80 MB
