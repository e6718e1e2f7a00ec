"""Function instances the node does not start (a tenant's pods on Kubernetes) attach to the
agent's function socket: the function image's own shim (templates/lifl-aggregator/index.py) runs
here as a real process of the tenant's uid, not a child of the agent, and aggregates rounds; the
kernel's peer credentials decide who may attach; the shim waits for, and survives, its agent."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl.jobs import JobSpec
from lifl.node.agent import Agent, AgentConfig
from lifl.protocol import PROTOCOL, Attach, GetStatus, Hello
from lifl.rpc import Connection
from lifl.state import ClusterState
from test_agent import SHAPES, gateway, push, put_model, random_model, read_model, aggregator_pids

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="tenant uids need root")]

ROOT = Path(__file__).resolve().parent.parent
SHIM_AS = Path(__file__).resolve().parent / "shim_as.py"  # the template's index.py, as a pod's uid
HANDLER_DIR = ROOT / "functions" / "aggregator"


class Shim:
    """The function image's entry point (its shim) as a process of ``uid``:``gid``."""

    def __init__(self, socket_path: Path, tenant: str, uid: int, gid: int) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="lifl-shim-", suffix=".log", delete=False)
        os.chmod(self.log.name, 0o666)
        env = {"PATH": os.environ["PATH"], "LIFL_TENANT": tenant, "LIFL_AGENT_SOCKET": str(socket_path), "PORT": "0",
               "LIFL_FUNCTION_DIR": str(HANDLER_DIR), "HOME": "/", "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen([sys.executable, str(SHIM_AS), str(uid), str(gid)], env=env, cwd="/",
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.port = wait_for(self._port, what="the shim's status port")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def _port(self) -> int | None:
        found = re.search(r"status on :(\d+)", self.output())
        assert found or self.proc.poll() is None, f"the shim exited: {self.output()}"
        return int(found.group(1)) if found else None

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/")
        assert code == 200, body
        return json.loads(body)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)


@pytest.fixture
def shims() -> Iterator[Callable[..., Shim]]:
    started: list[Shim] = []

    def start(socket_path: Path, tenant: str, uid: int, gid: int | None = None) -> Shim:
        shim = Shim(socket_path, tenant, uid, uid if gid is None else gid)
        started.append(shim)
        return shim

    yield start
    for shim in started:
        shim.stop()
        os.unlink(shim.log.name)


def pods_agent(run_dir: Path, redis_url: str, node: str) -> Agent:
    agent = Agent(AgentConfig(node, run_dir, redis_url, 256 << 20, 64 << 20, keep_warm=30, functions="pods",
                              data_dir=run_dir.parent / "data"), ClusterState(redis_url))
    agent.start()
    return agent


def metric(agent: Agent, line_start: str) -> float:
    for line in agent.metrics_text().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_attached_pods_aggregate_rounds_and_the_node_starts_none(
        started: Callable[..., Agent], state: ClusterState, shims: Callable[..., Shim]) -> None:
    agent = started(functions="pods")
    state.create_job(JobSpec("j", goal=4, leaf_fan_in=2, tenant="acme"))
    uid = state.tenant_id("acme")
    pods = [shims(agent.config.functions_socket_path, "acme", uid) for _ in range(2)]
    for pod in pods:
        wait_for(lambda: pod.status()["ready"], what="the pod attached")
        assert pod.get("/_/health") == (200, "OK")
    rng = np.random.default_rng(7)
    client = gateway(agent)
    put_model(client, "j", fmt.encode(random_model(rng)))
    for version in range(2):
        updates = [random_model(rng) for _ in range(4)]
        samples = [int(s) for s in rng.integers(1, 50, 4)]
        for u, c in zip(updates, samples):
            push(client, "j", version, fmt.encode(u), c)
        wait_for(lambda: state.version("j") == version + 1, what=f"version {version + 1}")
        _, model = read_model(client, "j")
        for name in SHAPES:
            ref = sum(u[name].astype(np.float64) * c for u, c in zip(updates, samples)) / sum(samples)
            assert np.all(np.abs(model[name] - ref) <= 1e-5 * (np.abs(ref) + 1e-3))
    assert aggregator_pids() == []  # the node started no instance: the pods did all the work
    assert metric(agent, 'lifl_aggregator_instances_created_total{reason="attached"}') == 2
    assert metric(agent, 'lifl_aggregator_instances_created_total{reason="cold_start"}') == 0
    assert sum(pod.status()["tasks"] for pod in pods) >= 6  # two rounds of two leaves and a top
    assert {pod.status()["node"] for pod in pods} == {agent.node}


