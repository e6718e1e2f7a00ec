"""Fault injection: a node under load from clients over HTTP and gRPC while each of its process
kinds is killed and its resources run out. After every fault the next version must be the exact
FedAvg of the updates acknowledged for its round (none missing, none counted twice), versions
must follow each other without gaps or repeats, and /dev/shm must be clean after shutdown.

Rounds are paced by the test (it injects a fault once the round holds acknowledged updates, then
waits for the next version), so the checks hold however loaded the machine is.

A kill of the agent or of the whole node takes the updates held in that node's memory with it:
the agent, restarted by its supervisor (or with the whole node), gives up its open round, which
records them as lost. The clients see the round given up on the version they built on and send
the same updates again (as lifl's ``Participant`` does), so they still reach the next version;
the test counts them separately.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from conftest import fill, wait_for
from lifl import errors
from lifl import format as fmt
from lifl.client import ConnectionLost, Gateway
from test_crash import Up, running

pytestmark = [pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="the checkpoint disk is a small tmpfs mounted for the test")]

SHAPES = {"w": (96, 64), "b": (64,)}
BIG = {"w": (512, 512)}  # 1 MiB updates for the shared-memory round
GOAL = 4  # updates per round of the small job; its pushers alternate HTTP and gRPC
BIG_GOAL = 8
# A round of BIG_GOAL 1 MiB updates needs at most 15 MiB at once (its inputs, float64 accumulators
# and next model: lifl.ledger), all of its updates arriving at once 21 MiB.
SHM_LIMIT = "17m"
DISK = 4 << 20  # the checkpoint file system
PUSH_DEADLINE = 120.0  # seconds a pusher keeps trying through a fault


def tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@dataclass
class Update:
    seed: int
    samples: int
    protocol: str
    outcome: str = "pending"  # acknowledged, unknown (the connection broke after sending), refused
    acknowledged_by: Up | None = None  # the run of the node that acknowledged it (in its memory until a version)
    acknowledged_at: float = 0.0  # when its client was told (time.monotonic())
    unanswered_by: list[Up] = field(default_factory=list)  # runs that may have taken a try whose answer was lost

    def acknowledge(self, by: Up) -> None:
        self.outcome, self.acknowledged_by, self.acknowledged_at = "acknowledged", by, time.monotonic()


@dataclass
class Ledger:
    """What the clients were told, and what the checks found."""

    faults: list[str] = field(default_factory=list)
    acknowledged: int = 0
    resent: int = 0  # acknowledged by a node whose agent's memory was then lost, sent again
    unknown: int = 0
    refused: int = 0  # answered with a final error


class Node:
    """One `lifl up` with its checkpoints on a small file system of its own."""

    def __init__(self, node: str, base: Path, disk: Path) -> None:
        self.node, self.base, self.disk = node, base, disk
        self.up = self._start()

    def _start(self) -> Up:
        return Up(self.node, self.base, "--shm-limit", SHM_LIMIT, "--checkpoints", f"dir:{self.disk}")

    def restart(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.up.proc.wait(30)
        self.up.kill_all()
        self.up = self._start()

    def gateway(self, protocol: str) -> Gateway:
        return Gateway(self.up.http if protocol == "http" else self.up.grpc, protocol, timeout=60)


def push_until_answered(node: Node, job: str, shapes: dict[str, tuple[int, ...]], update: Update, base: int) -> None:
    """Send one update until the gateway acknowledges or refuses it for good, through faults
    (the SDK retries back-pressure and lost answers itself; this outlasts a node's restart)."""
    blob = fmt.encode(tensors(shapes, update.seed))
    deadline = time.monotonic() + PUSH_DEADLINE
    while time.monotonic() < deadline:
        up = node.up  # the run this try goes to
        gw = node.gateway(update.protocol)  # a fresh client each try: the node may have been replaced
        try:
            gw.push(job, blob, client=f"c{update.seed}", samples=update.samples, base_version=base)
            update.acknowledge(up)
            return
        except ConnectionLost:  # sent, answer lost: the retry is safe (one update per client and round)
            update.outcome = "unknown"
            update.unanswered_by.append(up)
            time.sleep(0.1)
        except errors.RetryLater as e:  # the SDK's retries ran out
            time.sleep(min(max(e.retry_after or 0.1, 0.05), 1.0))  # back-off between tries, not synchronisation
        except (ConnectionError, OSError):
            time.sleep(0.1)  # the node is restarting
        except errors.Conflict as e:
            if e.code == "already_acknowledged":  # an earlier try whose answer was lost was taken
                update.acknowledge(up)
            else:
                update.outcome = "refused"
            return
        except errors.LiflError:
            update.outcome = "refused"
            return
        finally:
            gw.close()
    raise AssertionError(f"update {update.seed} got no answer within {PUSH_DEADLINE} s")


def fedavg(shapes: dict[str, tuple[int, ...]], updates: list[Update]) -> dict[str, np.ndarray]:
    total = sum(u.samples for u in updates)
    return {k: sum(tensors(shapes, u.seed)[k].astype(np.float64) * u.samples for u in updates) / total for k in shapes}


def matches(model: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> bool:
    return all(np.allclose(model[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)


class Chaos:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._seeds = itertools.count(1)

    def version(self, job: str) -> int:
        return wait_for(lambda: self._version(job), what=f"the version of {job}") - 1

    def _version(self, job: str) -> int | None:
        try:
            return self.node.gateway("http").job(job)["version"] + 1  # +1: version 0 is a version
        except (errors.RetryLater, ConnectionError, OSError):
            return None

    def round(self, job: str, shapes: dict[str, tuple[int, ...]], goal: int, fault: Callable[[], None] | None,
              name: str, *, loses_memory: bool = False) -> None:
        """One round under load, ``fault`` injected once it holds acknowledged updates
        (``loses_memory``: the fault kills the agent, alone or with the whole node)."""
        base = self.version(job)
        updates = [Update(next(self._seeds), 1 + i % 5, ("http", "grpc")[i % 2]) for i in range(goal)]
        threads = [threading.Thread(target=push_until_answered,
                                    args=(self.node, job, shapes, u, base)) for u in updates]
        for t in threads[: goal // 2]:
            t.start()
        faulted, fault_at = self.node.up, 0.0
        if fault is not None:
            wait_for(lambda: any(u.outcome == "acknowledged" for u in updates), what="an acknowledged update")
            fault_at = time.monotonic()  # what was acknowledged before is in the faulted agent's memory
            fault()
            self.ledger.faults.append(name)
        for t in threads[goal // 2:]:
            t.start()
        for t in threads:
            t.join()
        resent = self._resend_lost(job, shapes, updates, base, faulted, fault_at) if loses_memory else 0
        self._check(job, shapes, updates, base, name, resent)

    def _resend_lost(self, job: str, shapes: dict[str, tuple[int, ...]], updates: list[Update], base: int,
                     faulted: Up, fault_at: float) -> int:
        """The updates the node acknowledged before the fault were in its agent's memory: the
        restarted agent gave their round up (recorded as lost), so their clients send them again.
        One the same run acknowledged after the fault may have been taken by the killed agent
        (its answer passed on late) or by its successor: it is sent again too, and the
        successor, if it has it, answers ``already_acknowledged``."""
        by_faulted = [u for u in updates if u.outcome == "acknowledged" and u.acknowledged_by is faulted]
        lost = [u for u in by_faulted if u.acknowledged_at < fault_at]
        late = [u for u in by_faulted if u not in lost]
        given_up = wait_for(lambda: self._given_up(job, base), timeout=180,
                            what=f"the round on version {base} of {job} given up")
        # recorded, not silent; a try taken just before the crash whose answer never came counts too
        # (its client was told nothing, and its retry went to the restarted node)
        unanswered = sum(any(run is faulted for run in u.unanswered_by) for u in updates if u not in by_faulted)
        assert len(lost) <= sum(given_up["lost"].values()) <= len(lost) + len(late) + unanswered, given_up
        # the late ones first: the new round cannot complete while the lost ones are missing, so
        # none of them is taken by the round after it
        for u in late + lost:
            u.outcome = "pending"
            push_until_answered(self.node, job, shapes, u, base)
        return len(by_faulted)

    def _given_up(self, job: str, base: int) -> dict | None:
        with contextlib.suppress(errors.RetryLater, ConnectionError, OSError):
            history = self.node.gateway("http").rounds(job, 5)
            return next((r for r in history if r["version"] == base and r["outcome"] in ("abandoned", "interrupted")),
                        None)
        return None

    def _check(self, job: str, shapes: dict[str, tuple[int, ...]], updates: list[Update], base: int, name: str,
               resent: int) -> None:
        wait_for(lambda: self.version(job) == base + 1, timeout=180, what=f"version {base + 1} of {job} after {name}")
        version, blob = self.node.gateway("http").model(job)
        assert version == base + 1, f"{name}: version {version} follows {base}"
        model = fmt.views(blob, fmt.parse_layout(blob))
        acked = [u for u in updates if u.outcome == "acknowledged"]
        unknown = [u for u in updates if u.outcome == "unknown"]
        summary = self.node.gateway("http").rounds(job, 1)[0]
        assert summary["new_version"] == base + 1 and summary["outcome"] in ("complete", "partial"), summary
        # exactly the acknowledged updates, and of the unknown ones those the gateway took
        included = next((acked + list(extra) for n in range(len(unknown) + 1)
                         for extra in itertools.combinations(unknown, n)
                         if summary["updates"] == len(acked) + n and matches(model, fedavg(shapes, acked + list(extra)))),
                        None)
        assert included is not None, f"{name}: version {base + 1} is not the FedAvg of the {len(acked)} acknowledged updates"
        assert not summary.get("lost"), f"{name}: updates lost {summary['lost']}"
        with self._lock:
            self.ledger.acknowledged += len(acked)
            self.ledger.unknown += len(unknown)
            self.ledger.refused += sum(u.outcome == "refused" for u in updates)
            self.ledger.resent += resent

    def assert_versions_contiguous(self, job: str) -> None:
        """Every round that made a version made the next one: none lost, none repeated."""
        history = self.node.gateway("http").rounds(job, 100)
        made = sorted(r["new_version"] for r in history if r.get("new_version") is not None
                      and r["outcome"] in ("complete", "partial"))
        assert made == list(range(1, len(made) + 1)), made


@pytest.fixture
def disk(small_disk: Callable[[int], Path]) -> Path:
    return small_disk(DISK)


@pytest.fixture
def node(shm_node: str, run_dir: Path, disk: Path) -> Iterator[Node]:
    n = Node(shm_node, run_dir.parent, disk)
    yield n
    if n.up.proc.poll() is None:
        n.up.proc.send_signal(signal.SIGTERM)
        n.up.proc.wait(60)
    subprocess.run(["pkill", "-9", "-f", "--", f"--node {shm_node}"], check=False)


def kill(node: Node, role: str) -> Callable[[], None]:
    def fault() -> None:
        pids = node.up.pids()
        victims = [p for r, p in pids.items() if r == role] if role != "instance" else aggregator_pids(node)
        assert victims, f"no {role} process to kill"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(running(p) for p in victims), what=f"{role} killed")
    return fault


def aggregator_pids(node: Node) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            args = (p / "cmdline").read_bytes().split(b"\0")
            if b"lifl.runtime" in args and node.node.encode() in args:
                out.append(int(p.name))
    return out


def fill_disk(node: Node, job: str) -> Callable[[], None]:
    """Take every free block of the checkpoint file system, and give it back once the round's
    model has failed to be checkpointed (the job's status says why it waits)."""
    def fault() -> None:
        filler = fill(node.disk)

        def release() -> None:
            wait_for(lambda: checkpoint_error(node, job), timeout=180, what="a failed checkpoint in the job's status")
            filler.unlink()
        threading.Thread(target=release, daemon=True).start()
    return fault


def checkpoint_error(node: Node, job: str) -> str | None:
    with contextlib.suppress(errors.RetryLater, ConnectionError, OSError):
        return node.gateway("http").job(job)["model"]["checkpoint_error"]
    return None


def admission_refusals(node: Node, job: str) -> float:
    text = node.gateway("http").metrics()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lifl_admission_refusals_total{") and f'job="{job}"' in line)


@pytest.mark.timeout(1200)  # nine rounds, each through a fault
def test_every_version_is_the_exact_fedavg_of_what_was_acknowledged_through_every_fault(node: Node) -> None:
    gw = node.gateway("http")
    gw.create_job("small", GOAL)
    gw.set_model("small", fmt.encode(tensors(SHAPES, 0)))
    gw.create_job("big", BIG_GOAL)
    gw.set_model("big", fmt.encode(tensors(BIG, 0)))
    chaos = Chaos(node)
    chaos.round("small", SHAPES, GOAL, None, "no fault")
    for role in ("instance", "gateway", "redis"):
        chaos.round("small", SHAPES, GOAL, kill(node, role), f"kill -9 {role}")
    # all of the round's uploads at once, more than its memory holds unless the first are folded
    # quickly; whether any is refused depends on scheduling (tests/test_admission_e2e.py fills
    # memory deterministically), so the refusals are reported, not required
    chaos.round("big", BIG, BIG_GOAL, None, "shared memory exhausted")
    refusals = admission_refusals(node, "big")
    chaos.ledger.faults.append(f"shared memory exhausted ({refusals:g} uploads refused with 503 and retried)")
    chaos.round("small", SHAPES, GOAL, fill_disk(node, "small"), "checkpoint disk full")
    chaos.round("small", SHAPES, GOAL, kill(node, "agent"), "kill -9 agent", loses_memory=True)  # its supervisor restarts it
    chaos.round("small", SHAPES, GOAL, lambda: (node.up.kill_all(), node.restart()), "kill -9 the whole node",
                loses_memory=True)
    chaos.round("small", SHAPES, GOAL, None, "no fault, after all of them")
    for job in ("small", "big"):
        chaos.assert_versions_contiguous(job)
    ledger = chaos.ledger
    print(f"\nchaos: {len(ledger.faults)} faults injected ({', '.join(ledger.faults)}); "
          f"{ledger.acknowledged} updates acknowledged, all in their versions ({ledger.unknown} of unknown outcome, "
          f"{ledger.refused} refused); {ledger.resent} acknowledged updates sent again by their clients when their "
          f"agent's memory was lost (recorded in their round); acknowledged updates missing: 0")
    assert ledger.refused == 0
    node.up.proc.send_signal(signal.SIGTERM)
    assert node.up.proc.wait(60) == 0
    assert node.up.shm() == []
