"""A task whose instance dies or fails runs again from its inputs, which stay in shared memory
until the task's result exists: every acknowledged update reaches the next version."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from flaky_handler import FAULTS
from lifl import format as fmt
from lifl.jobs import JobSpec
from lifl.node.agent import Agent
from lifl.node.tasks import MAX_TASK_ATTEMPTS
from lifl.protocol import GetStatus
from lifl.state import ClusterState
from lifl.strategy import StepInputs, StrategySpec, Update, step
from test_agent import SHAPES, aggregator_pids, gateway, metric, push, put_model, random_model, read_model

pytestmark = pytest.mark.slow


def fedavg(updates: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    return {k: sum(u[k].astype(np.float64) * c for u, c in zip(updates, samples)) / sum(samples) for k in SHAPES}


def assert_model(model: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    for k in SHAPES:
        np.testing.assert_allclose(model[k], ref[k], rtol=1e-5, atol=1e-7)


@contextlib.contextmanager
def fault_markers(job: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where the job's instances (tests/flaky_handler.py, importable by them) leave their marks."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    markers = FAULTS / job
    markers.mkdir(parents=True)
    FAULTS.chmod(0o777)
    markers.chmod(0o777)  # instances run as the tenant's uid
    try:
        yield markers
    finally:
        shutil.rmtree(markers)


@pytest.mark.parametrize("fault, shards", [("exit", 1), ("raise", 1), ("exit", 3)])
def test_every_task_broken_once_after_its_first_fold_still_yields_the_exact_fedavg(
        started: Callable[..., Agent], state: ClusterState, monkeypatch: pytest.MonkeyPatch, fault: str, shards: int) -> None:
    job = f"flaky-{uuid.uuid4().hex[:8]}"
    with fault_markers(job, monkeypatch) as markers:
        run_broken_tasks(started(handler=f"flaky_handler:handle_{fault}"), state, job, markers, shards)


def test_tops_killed_after_sending_their_shards_distances_still_install_the_whole_models_krum(
        started: Callable[..., Agent], state: ClusterState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A top that sent its partials and died runs again and sends them again: one that was told
    to step every shard is told again (and steps), the others install; the model is the step
    of the whole model."""
    job = f"krum-{uuid.uuid4().hex[:8]}"
    with fault_markers(job, monkeypatch) as markers:
        agent = started(handler="flaky_handler:handle_exit_after_partials")
        strategy = StrategySpec.from_request({"name": "multi_krum", "num_malicious": 1, "num_selected": 3}, goal=6)
        state.create_job(JobSpec(job, goal=6, leaf_fan_in=2, shards=3, strategy=strategy.to_json()))
        rng = np.random.default_rng(12)
        client = gateway(agent)
        initial = random_model(rng)
        put_model(client, job, fmt.encode(initial))
        updates = [random_model(rng) for _ in range(6)]
        samples = [int(s) for s in rng.integers(1, 40, 6)]
        for u, c in zip(updates, samples):
            push(client, job, 0, fmt.encode(u), c)
        wait_for(lambda: state.version(job) == 1, timeout=120, what="version 1 despite every top killed once")
        expected = {k: np.empty_like(v) for k, v in initial.items()}
        step(strategy, StepInputs(initial, 0, None, [Update(u, c) for u, c in zip(updates, samples)]), expected, None)
        assert_model(read_model(client, job)[1], expected)
        assert len(list(markers.iterdir())) == 3  # every shard's top died once
        assert len(state.job(job).last_round["strategy"]["selected"]) == 3


def test_step_partials_from_the_wrong_task_or_of_the_wrong_size_are_refused_and_the_round_goes_on(
        started: Callable[..., Agent], state: ClusterState, monkeypatch: pytest.MonkeyPatch) -> None:
    job = f"bad-{uuid.uuid4().hex[:8]}"
    with fault_markers(job, monkeypatch) as markers:
        agent = started(handler="flaky_handler:handle_bad_partials")
        state.create_job(JobSpec(job, goal=4, leaf_fan_in=2, shards=2,
                                 strategy=StrategySpec.from_request({"name": "krum"}, goal=4).to_json()))
        rng = np.random.default_rng(13)
        client = gateway(agent)
        put_model(client, job, fmt.encode(random_model(rng)))
        for _ in range(4):
            push(client, job, 0, fmt.encode(random_model(rng)), 1)
        wait_for(lambda: state.version(job) == 1, timeout=120, what="version 1")
        answers = {tuple(path.name.split("-")): path.read_text() for path in markers.iterdir()}
        assert {role for role, _ in answers} >= {"leaf", "top"}
        for (role, task), answer in answers.items():
            assert answer == ("bad_partials: step partials of 3 bytes are not float64 values" if role == "top" else
                              f"not_sharded: task {task} is not the top of a sharded round of a strategy that reads "
                              "whole updates"), (role, answer)