def test_a_pod_waits_for_its_agent_and_attaches_again_when_it_restarts(
        run_dir: Path, redis_url: str, shm_node: str, state: ClusterState, shims: Callable[..., Shim]) -> None:
    run_dir.mkdir(parents=True)
    os.chmod(run_dir, 0o755)
    socket_path = run_dir / "functions.sock"
    uid = state.tenant_id("acme")
    pod = shims(socket_path, "acme", uid)
    code, body = wait_for(lambda: (r := pod.get("/_/health"))[0] == 503 and "waiting for the node agent" in r[1] and r,
                          what="the pod waiting")
    assert str(socket_path) in body
    agent = pods_agent(run_dir, redis_url, shm_node)
    try:
        wait_for(lambda: pod.status()["ready"], what="the pod attached")
        first = pod.status()["instance"]
    finally:
        agent.stop()
    wait_for(lambda: not pod.status()["ready"], what="the pod noticed its agent went")
    agent = pods_agent(run_dir, redis_url, shm_node)
    try:
        wait_for(lambda: pod.status()["ready"] and pod.status()["attaches"] == 2, what="the pod attached again")
        assert pod.status()["instance"] >= 1 and first >= 1
        # the agent lets an attached instance go: it comes back as a fresh instance
        (iid,) = agent.instances
        agent.stop_instance(iid)
        wait_for(lambda: pod.status()["attaches"] == 3 and pod.status()["ready"], what="the pod back as a new instance")
        wait_for(lambda: iid not in agent.instances and len(agent.instances) == 1, what="the agent's books")
    finally:
        agent.stop()
    assert pod.stop() == 0  # SIGTERM ends it cleanly


@pytest.mark.parametrize("identity,expected", [
    ("other-uid", "must run as uid {uid} and gid {uid}"),
    ("other-gid", "this one runs as {uid}:{other}"),
])
def test_a_pod_of_the_wrong_identity_is_refused_with_the_reason(
        started: Callable[..., Agent], state: ClusterState, shims: Callable[..., Shim], identity: str, expected: str) -> None:
    agent = started(functions="pods")
    uid = state.tenant_id("acme")
    other = uid + 5000
    pod = shims(agent.config.functions_socket_path, "acme", *((other, other) if identity == "other-uid" else (uid, other)))
    assert pod.proc.wait(60) == 2
    assert expected.format(uid=uid, other=other) in pod.output()
    assert "refused this instance" in pod.output()
    assert agent.instances == {}


def _raw(agent: Agent, data: bytes) -> dict[str, Any] | None:
    """The agent's reply to ``data`` sent on the function socket (None: it closed without one)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(agent.config.functions_socket_path))
    sock.settimeout(60)
    sock.sendall(data)
    conn = Connection(sock)
    try:
        frame, _ = conn.recv()
    except EOFError:
        return None
    finally:
        conn.close()
    return frame


def _frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("data,code", [
    (_frame({"id": 1, **Hello("gateway").encode()}), "bad_attach"),
    (_frame({"id": 1, **Attach("acme", protocol=PROTOCOL + 1).encode()}), "bad_protocol"),
    (_frame({"id": 1, **Attach("Not A Tenant").encode()}), "bad_tenant"),
    (_frame({"id": 1, **Attach("x" * 40).encode()}), "bad_tenant"),
    (_frame({"id": 1, "op": "attach"}), "bad_message"),  # no tenant
    (_frame({"id": 1, "op": "attach", "tenant": 7}), "bad_message"),
    (_frame({"id": 1, **Attach("acme").encode()}), "wrong_identity"),  # the test runs as root, not as acme
    (_frame({"id": 1, **Attach("nobody").encode()}), "unknown_tenant"),  # no job or pod made it: no id is allocated
    (b"\x05\x00\x00\x00nope!", None),  # not JSON
    (struct.pack("<I", 1 << 30), None),  # larger than any control message
])
def test_malformed_attaches_are_refused_and_the_agent_carries_on(
        started: Callable[..., Agent], state: ClusterState, data: bytes, code: str | None) -> None:
    agent = started(functions="pods")
    state.tenant_id("acme")
    reply = _raw(agent, data)
    if code is None:
        assert reply is None or reply["ok"] is False
    else:
        assert reply is not None and reply["ok"] is False and reply["error"]["code"] == code, reply
        assert reply["error"]["message"]
    assert agent.instances == {}
    assert not state.known_tenant("nobody")
    assert gateway(agent).call(GetStatus())[0].status.node == agent.node  # still serving
