"""Issue 25: idle models leave shared memory and come back from their checkpoints on demand
(lifl.node.spill), and idle jobs cost a node nothing."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl.client import Gateway
from lifl.node.spill import Resident, expired, to_make_room
from lifl.node.supervisor import Node, NodeConfig
from lifl.state import NODES, ClusterState

MODEL_IDLE_S = 1.0  # the test nodes' --model-idle: short, so that models spill soon
MB = 1 << 20
OBJECT_NAME = re.compile(r"-[0-9a-f]{32}$")  # lifl.store.object_name: a live object, named by its key


def model(job: str, tenant: str = "a", size: int = MB, last_used: float = 0.0, busy: bool = False) -> Resident:
    return Resident(job, tenant, size, last_used, busy)


@pytest.mark.parametrize("models, now, expected", [
    ([], 100.0, []),
    ([model("fresh", last_used=95.0)], 100.0, []),  # used 5 s ago
    ([model("old", last_used=40.0)], 100.0, ["old"]),  # 60 s: idle
    ([model("exactly", last_used=50.0)], 110.0, ["exactly"]),
    ([model("round", last_used=0.0, busy=True)], 100.0, []),  # a round, a download or a query holds it
    ([model("a", last_used=10.0), model("b", last_used=70.0), model("c", last_used=20.0, busy=True)], 100.0, ["a"]),
])
def test_a_model_spills_once_idle_for_the_period(models: list[Resident], now: float, expected: list[str]) -> None:
    assert expired(models, now, idle_s=60.0) == expected


@pytest.mark.parametrize("models, need, tenant, over_share, expected", [
    ([], MB, None, {}, []),
    # least recently used first, until enough is freed
    ([model("new", last_used=9.0), model("old", last_used=1.0), model("mid", last_used=5.0)], MB, None, {}, ["old"]),
    ([model("new", last_used=9.0), model("old", last_used=1.0), model("mid", last_used=5.0)], MB + 1, None, {},
     ["old", "mid"]),
    # not enough idle: every idle one goes (the caller retries, and may fit with what is freed meanwhile)
    ([model("x", last_used=1.0), model("busy", last_used=0.0, busy=True)], 5 * MB, None, {}, ["x"]),
    # memory is short: tenants over their shares give first, whoever used theirs last
    ([model("a1", "a", last_used=1.0), model("b1", "b", last_used=9.0)], MB, None, {"b": MB}, ["b1"]),
    # a tenant over its fair share spills its own, never another tenant's
    ([model("a1", "a", last_used=1.0), model("b1", "b", last_used=9.0)], MB, "b", {}, ["b1"]),
    ([model("a1", "a", last_used=1.0)], MB, "b", {"a": MB}, []),
    ([model("small", size=10, last_used=1.0), model("big", size=10 * MB, last_used=2.0)], MB, None, {}, ["small", "big"]),
])
def test_idle_models_make_room_least_recently_used_first(models: list[Resident], need: int, tenant: str | None,
                                                         over_share: dict[str, int], expected: list[str]) -> None:
    assert to_make_room(models, need, tenant, over_share) == expected


@pytest.fixture
def start_node(redis_url: str, run_dir: Path, shm_node: str) -> Iterator[Callable[[int, float], RunningNode]]:
    """Start a real node with so much shared memory, whose models spill after so many idle seconds."""
    nodes: list[Node] = []

    def start(capacity: int, model_idle_s: float) -> RunningNode:
        config = NodeConfig(node=shm_node, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=run_dir,
                            data_dir=run_dir.parent / "data", shm_capacity=capacity, keep_warm=30,
                            model_idle_s=model_idle_s)
        nodes.append(Node(config))
        addresses = nodes[-1].start()
        return RunningNode(nodes[-1], addresses.http, addresses.grpc, ClusterState(redis_url))

    yield start
    for n in nodes:
        n.stop()


@pytest.fixture
def spilling_node(start_node: Callable[[int, float], RunningNode]) -> RunningNode:
    """A real node whose models spill after MODEL_IDLE_S."""
    return start_node(1 << 30, MODEL_IDLE_S)


def shm_bytes(node: str) -> int:
    """Bytes of the node's shared-memory objects in /dev/shm (not the free buffers its pool keeps
    for a while to recycle: a spilled model's is given back to the system at once)."""
    total = 0
    for path in Path("/dev/shm").glob(f"lifl-{node}-*"):
        if OBJECT_NAME.search(path.name):
            with contextlib.suppress(FileNotFoundError):  # gone since it was listed
                total += path.stat().st_size
    return total


