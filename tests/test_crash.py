"""Nothing of lifl stays in /dev/shm: after a clean stop, and after kill -9 of any process of a
node (if both the agent and its supervisor die, the next start cleans up); a killed agent or
gateway is restarted while the rest of the node runs on; a killed aggregator loses nothing (its
task runs again), nor does a Redis outage."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, auth, wait_for
from lifl.keys import ebpf
from lifl import format as fmt
from lifl import procstat
from lifl.client import Gateway, RetryPolicy
from lifl.keys.ebpf import PIN_ROOT
from lifl.net import lifl_pb2, lifl_pb2_grpc

pytestmark = pytest.mark.slow
MODEL = fmt.encode({"w": np.ones((256, 256), np.float32)})


CLIENTS = itertools.count()


def update_headers() -> dict[str, str]:
    """The headers of an update of version 0 from a client not seen before (one update per client and round)."""
    return {"X-Lifl-Client": f"c{next(CLIENTS)}", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"}


class Up:
    """`lifl up` as a subprocess with its own embedded redis."""

    def __init__(self, node: str, base: Path, *options: str) -> None:
        self.node, self.base = node, base
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lifl", "up", "--node", node, "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
             "--run-dir", str(base / "run"), "--data-dir", str(base / "data"), "--shm-limit", "256m", *options],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        lines = []
        while not any(l.startswith("  grpc:") for l in lines):
            line = self.proc.stdout.readline()
            assert line, f"lifl up failed: {''.join(lines)}"
            lines.append(line)
        self.http = next(l for l in lines if l.startswith("  http:")).split()[1]
        self.grpc = next(l for l in lines if l.startswith("  grpc:")).split()[1]

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
        status, _, answer = self.exchange(method, path, body, headers)
        return status, answer

    def exchange(self, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None) -> tuple[int, dict[str, str], dict]:
        req = urllib.request.Request(self.http + path, data=body, method=method, headers={**auth(), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def pids(self) -> dict[str, int]:
        """Processes of the node by role, from /proc. The agent and the gateway are the
        supervisor's children: a child the agent forked and has not exec'd yet shows the agent's
        command line too."""
        out: dict[str, int] = {}
        children = set(procstat.children(self.proc.pid))
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode() for a in cmd if a]
            if "--node" in args and args[args.index("--node") + 1] == self.node:
                if "lifl.node.agent" in args and int(p.name) in children:
                    out["agent"] = int(p.name)
                elif "lifl.gateway" in args and int(p.name) in children:
                    out["gateway"] = int(p.name)
                elif "lifl.runtime" in args:
                    out.setdefault("instance", int(p.name))
        out["supervisor"] = self.proc.pid
        for pid in children:  # redis rewrites its command line: known by name
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "redis-server":
                    out["redis"] = pid
        return out

    def shm(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").glob(f"lifl-{self.node}-*"))

    def objects(self) -> list[str]:
        """Live objects (named by key), not the recycling pool's free buffers."""
        return [n for n in self.shm() if re.fullmatch(r"[0-9a-f]{32}", n.rsplit("-", 1)[1])]

    def answers(self) -> bool:
        try:
            return self.call("GET", "/v1/jobs/j")[0] == 200
        except OSError:
            return False

    def kill_all(self) -> None:
        """kill -9 every process of the node at once (a crash of the whole node)."""
        pids = self.pids()
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # all stopped first: none reacts to another's death
            for role in ("supervisor", "agent", "gateway", "redis", "instance"):
                if role in pids:
                    with contextlib.suppress(ProcessLookupError):  # one that happened to exit just now
                        os.kill(pids[role], sig)
        subprocess.run(["pkill", "-9", "-f", "--", f"--node {self.node}"], check=False)
        self.proc.wait()

    def start_round(self) -> None:
        assert self.call("POST", "/v1/jobs", json.dumps({"job": "j", "goal": 3}).encode())[0] == 201
        assert self.call("PUT", "/v1/jobs/j/model", MODEL)[0] == 201
        assert self.call("POST", "/v1/jobs/j/updates", MODEL, update_headers())[0] == 202  # held by a leaf
        assert len(self.objects()) == 2


