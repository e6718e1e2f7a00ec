"""Rounds across three nodes, each in a network namespace of its own: updates arrive on every node,
partial results cross nodes gateway to gateway over the kernel's TCP stack, the global model is
the float64 FedAvg of exactly the acknowledged updates, every node serves it, and a node that
dies mid-round (or the top's node) neither loses an acknowledged update silently nor counts one
twice."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.client import Gateway, Participant
from lifl.node import netns
from lifl.node.cluster import Cluster, ClusterAddresses, ClusterConfig

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, veth links and a bridge"),
]
PREFIX, SUBNET, STEM = "liflmn", "10.79.0.0/24", "mn"
SHAPE = (1024, 1024)  # 4 MiB of float32: partial sums (8 MiB) overrun socket buffers on their way


def three_nodes(**options) -> Iterator[tuple[Cluster, ClusterAddresses]]:
    base = Path(tempfile.mkdtemp(prefix="lifl-mn-", dir="/tmp"))
    os.chmod(base, 0o755)
    c = Cluster(ClusterConfig(nodes=3, node_stem=STEM, prefix=PREFIX, subnet=SUBNET, run_dir=base / "run",
                              data_dir=base / "data", shm_capacity=256 << 20, keep_warm=30, **options))
    try:
        yield c, c.start()
    finally:
        c.stop()


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, ClusterAddresses]]:
    yield from three_nodes()


@pytest.fixture
def one_instance_each() -> Iterator[tuple[Cluster, ClusterAddresses]]:
    """Nodes that may run one function instance at a time."""
    yield from three_nodes(max_instances=1)


class Clients:
    """One gateway connection per node, and the updates each acknowledged, for the reference."""

    def __init__(self, addresses: ClusterAddresses, job: str, goal: int, **options) -> None:
        self.job = job
        self.gw = {n: Gateway(a.http) for n, a in addresses.nodes.items()}
        self.any = self.gw[f"{STEM}1"]
        self.any.create_job(job, goal, **options)
        self.any.set_model(job, fmt.encode({"w": np.zeros(SHAPE, np.float32)}))
        self.rng = np.random.default_rng(sum(map(ord, job)))
        self.acked: dict[str, list[tuple[np.ndarray, int]]] = {n: [] for n in self.gw}
        self.count = 0

    def push(self, node: str) -> None:
        w = self.rng.standard_normal(SHAPE).astype(np.float32)
        samples = int(self.rng.integers(1, 100))
        self.gw[node].push(self.job, fmt.encode({"w": w}), client=f"c{self.count}", samples=samples, base_version=0)
        self.acked[node].append((w, samples))
        self.count += 1

    def reference(self, nodes: list[str]) -> np.ndarray:
        updates = [u for n in nodes for u in self.acked[n]]
        return sum(w.astype(np.float64) * s for w, s in updates) / sum(s for _, s in updates)

    def wait_version(self, version: int, timeout: float = 90) -> dict:
        wait_for(lambda: self.any.job(self.job)["version"] == version, timeout=timeout, what=f"version {version}")
        return self.any.job(self.job)["last_round"]

    def model_on(self, node: str) -> tuple[int, np.ndarray]:
        version, blob = self.gw[node].model(self.job)
        return version, fmt.views(blob, kernels.validate(blob))["w"]


def metric(gw: Gateway, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in gw.metrics().splitlines() if line.startswith(name))


def test_a_round_spans_three_nodes_and_every_node_serves_the_model(cluster) -> None:
    c, addresses = cluster
    clients = Clients(addresses, "span", goal=9, leaf_fan_in=2)
    nodes = list(clients.gw)
    for i in range(9):
        clients.push(nodes[i % 3])
    last = clients.wait_version(1)
    assert last["outcome"] == "complete" and last["updates"] == 9 and last["nodes"] == {n: 3 for n in nodes}
    assert last["lost"] == {} and last["top"] in nodes
    ref = clients.reference(nodes)
    for node in nodes:  # the top's node serves it from memory, the others fetch it once from there
        version, w = clients.model_on(node)
        assert version == 1 and np.all(np.abs(w - ref) <= 1e-5 * (np.abs(ref) + 1e-3))
    others = [n for n in nodes if n != last["top"]]
    for node in others:  # each non-top node sent its result across once, gateway to gateway
        assert metric(clients.gw[node], 'lifl_partials_forwarded_total{result="delivered"}') == 1
        assert metric(clients.gw[node], 'lifl_model_replicas_total{source="gateway"}') == 1
    assert metric(clients.gw[last["top"]], 'lifl_partials_received_total{result="accepted"}') == 2
    for node in nodes:  # the bytes crossed the node's veth link
        assert int(Path(f"/sys/class/net/{addresses.nodes[node].host_end}/statistics/tx_bytes").read_text()) > 0


@pytest.mark.parametrize("nodes", ["cluster", "one_instance_each"])
def test_rounds_of_two_updates_per_node_complete_whichever_task_takes_the_warm_instance(
        nodes: str, request: pytest.FixtureRequest) -> None:
    """Two updates per node: each node runs a leaf and then its middle on its one warm instance.
    On the top's node, the other nodes' partials may start the top there first, and the top
    waits for that middle: the middle must not wait for the top's instance (it did, and the
    round stalled now and then), and a node that may run one instance gives it to the middle
    first. Several jobs, each a new race."""
    c, addresses = request.getfixturevalue(nodes)
    for attempt in range(5):
        clients = Clients(addresses, f"pairs{attempt}", goal=6, leaf_fan_in=2)
        nodes = list(clients.gw)
        for i in range(6):
            clients.push(nodes[i % 3])
        last = clients.wait_version(1)
        assert last["outcome"] == "complete" and last["nodes"] == {n: 2 for n in nodes}
        version, w = clients.model_on(last["top"])
        ref = clients.reference(nodes)
        assert version == 1 and np.all(np.abs(w - ref) <= 1e-5 * (np.abs(ref) + 1e-3))


def test_a_robust_strategy_reads_every_nodes_updates(cluster) -> None:
    """The top's median reads the updates acknowledged on the other nodes (from the checkpoint
    store they were written behind to), not just their nodes' sums."""
    c, addresses = cluster
    clients = Clients(addresses, "median", goal=6, leaf_fan_in=2, strategy={"name": "median"})
    nodes = list(clients.gw)
    for i in range(6):
        clients.push(nodes[i % 3])
    last = clients.wait_version(1)
    assert last["nodes"] == {n: 2 for n in nodes} and last["strategy"] == {"name": "median"}
    everything = np.stack([w for n in nodes for w, _ in clients.acked[n]])
    version, w = clients.model_on(last["top"])
    assert version == 1
    np.testing.assert_allclose(w, np.median(everything.astype(np.float64), axis=0), rtol=1e-6, atol=1e-7)


