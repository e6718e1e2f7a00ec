"""Checkpoint stores (directory, Redis, S3-compatible) and restoring a job from them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from conftest import wait_for
from lifl import checkpoints
from lifl import format as fmt
from lifl.node.agent import Agent, AgentConfig
from lifl.jobs import JobSpec
from lifl.state import ClusterState, job_key
from test_agent import gateway, push, put_model, read_model


def shm_blob(data: bytes) -> tuple[int, int]:
    """An fd of a shared-memory object holding ``data``, as the agent hands to a store."""
    shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, size=len(data))
    os.pwrite(shm.fd, data, 0)
    shm.unlink()
    return shm.fd, len(data)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3-compatible server (moto) on a free local port."""
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"moto_server exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return True
        except OSError:
            return False

    try:
        wait_for(listening, what="moto_server to listen")
    except AssertionError:
        proc.kill()
        raise
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["dir", "redis", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> checkpoints.CheckpointStore:
    if request.param == "dir":
        return checkpoints.open_store(f"dir:{tmp_path / 'ckpt'}", data_dir=tmp_path, redis_url=redis_url)
    if request.param == "redis":
        return checkpoints.open_store("redis", data_dir=tmp_path, redis_url=redis_url)
    endpoint = request.getfixturevalue("s3_endpoint")
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3 = checkpoints.open_store(f"s3://ckpt-{os.getpid()}/lifl?endpoint={endpoint}", data_dir=tmp_path, redis_url=redis_url)
    try:
        s3.client.create_bucket(Bucket=s3.bucket)
    except s3.client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return s3


def test_store_round_trip_latest_and_prune(store: checkpoints.CheckpointStore) -> None:
    job = f"job{time.monotonic_ns()}"
    assert checkpoints.latest(store, job) is None
    blobs = {}
    for version in range(5):
        blobs[version] = bytes(fmt.encode({"w": np.full(100, version, np.float32)}))
        fd, size = shm_blob(blobs[version])
        store.save(job, version, fd, size)
        os.close(fd)
        checkpoints.prune(store, job, keep=3)
    assert store.versions(job) == [2, 3, 4] and checkpoints.latest(store, job) == 4
    assert store.load(job, 3) == blobs[3]


def test_directory_store_leaves_no_partial_file(tmp_path: Path) -> None:
    store = checkpoints.DirectoryStore(tmp_path)
    fd, _ = shm_blob(b"x" * 10)
    with pytest.raises(OSError):
        store.save("j", 1, fd, 20)  # the source is shorter than promised
    os.close(fd)
    assert store.versions("j") == [] and list((tmp_path / "j").iterdir()) == []


@pytest.mark.parametrize("spec", ["nonsense", "ftp://x"])
def test_unknown_store_is_refused_by_name(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown checkpoint store"):
        checkpoints.open_store(spec, data_dir=tmp_path, redis_url="redis://localhost")


def test_restore_takes_the_newest_checkpoint_even_if_redis_lost_the_version(run_dir: Path, redis_url: str, shm_node: str) -> None:
    """Versions become visible only once checkpointed; if Redis lost its last writes (it syncs
    its log every second), the newer checkpoint wins, so no version is lost."""
    config = AgentConfig(shm_node, run_dir, redis_url, 64 << 20, 16 << 20, data_dir=run_dir.parent / "data")
    state = ClusterState(redis_url)
    state.create_job(JobSpec("j", goal=1))
    agent = Agent(config, state)
    agent.start()
    client = gateway(agent)
    put_model(client, "j", fmt.encode({"w": np.zeros(8, np.float32)}))
    push(client, "j", 0, fmt.encode({"w": np.full(8, 7.0, np.float32)}), 1)
    wait_for(lambda: state.version("j") == 1, what="version 1")
    client.close()
    agent.stop()
    state.redis.hset(job_key("j"), "version", 0)  # as if the version flip had not reached the disk
    agent = Agent(config, state)
    agent.start()
    try:
        assert state.version("j") == 1
        version, model = read_model(gateway(agent), "j")
        assert version == 1 and model["w"][0] == 7.0
    finally:
        agent.stop()
