"""A full checkpoint file system: the round's model stays unseen until its checkpoint is
durable, the error shows in status, logs and metrics, and the job resumes by itself once
space returns (and from that checkpoint after a restart)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import fill, wait_for
from lifl import format as fmt
from lifl.errors import Unavailable
from lifl.jobs import JobSpec
from lifl.node.agent import Agent
from lifl.protocol import AdmitModel, InstallModel
from lifl.state import ClusterState
from test_agent import SHAPES, gateway, metric, push, put_model, random_model, read_model, write

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small file system needs root")]
DISK = 2 << 20  # the checkpoint file system: room for a few models of SHAPES (about 9 KB each)


@pytest.fixture
def disk(small_disk: Callable[[int], Path]) -> Path:
    return small_disk(DISK)


def test_a_version_appears_only_once_durable_and_the_job_resumes_when_space_returns(
        started: Callable[..., Agent], state: ClusterState, disk: Path) -> None:
    agent = started(data_dir=disk)
    state.create_job(JobSpec("j", goal=2, leaf_fan_in=2))
    rng = np.random.default_rng(3)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    filler = fill(disk)
    updates = [random_model(rng) for _ in range(2)]
    for u in updates:
        push(client, "j", 0, fmt.encode(u), 1)
    wait_for(lambda: metric(client, "lifl_checkpoint_failures_total") >= 2, what="two failed checkpoint writes")
    job = state.job("j")
    assert job.version == 0 and job.checkpoint == 0  # nothing unseen is served
    assert "version 1" in job.checkpoint_error and "No space left" in job.checkpoint_error
    assert "/" not in job.checkpoint_error  # the kind of failure, not the node's paths
    assert read_model(client, "j")[0] == 0
    filler.unlink()
    wait_for(lambda: state.version("j") == 1, what="version 1 once space returned")
    job = state.job("j")
    assert job.checkpoint == 1 and job.checkpoint_error == ""
    _, model = read_model(client, "j")
    for k in SHAPES:
        np.testing.assert_allclose(model[k], (updates[0][k].astype(np.float64) + updates[1][k]) / 2, rtol=1e-6)
    agent.stop()
    again = started(data_dir=disk)  # a restart resumes from the durable checkpoint
    assert read_model(gateway(again), "j")[0] == 1


def test_a_first_model_that_cannot_be_checkpointed_is_refused_with_retry_after(
        started: Callable[..., Agent], state: ClusterState, disk: Path) -> None:
    agent = started(data_dir=disk)
    state.create_job(JobSpec("j", goal=1))
    client = gateway(agent)
    blob = fmt.encode(random_model(np.random.default_rng(1)))
    filler = fill(disk)
    reply, fds = client.call(AdmitModel("j", len(blob)))
    write(fds[0], blob)
    with pytest.raises(Unavailable) as info:
        client.call(InstallModel(reply.key))
    assert info.value.code == "checkpoint_failed" and info.value.retry_after
    assert state.version("j") < 0
    filler.unlink()
    put_model(client, "j", blob)
    assert read_model(client, "j")[0] == 0