def test_fixed_point_rounds_are_bit_identical_however_the_updates_spread_over_nodes(cluster) -> None:
    """Integer partial sums cross nodes as they are: the same updates pushed to three nodes or
    to one install the same bits."""
    c, addresses = cluster
    fixed_point = {"frac_bits": 20, "width": 64}
    spread = Clients(addresses, "fp-spread", goal=6, leaf_fan_in=2, fixed_point=fixed_point)
    one = Clients(addresses, "fp-one", goal=6, leaf_fan_in=3, fixed_point=fixed_point)
    one.rng = np.random.default_rng(sum(map(ord, "fp-spread")))  # the same updates, in the same order
    nodes = list(spread.gw)
    for i in range(6):
        spread.push(nodes[i % 3])
        one.push(nodes[0])
    assert spread.wait_version(1)["nodes"] == {n: 2 for n in nodes}
    one.wait_version(1)
    assert bytes(spread.gw[nodes[0]].model("fp-spread")[1]) == bytes(one.gw[nodes[0]].model("fp-one")[1])


def test_any_gateway_assigns_clients_and_the_sdk_follows(cluster) -> None:
    c, addresses = cluster
    clients = Clients(addresses, "assign", goal=4)
    node_of = {}
    for i, node in enumerate(clients.gw):  # every gateway answers, with the same plan
        a = clients.gw[node].assignment("assign", f"p{i}")
        node_of[f"p{i}"] = a["node"]
        assert a["http"] == addresses.nodes[a["node"]].http and a["round"] == 0
    assert len(set(node_of.values())) == 1  # BestFit: capacity 20 holds the whole round on one node
    trainers = [Participant(addresses.nodes[f"{STEM}3"].http, "assign", f"p{i}") for i in range(4)]
    for p in trainers:  # bootstrapped on node 3, each sends where it was assigned
        assert p.run_round(lambda state, version: ({"w": state["w"] + 1.0}, 5)).outcome == "accepted"
    last = clients.wait_version(1)
    assert last["nodes"] == {node_of["p0"]: 4}
    for p in trainers:
        p.close()


