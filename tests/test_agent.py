"""The node agent with real aggregator processes, driven through its typed protocol as the gateway
drives it (admit, submit, open the model) and observed through what it reports (status,
metrics, finished tasks)."""

from __future__ import annotations

import mmap
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl import procstat
from lifl.control.controller import ControlConfig
from lifl.errors import Conflict, NotFound, Overloaded
from lifl.jobs import JobSpec
from lifl.node.agent import Agent
from lifl.protocol import (
    Abort, Admit, AdmitModel, GetMetrics, GetRecent, GetStatus, Hello, InstallModel, OpenModel, Release, Submit, TaskReport,
)
from lifl.rpc import Client
from lifl.state import ClusterState

SHAPES = {"a": (64, 33), "b": (7,), "c": (3, 3, 5)}


@pytest.fixture
def agent(started: Callable[..., Agent]) -> Agent:
    return started()


def gateway(agent: Agent) -> Client:
    return Client.connect(str(agent.config.socket_path), Hello("gateway"))


def write(fd: int, blob: bytes) -> None:
    mm = mmap.mmap(fd, len(blob))
    mm[:] = blob
    mm.close()
    os.close(fd)


def put_model(client: Client, job: str, blob: bytes) -> None:
    reply, fds = client.call(AdmitModel(job, len(blob)))
    write(fds[0], blob)
    client.call(InstallModel(reply.key))


def push(client: Client, job: str, version: int, blob: bytes, samples: int) -> bytes:
    reply, fds = client.call(Admit(job, version, len(blob)))
    write(fds[0], blob)
    client.call(Submit(reply.key, samples))
    return reply.key


def read_model(client: Client, job: str) -> tuple[int, dict[str, np.ndarray]]:
    reply, fds = client.call(OpenModel(job))
    data = os.pread(fds[0], reply.size, 0)
    os.close(fds[0])
    client.call(Release(reply.key))
    return reply.version, fmt.views(data, fmt.parse_layout(data))


def random_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def shm_objects(client: Client) -> int:
    return client.call(GetStatus())[0].status.shm.objects


def metric(client: Client, line_start: str) -> float:
    text = client.call(GetMetrics())[0].text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def finished_tasks(client: Client, expected: Counter[tuple[int, str]]) -> list[TaskReport]:
    """The statistics of the agent's finished tasks, once those of ``expected`` (round, role) are
    among them: an instance reports a task finished after handing its result on, so the round
    may be over (its model installed) before the report arrives (it is kept all the same)."""
    seen: list[TaskReport] = []

    def finished() -> list[dict[str, Any]] | None:
        seen[:] = client.call(GetRecent())[0].tasks
        return list(seen) if not expected - Counter((t.round, t.role) for t in seen) else None

    try:
        return wait_for(finished, what=f"the reports of {dict(expected)}")
    except AssertionError as e:
        raise AssertionError(f"{e}; reported: {[(t['round'], t['role'], t['instance']) for t in seen]}") from None


def aggregator_pids() -> list[int]:
    """The aggregator processes of agents running in this (test) process."""
    pids = []
    for p in procstat.children(os.getpid()):
        try:
            if b"lifl.runtime" in Path(f"/proc/{p}/cmdline").read_bytes():
                pids.append(p)
        except OSError:  # it exited since it was listed (an instance stopping)
            pass
    return pids