def run_broken_tasks(agent: Agent, state: ClusterState, job: str, markers: Path, shards: int = 1) -> None:
    state.create_job(JobSpec(job, goal=6, leaf_fan_in=2, shards=shards))
    rng = np.random.default_rng(11)
    client = gateway(agent)
    put_model(client, job, fmt.encode(random_model(rng)))
    updates = [random_model(rng) for _ in range(6)]
    samples = [int(s) for s in rng.integers(1, 40, 6)]
    for u, c in zip(updates, samples):
        push(client, job, 0, fmt.encode(u), c)
    wait_for(lambda: state.version(job) == 1, timeout=120, what="version 1 despite a broken run of every task")
    _, model = read_model(client, job)
    assert_model(model, fedavg(updates, samples))
    summary = state.job(job).last_round
    assert summary["outcome"] == "complete" and summary["updates"] == 6
    broken = len(list(markers.iterdir()))
    assert broken >= 4 * shards  # each shard's three leaves and middle fold at least twice; a top may hold its lone input
    assert metric(client, "lifl_task_reruns_total") == broken
    wait_for(lambda: client.call(GetStatus())[0].status.shm.objects == 1, what="only the model is left")


def test_a_leaf_killed_while_it_waits_for_input_runs_again_with_the_updates_it_had(
        started: Callable[..., Agent], state: ClusterState) -> None:
    agent = started()
    state.create_job(JobSpec("j", goal=3, leaf_fan_in=3))
    rng = np.random.default_rng(5)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    updates = [random_model(rng) for _ in range(3)]
    push(client, "j", 0, fmt.encode(updates[0]), 2)
    push(client, "j", 0, fmt.encode(updates[1]), 3)
    wait_for(lambda: client.call(GetStatus())[0].status.jobs["j"].queued == 0, what="the leaf folded both updates")
    for pid in aggregator_pids():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: metric(client, "lifl_task_reruns_total") >= 1, what="the leaf runs again")
    push(client, "j", 0, fmt.encode(updates[2]), 5)
    wait_for(lambda: state.version("j") == 1, what="version 1")
    _, model = read_model(client, "j")
    assert_model(model, fedavg(updates, [2, 3, 5]))
    assert state.job("j").last_round["updates"] == 3


def test_a_task_that_keeps_failing_abandons_its_round_after_the_last_attempt(
        started: Callable[..., Agent], state: ClusterState) -> None:
    agent = started()
    state.create_job(JobSpec("j", goal=3, leaf_fan_in=3))
    rng = np.random.default_rng(7)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    push(client, "j", 0, fmt.encode(random_model(rng)), 1)
    for attempt in range(1, MAX_TASK_ATTEMPTS + 1):
        # an instance killed before it was given the task is no failed attempt: wait for the start
        wait_for(lambda: metric(client, "lifl_aggregator_starts_total") >= attempt, what=f"run {attempt} of the leaf")
        busy = wait_for(aggregator_pids, what=f"the instance of run {attempt}")
        for pid in busy:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pid not in aggregator_pids(), what="the killed instance reaped")
        if attempt < MAX_TASK_ATTEMPTS:
            wait_for(lambda: metric(client, "lifl_task_reruns_total") >= attempt, what=f"re-run {attempt}")
    wait_for(lambda: state.job("j").round == 1, what="round abandoned")
    job = state.job("j")
    assert (job.reserved, job.accepted, job.version) == (0, 0, 0)
    assert job.last_round["outcome"] == "abandoned" and f"failed {MAX_TASK_ATTEMPTS} times" in job.last_round["reason"]
    wait_for(lambda: client.call(GetStatus())[0].status.shm.objects == 1, what="the update released")