def test_a_node_killed_mid_round_loses_what_it_acknowledged_and_the_round_completes(cluster) -> None:
    c, addresses = cluster
    clients = Clients(addresses, "kill", goal=6, leaf_fan_in=2)
    n1, n2, n3 = clients.gw
    for node in (n1, n1, n2, n2, n3):
        clients.push(node)
    c.kill_node(n3)
    wait_for(lambda: clients.any.job("kill")["round"]["lost"] == {n3: 1}, timeout=60, what="the loss noticed")
    status = clients.any.job("kill")["round"]
    assert status["received"] == 4 and status["nodes"][n3] == 0  # its slot reopened
    clients.push(n1)
    clients.push(n2)
    last = clients.wait_version(1)
    assert (last["updates"], last["lost"], last["nodes"]) == (6, {n3: 1}, {n1: 3, n2: 3, n3: 0})
    ref = clients.reference([n1, n2])  # exactly the survivors' acknowledged updates, each once
    for node in (n1, n2):
        version, w = clients.model_on(node)
        assert version == 1 and np.all(np.abs(w - ref) <= 1e-5 * (np.abs(ref) + 1e-3))


def test_when_the_tops_node_dies_the_round_moves_its_top_and_completes(cluster) -> None:
    c, addresses = cluster
    clients = Clients(addresses, "top", goal=6, leaf_fan_in=2)
    n1, n2, n3 = clients.gw
    for node in (n3, n3, n3, n1, n1):
        clients.push(node)
    frozen = netns.namespace_pids(addresses.nodes[n3].namespace)
    for pid in frozen:  # n3 hangs: it will host the top (most updates) but never finish it
        os.kill(pid, signal.SIGSTOP)
    try:
        clients.push(n2)  # the goal: the round closes with n3 as its top
        wait_for(lambda: clients.any.job("top")["round"]["top"] == n3, timeout=30, what="the top placed on n3")
        last = clients.wait_version(1)
        assert last["lost"] == {n3: 3} and last["top"] == n1 and last["outcome"] == "partial"
        assert last["nodes"] == {n1: 2, n2: 1, n3: 0} and last["updates"] == 3
        ref = clients.reference([n1, n2])
        version, w = clients.model_on(n2)
        assert version == 1 and np.all(np.abs(w - ref) <= 1e-5 * (np.abs(ref) + 1e-3))
    finally:
        c.kill_node(n3)


def test_queries_compute_where_the_updates_are_or_read_them_through_the_shared_store(cluster) -> None:
    c, addresses = cluster
    clients = Clients(addresses, "kept", goal=6, leaf_fan_in=2, retention={"updates": 1, "models": 2, "history": 1})
    nodes = list(clients.gw)
    for i in range(6):
        clients.push(nodes[i % 3])
    clients.wait_version(1)
    first = clients.gw[nodes[0]]
    update_bytes = SHAPE[0] * SHAPE[1] * 4

    # cosine to the round's change decomposes: each node computes its clients' part where they are
    split = first.query("kept", {"workload": "cosine"})
    assert split["result"]["clients"] == [f"c{i}" for i in range(6)] and sorted(split["nodes"]) == sorted(nodes)
    assert split["data"]["bytes_between_nodes"] < 64 << 10  # numbers crossed, not updates

    # a similarity matrix is pairwise: node 1 reads the other nodes' updates from the shared store
    matrix = first.query("kept", {"workload": "cosine", "against": "clients"})
    assert matrix["node"] == nodes[0] and matrix["data"]["store"] >= 4
    assert matrix["data"]["bytes_fetched"] >= 4 * update_bytes
    assert np.allclose(matrix["result"]["norms"], split["result"]["norms"], rtol=1e-6)
    again = first.query("kept", {"workload": "cosine", "against": "clients"})  # now kept here too
    assert again["data"]["store"] == 0 and again["result"] == matrix["result"]