@pytest.mark.parametrize("goal,fan_in", [(1, 2), (5, 2), (6, 3)])
def test_rounds_aggregate_into_new_versions(agent: Agent, state: ClusterState, goal: int, fan_in: int) -> None:
    state.create_job(JobSpec("j", goal=goal, leaf_fan_in=fan_in))
    rng = np.random.default_rng(goal)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    for version in range(2):
        updates = [random_model(rng) for _ in range(goal)]
        samples = [int(s) for s in rng.integers(1, 50, goal)]
        for u, c in zip(updates, samples):
            push(client, "j", version, fmt.encode(u), c)
        wait_for(lambda: state.version("j") == version + 1, what=f"version {version + 1}")
        got_version, model = read_model(client, "j")
        assert got_version == version + 1
        for name in SHAPES:
            ref = sum(u[name].astype(np.float64) * c for u, c in zip(updates, samples)) / sum(samples)
            assert np.all(np.abs(model[name] - ref) <= 1e-5 * (np.abs(ref) + 1e-3))
    summary = state.job("j").last_round
    assert summary["updates"] == goal and summary["outcome"] == "complete" and summary["nodes"] == {agent.node: goal}
    # every folded update counts as aggregated once (a lone update is installed, not folded)
    assert client.call(GetStatus())[0].status.counters["j"].aggregated == (2 * goal if goal > 1 else 0)
    # every update and partial was recycled or freed: only the current model is held
    wait_for(lambda: shm_objects(client) == 1, what="objects released")
    assert client.call(GetStatus())[0].status.shm.recycled > 0  # buffers were reused, not created anew


def test_admission_checks_version_round_and_budget(agent: Agent, state: ClusterState) -> None:
    state.create_job(JobSpec("j", goal=2, max_inflight=1))
    client = gateway(agent)
    with pytest.raises(Conflict, match="no model"):
        client.call(Admit("j", 0, 100))
    blob = fmt.encode(random_model(np.random.default_rng(0)))
    put_model(client, "j", blob)
    with pytest.raises(Conflict, match="already has a model"):
        client.call(AdmitModel("j", 100))
    with pytest.raises(Conflict) as info:
        client.call(Admit("j", 3, len(blob)))
    assert info.value.code == "version_conflict" and info.value.extra["version"] == 0
    reply, fds = client.call(Admit("j", 0, len(blob)))
    assert state.job("j").reserved == 1 and state.shard("j").inflight == {agent.node: 1}  # admitted: counted
    with pytest.raises(Overloaded):  # budget of one update in flight
        client.call(Admit("j", 0, len(blob)))
    os.close(fds[0])
    client.call(Abort(reply.key, "test"))
    job = state.job("j")
    assert job.reserved == 0 and job.rejected == {"test": 1}
    assert state.shard("j").inflight == {agent.node: 0}  # aborted: the node's count is back to nothing


def test_malformed_messages_are_refused_with_the_field_named(agent: Agent) -> None:
    client = gateway(agent)
    for frame, needle in (({"op": "admit", "job": "j", "version": "zero", "size": 1}, "admit.version must be int"),
                          ({"op": "admit", "job": "j", "size": 1}, "lacks field 'version'"),
                          ({"op": "submit", "key": "not hex", "samples": 1}, "submit.key must be hex"),
                          ({"op": "nonsense"}, "unknown message 'nonsense'"),
                          ({"op": "alloc", "task": 1, "size": 1}, "alloc is not served to a gateway")):
        client.conn.send({"id": 99, **frame})
        reply, _ = client.conn.recv()
        assert not reply["ok"] and needle in reply["error"]["message"], (frame, reply)
    assert shm_objects(client) == 0


def test_gateway_disconnect_releases_its_uploads(agent: Agent, state: ClusterState) -> None:
    state.create_job(JobSpec("j", goal=4))
    blob = fmt.encode(random_model(np.random.default_rng(0)))
    client = gateway(agent)
    put_model(client, "j", blob)
    other = gateway(agent)
    _, fds = other.call(Admit("j", 0, len(blob)))
    os.close(fds[0])
    assert state.job("j").reserved == 1 and shm_objects(client) == 2
    other.close()
    # the slot comes back first, then the refusal is counted: wait for both
    wait_for(lambda: state.job("j").reserved == 0 and state.job("j").rejected == {"connection_lost": 1},
             what="reservation released and counted")
    assert shm_objects(client) == 1