def running(pid: int) -> bool:
    """Alive and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.fixture
def up(shm_node: str, run_dir: Path) -> Iterator[Up]:
    u = Up(shm_node, run_dir.parent)
    yield u
    if u.proc.poll() is None:
        u.proc.send_signal(signal.SIGTERM)
        u.proc.wait(30)
    subprocess.run(["pkill", "-9", "-f", "--", f"--node {shm_node}"], check=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_clean_stop_leaves_nothing(up: Up, sig: int) -> None:
    up.start_round()
    up.proc.send_signal(sig)
    assert up.proc.wait(30) == 0
    assert up.shm() == [] and set(up.pids()) == {"supervisor"}


def test_kill_agent_is_restarted_clean_and_the_same_gateway_serves_again(up: Up) -> None:
    up.start_round()
    before = up.pids()
    stale = set(up.shm())
    instance = wait_for(lambda: up.pids().get("instance"), what="the leaf's instance")
    program = ebpf.program_id(PIN_ROOT / up.node)  # its key channel is eBPF (root, the object is built)
    os.kill(before["agent"], signal.SIGKILL)
    wait_for(lambda: up.pids().get("agent") not in (None, before["agent"]), what="the agent restarted")
    assert not running(instance)  # the killed agent's aggregators, left to init, were stopped first
    # retried through 503 agent_unavailable until the gateway has connected to the new agent
    gw = Gateway(up.http, retry=RetryPolicy(max_attempts=10_000, max_elapsed_s=120.0, max_delay_s=0.5))
    assert gw.push("j", MODEL, client="after", samples=1, base_version=0) == {"version": 0}
    assert up.pids()["gateway"] == before["gateway"] and up.proc.poll() is None
    assert ebpf.program_id(PIN_ROOT / up.node) != program  # the killed agent's channel unloaded, a new one loaded
    assert not stale & set(up.shm()) and len(up.objects()) == 2  # the model, restored from its checkpoint, and the new update
    given_up = gw.rounds("j")[-1]  # the round the killed agent held an update of, recorded as lost
    assert given_up["outcome"] == "interrupted" and sum(given_up["lost"].values()) == 1, given_up
    gw.close()


def test_kill_supervisor_children_stop_and_clean(up: Up) -> None:
    up.start_round()
    pids = up.pids()
    os.kill(pids["supervisor"], signal.SIGKILL)
    wait_for(lambda: not up.shm(), what="shared memory cleaned")
    wait_for(lambda: not running(pids["agent"]) and not running(pids["gateway"]), what="children gone")


def test_kill_gateway_is_restarted_and_its_upload_released(up: Up) -> None:
    up.start_round()
    old = up.pids()["gateway"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: up.pids().get("gateway") not in (None, old), what="gateway restarted")
    wait_for(up.answers, what="gateway answering on the same port")
    assert len(up.objects()) == 2  # the model and the held update: nothing orphaned


def test_kill_aggregator_its_task_runs_again_and_the_round_completes(up: Up) -> None:
    up.start_round()
    killed = wait_for(lambda: up.pids().get("instance"), what="the leaf's instance")  # started after the 202
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: up.pids().get("instance") not in (None, killed), what="the leaf running again on a new instance")
    assert len(up.objects()) == 2  # the model and the acknowledged update, kept for the re-run
    for _ in range(2):
        assert up.call("POST", "/v1/jobs/j/updates", MODEL, update_headers())[0] == 202
    wait_for(lambda: up.call("GET", "/v1/jobs/j")[1]["version"] == 1, what="version 1")
    assert up.call("GET", "/v1/jobs/j")[1]["last_round"]["updates"] == 3  # the one acknowledged before the kill too
    wait_for(lambda: len(up.objects()) == 1, what="only the new model left")


def test_a_redis_outage_is_503_with_retry_after_and_the_node_carries_on_when_it_returns(up: Up) -> None:
    up.start_round()
    pids = up.pids()
    os.kill(pids["supervisor"], signal.SIGSTOP)  # so that redis stays down until the test lets it restart
    try:
        os.kill(pids["redis"], signal.SIGKILL)
        wait_for(lambda: not running(pids["redis"]), what="redis gone")
        status, headers, body = up.exchange("GET", "/v1/jobs/j")
        assert status == 503 and int(headers["Retry-After"]) >= 1 and body["error"]["code"] == "state_unavailable"
        status, _, body = up.exchange("POST", "/v1/jobs/j/updates", MODEL, update_headers())
        assert status == 503 and body["error"]["code"] == "state_unavailable"  # not acknowledged, so not lost
        stub = lifl_pb2_grpc.GatewayStub(grpc.insecure_channel(up.grpc))
        for _ in range(2):  # the HTTP/2 connection survives the error
            with pytest.raises(grpc.RpcError) as info:
                stub.GetJob(lifl_pb2.GetJobRequest(job="j"), timeout=30, metadata=[("authorization", f"Bearer {OPERATOR_TOKEN}")])
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(pids["supervisor"], signal.SIGCONT)
    wait_for(lambda: up.call("GET", "/v1/jobs/j")[0] == 200, what="the node answering again")
    for _ in range(2):
        assert up.call("POST", "/v1/jobs/j/updates", MODEL, update_headers())[0] == 202
    wait_for(lambda: up.call("GET", "/v1/jobs/j")[1]["version"] == 1, what="version 1")
    assert up.call("GET", "/v1/jobs/j")[1]["last_round"]["updates"] == 3  # the update acknowledged before the outage


def test_kill_everything_next_start_cleans_up(up: Up, shm_node: str, run_dir: Path) -> None:
    up.start_round()
    up.kill_all()
    stale = set(up.shm())
    assert stale and (PIN_ROOT / up.node).exists()  # left behind: nobody was alive to clean
    program = ebpf.program_id(PIN_ROOT / up.node)
    again = Up(shm_node, run_dir.parent)
    try:
        assert not stale & set(again.shm()) and again.objects() == []  # models come back from checkpoints when used
        with urllib.request.urlopen(urllib.request.Request(again.http + "/v1/jobs/j/model", headers=auth()), timeout=60) as r:
            assert r.status == 200 and r.read() == MODEL
        assert len(again.objects()) == 1  # the model, restored from its checkpoint as it was read
        assert ebpf.program_id(PIN_ROOT / up.node) != program  # the crashed run's channel unloaded, a new one loaded
    finally:
        again.proc.send_signal(signal.SIGTERM)
        again.proc.wait(30)


def test_an_instance_whose_agent_went_while_it_started_exits_quietly(tmp_path: Path) -> None:
    control, agent_end = socket.socketpair()
    channel, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent_end.close()  # the agent died before the instance said it was ready
    run = subprocess.run([sys.executable, "-m", "lifl.runtime", "--instance", "1", "--tenant", "t", "--node", "n",
                          "--channel", f"unix:0:{tmp_path}", "--control-fd", str(control.fileno()),
                          "--channel-fd", str(channel.fileno())],
                         pass_fds=(control.fileno(), channel.fileno()), capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (0, "")
