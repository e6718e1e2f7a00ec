"""Nothing of lifl stays in /dev/shm: after a clean stop, and within 5 s of kill -9 of any process
of a node (if both the agent and its supervisor die, the next start cleans up)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt

pytestmark = pytest.mark.slow
MODEL = fmt.encode({"w": np.ones((256, 256), np.float32)})


class Up:
    """`lifl up` as a subprocess with its own embedded redis."""

    def __init__(self, node: str, base: Path) -> None:
        self.node, self.base = node, base
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lifl", "up", "--node", node, "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
             "--run-dir", str(base / "run"), "--data-dir", str(base / "data"), "--shm-limit", "256m"],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        lines = []
        while not any(l.startswith("  http:") for l in lines):
            line = self.proc.stdout.readline()
            assert line, f"lifl up failed: {''.join(lines)}"
            lines.append(line)
        self.http = next(l for l in lines if l.startswith("  http:")).split()[1]

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.http + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def pids(self) -> dict[str, int]:
        """Processes of the node by role, from /proc."""
        out: dict[str, int] = {}
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode() for a in cmd if a]
            if args and args[0].endswith("redis-server") and any(str(self.base) in a for a in args):
                out["redis"] = int(p.name)
            if "--node" in args and args[args.index("--node") + 1] == self.node:
                if "lifl.node.agent" in args:
                    out["agent"] = int(p.name)
                elif "lifl.gateway" in args:
                    out["gateway"] = int(p.name)
                elif "lifl.runtime" in args:
                    out.setdefault("instance", int(p.name))
        out["supervisor"] = self.proc.pid
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
        headers = {"X-Lifl-Client": "c", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"}
        assert self.call("POST", "/v1/jobs/j/updates", MODEL, headers)[0] == 202  # held by a leaf
        assert len(self.objects()) == 2


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


def test_kill_agent_node_stops_and_cleans_within_5s(up: Up) -> None:
    up.start_round()
    os.kill(up.pids()["agent"], signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(lambda: not up.shm(), timeout=5, what="shared memory cleaned")
    assert time.monotonic() - t0 < 5
    assert up.proc.wait(30) == 1  # the node cannot go on without its agent


def test_kill_supervisor_children_stop_and_clean_within_5s(up: Up) -> None:
    up.start_round()
    pids = up.pids()
    os.kill(pids["supervisor"], signal.SIGKILL)
    wait_for(lambda: not up.shm(), timeout=5, what="shared memory cleaned")
    wait_for(lambda: all(not Path(f"/proc/{p}").exists() or b"Z" in Path(f"/proc/{p}/stat").read_bytes().split(b")")[1][:3]
                         for p in (pids["agent"], pids["gateway"])), timeout=5, what="children gone")


def test_kill_gateway_is_restarted_and_its_upload_released(up: Up) -> None:
    up.start_round()
    old = up.pids()["gateway"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: up.pids().get("gateway") not in (None, old), timeout=10, what="gateway restarted")
    wait_for(up.answers, timeout=10, what="gateway answering on the same port")
    assert len(up.objects()) == 2  # the model and the held update: nothing orphaned


def test_kill_aggregator_releases_its_objects_within_5s(up: Up) -> None:
    up.start_round()
    os.kill(up.pids()["instance"], signal.SIGKILL)
    wait_for(lambda: len(up.objects()) == 1, timeout=5, what="the round's objects released")
    status = up.call("GET", "/v1/jobs/j")[1]
    assert status["round"]["received"] == 0 and status["version"] == 0  # the slot reopened


def test_kill_everything_next_start_cleans_up(up: Up, shm_node: str, run_dir: Path) -> None:
    up.start_round()
    os.killpg(os.getpgid(up.pids()["agent"]), signal.SIGKILL)  # the agent's own session
    os.kill(up.proc.pid, signal.SIGKILL)
    up.proc.wait()
    time.sleep(0.5)
    subprocess.run(["pkill", "-9", "-f", "--", f"--node {shm_node}"], check=False)
    stale = set(up.shm())
    assert stale  # left behind: nobody was alive to clean
    again = Up(shm_node, run_dir.parent)
    try:
        now = again.objects()
        assert not stale & set(again.shm()) and len(now) == 1  # only the model, restored from its checkpoint
    finally:
        again.proc.send_signal(signal.SIGTERM)
        again.proc.wait(30)