def test_warm_instances_are_reused_across_roles_and_expire(started: Callable[..., Agent], redis_url: str) -> None:
    agent = started(max_instances=4, keep_warm=1.0)
    state = ClusterState(redis_url)
    state.create_job(JobSpec("j", goal=2))
    rng = np.random.default_rng(1)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    for version in range(3):
        for _ in range(2):
            push(client, "j", version, fmt.encode(random_model(rng)), 1)
        wait_for(lambda: state.version("j") == version + 1, what="next version")
    assert metric(client, 'lifl_aggregator_starts_total{kind="warm"}') > 0
    tasks = finished_tasks(client, Counter({(r, role): 1 for r in range(3) for role in ("leaf", "middle", "top")}))
    by_instance: dict[int, set[str]] = {}
    for t in tasks:
        by_instance.setdefault(t.instance, set()).add(t.role)
    assert any(len(roles) > 1 for roles in by_instance.values())  # one instance served several roles
    wait_for(lambda: not aggregator_pids(), what="idle instances to stop")
    with pytest.raises(NotFound):
        client.call(Release(b"\0" * 16))


def test_lazy_baseline_without_reuse_folds_once_per_task_on_fresh_instances(started: Callable[..., Agent], redis_url: str) -> None:
    agent = started(max_instances=8, reuse=False, lazy=True)
    state = ClusterState(redis_url)
    state.create_job(JobSpec("j", goal=5, leaf_fan_in=2))
    rng = np.random.default_rng(2)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    updates = [(random_model(rng), int(rng.integers(1, 9))) for _ in range(5)]
    for u, c in updates:
        push(client, "j", 0, fmt.encode(u), c)
    wait_for(lambda: state.version("j") == 1, what="version 1")
    _, model = read_model(client, "j")
    ref = sum(u["a"].astype(np.float64) * c for u, c in updates) / sum(c for _, c in updates)
    np.testing.assert_allclose(model["a"], ref, rtol=1e-5, atol=1e-8)
    tasks = finished_tasks(client, Counter({(0, "leaf"): 3, (0, "middle"): 1, (0, "top"): 1}))
    assert len({t.instance for t in tasks}) == len(tasks)  # no instance served twice
    assert all(t.stats["folds"] == (1 if t.stats["inputs"] > 1 else 0) for t in tasks)  # everything at once, at the end
    # the five tasks (the top too) each started on an instance created for it
    assert metric(client, 'lifl_aggregator_starts_total{kind="cold"}') == 5
    assert metric(client, 'lifl_aggregator_starts_total{kind="warm"}') == 0
    assert metric(client, 'lifl_aggregator_instances_created_total{reason="cold_start"}') == 5


def test_the_planned_hierarchy_is_warmed_before_its_updates_arrive(started: Callable[..., Agent], redis_url: str) -> None:
    agent = started(max_instances=8, control=ControlConfig(period=0.2))
    state = ClusterState(redis_url)
    state.create_job(JobSpec("j", goal=6, leaf_fan_in=2))
    rng = np.random.default_rng(3)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    for i in range(6):  # six clients are assigned to this node: ceil(6 / 2) leaves, the middle and top reuse them
        assert state.assign("j", 0, f"c{i}", [agent.node]) == agent.node
    wait_for(lambda: client.call(GetStatus())[0].status.instances.ready == 3, what="the planned instances warm")
    assert client.call(GetStatus())[0].status.instances.total == 3
    assert metric(client, 'lifl_aggregator_instances_created_total{reason="prewarm"}') == 3
    # A leaf's worth of updates at a time, each leaf done before the next one's arrive: whatever
    # the machine's speed, an instance of the plan is idle whenever a task needs one. (With all six
    # at once, a middle dispatched while its producer's instance is still busy takes an idle
    # planned instance, and a later leaf may find none: a cold start that depends on timing.)
    for leaves in range(3):
        for _ in range(2):
            push(client, "j", 0, fmt.encode(random_model(rng)), 1)
        if leaves < 2:  # (the last leaf's report may come after the round is over)
            finished_tasks(client, Counter({(0, "leaf"): leaves + 1}))
    wait_for(lambda: state.version("j") == 1, what="version 1")
    # every task (three leaves, the middle and the top) found a warm instance, and no instance
    # was created beyond the three planned
    assert metric(client, 'lifl_aggregator_starts_total{kind="warm"}') == 5
    assert metric(client, 'lifl_aggregator_starts_total{kind="cold"}') == 0
    assert metric(client, 'lifl_aggregator_instances_created_total') == 3
    assert client.call(GetStatus())[0].status.instances.total == 3
