"""Aggregation strategies through a real node: job creation names one, the top's step runs it on
the round's objects in shared memory, its state survives a kill -9 of the whole node, and the
rounds history and status report it. The math itself is checked against independent references
in tests/test_strategy.py; here every round's model must equal what the pure step computes from
the same inputs, which proves the plumbing (inputs, state across rounds, staleness, seeds)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.client import Gateway
from lifl.errors import BadRequest, Conflict, Unprocessable
from lifl.strategy import StepInputs, StrategySpec, Update, state_spec, step
from lifl.strategy.spec import MAX_SHARDED_GRAM_UPDATES
from test_crash import Up

pytestmark = pytest.mark.slow
SHAPE = (64,)


def tensors(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": (rng.standard_normal(SHAPE) * scale).astype(np.float32),
            "b": (rng.standard_normal(4) * scale).astype(np.float32)}


def model(gw: Gateway, job: str) -> tuple[int, dict[str, np.ndarray]]:
    version, blob = gw.model(job)
    return version, {k: np.array(v) for k, v in fmt.views(blob, kernels.validate(blob)).items()}


class Reference:
    """The pure step run on in-memory copies of what the node aggregates, round after round."""

    def __init__(self, status: dict[str, Any], initial: dict[str, np.ndarray]) -> None:
        self.spec = StrategySpec.from_json({k: v for k, v in status["strategy"].items() if k != "privacy"})  # spent so far
        self.models = [initial]
        self.state: dict[str, np.ndarray] | None = None

    def round(self, updates: list[tuple[str, dict[str, np.ndarray], int, int]], seed: int = 0) -> dict[str, np.ndarray]:
        """``updates``: (client, tensors, samples, base version)."""
        version = len(self.models) - 1
        current = self.models[version]
        total = sum(samples for _, _, samples, _ in updates)
        average = {k: sum(t[k].astype(np.float64) * s for _, t, s, _ in updates) / total for k in current}
        out = {k: np.empty_like(v) for k, v in current.items()}
        layout = state_spec(self.spec, [(k, v.dtype, v.shape) for k, v in current.items()])
        state_out = {name: np.empty(shape, dtype) for name, dtype, shape in layout} or None
        inputs = StepInputs(current=current, version=version, average=average, state=self.state, seed=seed,
                            updates=[Update(t, s, version - base, self.models[base], c) for c, t, s, base in sorted(
                                updates, key=lambda u: u[0])] if self.spec.needs_updates else ())
        step(self.spec, inputs, out, state_out)
        self.models.append(out)
        self.state = state_out
        return out


def push_all(gw: Gateway, job: str, updates: list[tuple[str, dict[str, np.ndarray], int, int]]) -> None:
    for client, t, samples, base in updates:
        gw.push(job, fmt.encode(t), client=client, samples=samples, base_version=base)


def run_rounds(gw: Gateway, job: str, ref: Reference, rounds: int, rng: np.random.Generator, goal: int,
               first_version: int = 0, seed: int = 0) -> None:
    for r in range(first_version, first_version + rounds):
        updates = [(f"c{i}", tensors(rng), int(rng.integers(1, 50)), r) for i in range(goal)]
        push_all(gw, job, updates)
        wait_for(lambda: gw.job(job)["version"] == r + 1, what=f"version {r + 1}")
        expected = ref.round(updates, seed)
        version, got = model(gw, job)
        assert version == r + 1
        for k in expected:  # the same float64 math on the same inputs: equal to the last bit or nearly
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7, err_msg=f"{job} round {r} {k}")


@pytest.mark.parametrize("strategy", [
    {"name": "fedavgm", "server_momentum": 0.9},
    {"name": "fedadam"},
    {"name": "fedyogi"},
    {"name": "fedadagrad"},
    {"name": "median"},
    {"name": "trimmed_mean", "beta": 0.2},
    {"name": "krum", "num_malicious": 1},
    {"name": "multi_krum", "num_malicious": 1, "num_selected": 3},
])
def test_each_strategy_matches_its_pure_step_round_after_round(node: RunningNode, strategy: dict[str, Any]) -> None:
    gw = Gateway(node.http)
    rng = np.random.default_rng(7)
    initial = tensors(rng)
    status = gw.create_job("s", 5, strategy=strategy)
    assert status["strategy"]["name"] == strategy["name"] and set(strategy) <= set(status["strategy"])
    gw.set_model("s", fmt.encode(initial))
    run_rounds(gw, "s", Reference(status, initial), 3, rng, goal=5)
    history = gw.rounds("s")
    assert [r["strategy"]["name"] for r in history] == [strategy["name"]] * 3
    if strategy["name"] in ("krum", "multi_krum"):
        assert all(len(r["strategy"]["selected"]) == (1 if strategy["name"] == "krum" else 3) for r in history), history


@pytest.mark.parametrize("strategy", [
    {"name": "fedavgm", "server_momentum": 0.9},
    {"name": "fedadam"},
    {"name": "median"},
    {"name": "trimmed_mean", "beta": 0.2},
    {"name": "krum", "num_malicious": 1},
    {"name": "multi_krum", "num_malicious": 1, "num_selected": 3},
    {"name": "dp_fedavg", "clipping_norm": 5.0, "noise_multiplier": 0.5, "population": 100},
])
def test_every_strategy_steps_shard_by_shard_like_the_whole_model(node: RunningNode, strategy: dict[str, Any]) -> None:
    """Each shard's top steps its pieces of the mean, the updates, the current model and the
    state, into its slices of the next model and state; Krum's and dp's tops send their
    shard's distances or norms and the one that completes them steps every shard: the pure
    step of the whole model, dp's noise included (drawn from the job's secret seed)."""
    gw = Gateway(node.http)
    rng = np.random.default_rng(9)
    initial = tensors(rng)
    status = gw.create_job("sh", 5, strategy=strategy, shards=3)
    gw.set_model("sh", fmt.encode(initial))
    run_rounds(gw, "sh", Reference(status, initial), 3, rng, goal=5, seed=node.state.strategy_seed("sh"))
    reports = [r["strategy"] for r in gw.rounds("sh")]
    assert len(reports) == 3
    if strategy["name"] in ("krum", "multi_krum"):
        assert all(len(r["selected"]) == (1 if strategy["name"] == "krum" else 3) for r in reports), reports
    if strategy["name"] == "dp_fedavg":
        assert all(r["clipped"] >= 1 and r["epsilon"] > 0 for r in reports), reports


@pytest.mark.parametrize("name", ["krum", "multi_krum"])
def test_distances_between_too_many_updates_refuse_shards(node: RunningNode, name: str) -> None:
    gw = Gateway(node.http)
    assert gw.create_job("fits", MAX_SHARDED_GRAM_UPDATES, strategy={"name": name}, shards=2)["shards"] == 2
    with pytest.raises(BadRequest, match=f"at most {MAX_SHARDED_GRAM_UPDATES} updates a round; the goal is "
                                         f"{MAX_SHARDED_GRAM_UPDATES + 1}"):
        gw.create_job("past", MAX_SHARDED_GRAM_UPDATES + 1, strategy={"name": name}, shards=2)


def test_median_ignores_an_outlier_that_fedavg_follows(node: RunningNode) -> None:
    gw = Gateway(node.http)
    for name in ("median", "fedavg"):
        gw.create_job(name, 5, strategy={"name": name})
        gw.set_model(name, fmt.encode({"w": np.zeros(8, np.float32)}))
        for i, value in enumerate([1.0, 1.1, 0.9, 1.0, 1e6]):
            gw.push(name, fmt.encode({"w": np.full(8, value, np.float32)}), client=f"c{i}", samples=1, base_version=0)
        wait_for(lambda: gw.job(name)["version"] == 1, what=f"{name} version 1")
    assert model(gw, "median")[1]["w"] == pytest.approx(np.full(8, 1.0))
    assert model(gw, "fedavg")[1]["w"][0] > 1e5


def test_stateful_strategy_resumes_exactly_after_a_kill(shm_node: str, run_dir) -> None:
    rng = np.random.default_rng(3)
    initial = tensors(rng)
    up = Up(shm_node, run_dir.parent)
    try:
        gw = Gateway(up.http.removeprefix("http://"))
        status = gw.create_job("j", 3, strategy={"name": "fedadam", "eta": 0.05})
        gw.set_model("j", fmt.encode(initial))
        ref = Reference(status, initial)
        run_rounds(gw, "j", ref, 2, rng, goal=3)
        gw.close()
        up.kill_all()
        up = Up(shm_node, run_dir.parent)
        gw = Gateway(up.http.removeprefix("http://"))
        run_rounds(gw, "j", ref, 2, rng, goal=3, first_version=2)  # its moments were read back from the store
        gw.close()
    finally:
        up.proc.terminate()
        up.proc.wait(30)


def test_dp_fedavg_clips_adds_noise_and_reports_the_privacy_spent(node: RunningNode) -> None:
    gw = Gateway(node.http)
    strategy = {"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 0.5, "population": 100}
    status = gw.create_job("dp", 4, strategy=strategy)
    assert status["strategy"]["privacy"]["epsilon"] == 0  # nothing released yet
    gw.set_model("dp", fmt.encode({"w": np.zeros(4096, np.float32)}))
    for i in range(4):  # each delta has norm 64: clipped to 1
        gw.push("dp", fmt.encode({"w": np.full(4096, 1.0, np.float32)}), client=f"c{i}", samples=1, base_version=0)
    wait_for(lambda: gw.job("dp")["version"] == 1, what="version 1")
    w = model(gw, "dp")[1]["w"]
    # the clipped mean has norm 1 (each coordinate 1/64); the noise std is z*C/n = 0.125 per coordinate
    assert np.mean(w) == pytest.approx(1 / 64, abs=0.01) and np.std(w) == pytest.approx(0.125, rel=0.1)
    last = gw.job("dp")["last_round"]
    report = gw.rounds("dp")[-1]["strategy"]
    assert report["clipped"] == 4 and report["epsilon"] > 0, report
    spent = gw.job("dp")["strategy"]["privacy"]
    assert spent["epsilon"] == pytest.approx(report["epsilon"]) and spent["delta"] == 1e-5, (spent, last)


@pytest.mark.parametrize("shards", [1, 2])
def test_fedbuff_takes_stale_updates_weighted_and_refuses_too_stale_ones(node: RunningNode, shards: int) -> None:
    gw = Gateway(node.http)
    rng = np.random.default_rng(11)
    initial = tensors(rng)
    status = gw.create_job("fb", 3, strategy={"name": "fedbuff", "max_staleness": 1}, shards=shards)
    gw.set_model("fb", fmt.encode(initial))
    ref = Reference(status, initial)
    first = [(f"c{i}", tensors(rng), 10, 0) for i in range(3)]
    push_all(gw, "fb", first)
    wait_for(lambda: gw.job("fb")["version"] == 1, what="version 1")
    ref.round(first)
    mixed = [("c0", tensors(rng), 10, 1), ("late", tensors(rng), 30, 0), ("c2", tensors(rng), 5, 1)]
    push_all(gw, "fb", mixed)  # "late" trained from version 0: one version stale, weighted 1/sqrt(2)
    wait_for(lambda: gw.job("fb")["version"] == 2, what="version 2")
    expected = ref.round(mixed)
    got = model(gw, "fb")[1]
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7)
    assert sorted(gw.rounds("fb")[-1]["strategy"]["staleness"]) == [0, 0, 1]
    with pytest.raises(Conflict) as e:  # two versions stale: past max_staleness
        gw.push("fb", fmt.encode(tensors(rng)), client="later", samples=1, base_version=0)
    assert e.value.code == "version_conflict" and "at most 1 versions stale" in e.value.message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("options, words", [
    ({"strategy": {"name": "fedsgd"}}, "fedsgd"),
    ({"strategy": {"name": "krum", "num_malicious": 3}}, "num_malicious"),
    ({"strategy": {"name": "fedadam", "eta": "fast"}}, "eta"),
    ({"strategy": {"name": "median"}, "fixed_point": {"frac_bits": 16}}, "fixed-point"),
    ({"strategy": "median"}, "strategy"),
])
def test_bad_strategies_are_refused_with_a_clear_error(node: RunningNode, protocol: str, options: dict[str, Any],
                                                       words: str) -> None:
    gw = Gateway(node.grpc if protocol == "grpc" else node.http, protocol=protocol)
    with pytest.raises(BadRequest) as e:
        gw.create_job("bad", 5, **options)
    assert words in e.value.message, e.value.message
    assert gw.jobs() == []


def test_grpc_status_reports_the_strategy(node: RunningNode) -> None:
    gw = Gateway(node.grpc, protocol="grpc")
    status = gw.create_job("g", 4, strategy={"name": "trimmed_mean", "beta": 0.25})
    assert status["strategy"] == {"name": "trimmed_mean", "beta": 0.25}


def test_a_server_optimiser_runs_on_a_fixed_point_mean(node: RunningNode) -> None:
    """fixed_point and an eager strategy combine: the step reads the mean the integer sums give,
    within half a quantisation step of the float one."""
    gw = Gateway(node.http)
    rng = np.random.default_rng(13)
    initial = tensors(rng)
    status = gw.create_job("fpo", 4, strategy={"name": "fedavgm", "server_momentum": 0.5},
                           fixed_point={"frac_bits": 24, "width": 64})
    assert status["fixed_point"] == {"frac_bits": 24, "width": 64}
    gw.set_model("fpo", fmt.encode(initial))
    ref = Reference(status, initial)
    for r in range(2):
        updates = [(f"c{i}", tensors(rng), int(rng.integers(1, 50)), r) for i in range(4)]
        push_all(gw, "fpo", updates)
        wait_for(lambda: gw.job("fpo")["version"] == r + 1, what=f"version {r + 1}")
        expected, got = ref.round(updates), model(gw, "fpo")[1]
        for k in expected:  # momentum 0.5 at most doubles the mean's quantisation error (2^-25)
            np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=2.0 ** -23)


def test_a_bfloat16_model_is_refused_by_a_strategy_that_computes_in_float(node: RunningNode) -> None:
    gw = Gateway(node.http)
    gw.create_job("bf", 3, strategy={"name": "fedadam"})
    bf16 = fmt.encode({"w": np.zeros(8, np.uint16)}, dtypes={"w": "BF16"})
    with pytest.raises(Unprocessable) as e:
        gw.set_model("bf", bf16)
    assert e.value.code == "unsupported_dtype" and "bfloat16" in e.value.message
    assert gw.set_model("bf", fmt.encode({"w": np.zeros(8, np.float32)})) == 0  # nothing was left half-set