def spilled_counts(node: RunningNode) -> Callable[[], dict[str, float]]:
    def counts() -> dict[str, float]:
        status, _, text = node.request("GET", "/metrics")
        assert status == 200
        return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
                if line.startswith("lifl_models_moved_total{")}
    return counts


@pytest.mark.slow
def test_an_idle_model_leaves_shared_memory_and_comes_back_unchanged(spilling_node: RunningNode) -> None:
    node, name = spilling_node, spilling_node.node.config.node
    gw = Gateway(node.http)
    blob = fmt.encode({"w": np.random.default_rng(1).standard_normal(MB // 4, dtype=np.float32)})
    gw.create_job("j", goal=1)
    assert gw.set_model("j", blob) == 0
    assert gw.model("j") == (0, blob)
    moved = spilled_counts(node)

    # no read, no round: once the gateway gave its reference back and the period passed, it leaves
    wait_for(lambda: shm_bytes(name) < len(blob), what="the idle model to leave /dev/shm")
    assert moved().get("idle") == 1
    assert gw.model("j") == (0, blob)  # from its checkpoint: same version, same bytes
    assert shm_bytes(name) >= len(blob) and moved().get("restored") == 1

    # a round still completes, on a model spilled again meanwhile
    wait_for(lambda: shm_bytes(name) < len(blob), what="the model to spill again")
    update = fmt.encode({"w": np.ones(MB // 4, np.float32)})
    gw.push("j", update, samples=1, base_version=0, client="c1")
    assert gw.wait_for_version("j", after=0, wait_s=60)["version"] == 1
    version, aggregated = gw.model("j")
    assert version == 1 and np.array_equal(fmt.views(aggregated, fmt.parse_layout(aggregated))["w"], np.ones(MB // 4, np.float32))
    wait_for(lambda: shm_bytes(name) < len(blob), what="version 1 to spill once idle")
    assert gw.model("j") == (1, aggregated)
    gw.close()


IDLE_JOBS = 200


@pytest.mark.slow
def test_many_idle_jobs_hold_no_memory_and_weigh_nothing_in_the_nodes_status(spilling_node: RunningNode) -> None:
    node, name = spilling_node, spilling_node.node.config.node
    gw = Gateway(node.http)
    blob = fmt.encode({"w": np.zeros(16 << 10, np.float32)})
    for i in range(IDLE_JOBS):
        gw.create_job(f"idle{i}", goal=1)
        gw.set_model(f"idle{i}", blob)
    wait_for(lambda: shm_bytes(name) == 0, timeout=120, what=f"the {IDLE_JOBS} idle models to leave /dev/shm")

    # the status the node publishes every second (what the controller and gateways read) names
    # only jobs with something going on: its size does not grow with idle jobs
    def published() -> str:
        return node.state.redis.hget(NODES, name)

    wait_for(lambda: not json.loads(published())["jobs"], what="a status without idle jobs")
    idle_size = len(published())
    gw.push("idle7", blob, samples=1, base_version=0, client="c1")
    assert gw.wait_for_version("idle7", after=0, wait_s=60)["version"] == 1
    assert gw.model("idle7")[0] == 1 and gw.model("idle3") == (0, blob)
    wait_for(lambda: shm_bytes(name) == 0 and len(published()) <= idle_size + 64,
             what="the node to be back to holding nothing, and its status to its idle size")
    gw.close()


FULL = 4  # models that fill the node


@pytest.mark.slow
def test_idle_models_spill_least_recently_used_first_when_the_node_is_full(
        start_node: Callable[[int, float], RunningNode]) -> None:
    blobs = [fmt.encode({"w": np.full(MB // 4, i, np.float32)}) for i in range(FULL + 1)]
    node = start_node(FULL * len(blobs[0]), 3600.0)  # never idle long enough: only memory pressure spills
    moved = spilled_counts(node)
    gw = Gateway(node.http)
    for i in range(FULL):
        gw.create_job(f"m{i}", goal=1)
        gw.set_model(f"m{i}", blobs[i])
    assert gw.model("m0") == (0, blobs[0])  # m1 is now the least recently used
    gw.create_job("late", goal=1)
    assert gw.set_model("late", blobs[FULL]) == 0  # the node is full of idle models: m1's spills
    assert moved().get("pressure") == 1
    for i in range(FULL):  # every model reads back unchanged, each spilling the least recently used
        assert gw.model(f"m{i}") == (0, blobs[i])
    assert gw.model("late") == (0, blobs[FULL])
    assert moved().get("pressure") >= 2 and moved().get("restored") >= 2
    gw.close()
