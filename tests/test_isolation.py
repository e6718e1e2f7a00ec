"""Tenants are namespaces: one tenant's functions cannot open another tenant's objects."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl.node.agent import Agent, AgentConfig
from lifl.jobs import JobSpec
from lifl.state import TENANT_UID_BASE, ClusterState
from lifl.protocol import GetRecent
from test_agent import gateway, push, put_model

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="tenant isolation needs root")]


@pytest.fixture
def probing_agent(run_dir: Path, redis_url: str, shm_node: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Agent]:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    config = AgentConfig(shm_node, run_dir, redis_url, 64 << 20, 16 << 20, max_instances=6, handler="probe_handler:handle")
    agent = Agent(config, ClusterState(redis_url))
    agent.start()
    yield agent
    agent.stop()


def test_tenant_functions_open_only_their_own_objects(probing_agent: Agent, state: ClusterState) -> None:
    model = {"w": np.ones((8, 8), np.float32)}
    client = gateway(probing_agent)
    for job, tenant in (("a", "alpha"), ("b", "beta")):
        state.create_job(JobSpec(job, goal=2, tenant=tenant))
        put_model(client, job, fmt.encode(model))
    push(client, "b", 0, fmt.encode(model), 1)  # beta's update waits in beta's leaf
    push(client, "a", 0, fmt.encode(model), 1)
    push(client, "a", 0, fmt.encode(model), 1)
    wait_for(lambda: state.version("a") == 1, what="alpha's round")
    alpha_leaf = wait_for(lambda: next((t for t in client.call(GetRecent())[0].tasks
                                        if t.job == "a" and t.role == "leaf"), None),
                          what="the report of alpha's leaf")  # it may come after the round is over
    assert alpha_leaf.stats["uid"] == state.tenant_id("alpha") >= TENANT_UID_BASE
    probe = alpha_leaf.stats["probe"]
    beta = {name: result for name, result in probe.items() if name.startswith(f"lifl-{probing_agent.config.node}-beta-")}
    alpha_sealed = [name for name, result in probe.items() if "-alpha-" in name and result == "opened"]
    assert len(beta) >= 2 and set(beta.values()) == {"denied"}  # beta's model and update
    assert len(alpha_sealed) >= 2, probe  # its own model and (at least) the update that started it
