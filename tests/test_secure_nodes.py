"""Secure aggregation across three nodes, each in a network namespace of its own
(docs/secure-aggregation.md): clients follow the cluster's assignment, their masked inputs land on
every node, the nodes' masked partial sums travel to the top's node, and the model installed is
bit for bit the plain fixed-point one, with clients dropping out after sharing too."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import namespaced_cluster, outcomes_in_threads, wait_for
from lifl import format as fmt
from lifl.client import Gateway
from lifl.client.secure import SecureClient, run_secure_round, share_with_peers
from lifl.kernels import validate
from lifl.node.cluster import Cluster, ClusterAddresses

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, veth links and a bridge"),
]
PREFIX, SUBNET, STEM = "liflsa", "10.84.0.0/24", "sa"
SHAPES = {"w": (65, 33), "b": (33,)}
FIXED_POINT = {"frac_bits": 20, "width": 64}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, ClusterAddresses]]:
    with namespaced_cluster(3, STEM, PREFIX, SUBNET) as running:
        yield running


def updates(n: int, seed: int) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    rng = np.random.default_rng(seed)
    return ([{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)],
            [int(c) for c in rng.integers(1, 100, n)])


def model_of(gw: Gateway, job: str) -> dict[str, bytes]:
    blob = bytes(gw.model(job)[1])
    return {k: v.tobytes() for k, v in fmt.views(blob, validate(blob)).items()}


def start(gw: Gateway, job: str, goal: int, **fields: object) -> None:
    gw.create_job(job, goal, fixed_point=FIXED_POINT, leaf_fan_in=2, **fields)
    gw.set_model(job, fmt.encode({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}))


def plain(gw: Gateway, job: str, models: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, bytes]:
    start(gw, job, len(models))
    for i, (m, c) in enumerate(zip(models, samples)):
        gw.push(job, fmt.encode(m), client=f"p{i}", samples=c, base_version=0)
    wait_for(lambda: gw.model(job)[0] == 1, timeout=120, what=f"{job}'s round")
    return model_of(gw, job)


def run_clients(addresses: ClusterAddresses, job: str, models: list[dict[str, np.ndarray]], samples: list[int],
                names: list[str]) -> dict[str, str]:
    """Each client runs every stage of the round with the SDK through the gateway of a node in
    turn, its masked input included (the cluster's placement would put them all on one node)."""
    gateways = [a.http for a in addresses.nodes.values()]
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()

    def client(i: int) -> str:
        gw = Gateway(gateways[i % len(gateways)])
        try:
            run_secure_round(gw, job, names[i], models[i], samples[i], spec, 0)
            return "accepted"
        finally:
            gw.close()

    return outcomes_in_threads(names, client)


def test_a_secure_round_across_three_nodes_installs_the_plain_model(cluster) -> None:
    _, addresses = cluster
    gw = Gateway(next(iter(addresses.nodes.values())).http)
    models, samples = updates(9, seed=21)
    reference = plain(gw, "plain", models, samples)
    start(gw, "secure", 9, secure_aggregation={"stage_timeout_s": 120})
    outcomes = run_clients(addresses, "secure", models, samples, [f"c{i}" for i in range(9)])
    assert set(outcomes.values()) == {"accepted"}, outcomes
    wait_for(lambda: gw.model("secure")[0] == 1, timeout=120, what="the secure round's version")
    assert model_of(gw, "secure") == reference
    last = gw.rounds("secure")[-1]
    assert last["outcome"] == "complete" and last["updates"] == 9
    assert len([n for n, count in last["nodes"].items() if count]) >= 2, last["nodes"]  # masked inputs on several nodes


def test_clients_dropping_after_sharing_across_nodes(cluster) -> None:
    """Two of eight share and go; at the collect deadline the six others' model installs."""
    _, addresses = cluster
    gw = Gateway(next(iter(addresses.nodes.values())).http)
    models, samples = updates(8, seed=22)
    reference = plain(gw, "plain6", models[:6], samples[:6])
    start(gw, "drops", 8, secure_aggregation={"stage_timeout_s": 20, "dropout": 0.3})
    quitters = {name: SecureClient(name) for name in ("q0", "q1")}
    for name, me in quitters.items():
        gw.secure_keys("drops", *me.advertisement(), client=name)

    def share_then_go() -> None:
        wait_for(lambda: gw.secure("drops", "q0")["stage"] != "advertise", timeout=120, what="the share stage")
        for name, me in quitters.items():
            share_with_peers(gw, "drops", me, gw.secure("drops", name), name)

    quitter = threading.Thread(target=share_then_go)
    quitter.start()
    outcomes = run_clients(addresses, "drops", models[:6], samples[:6], [f"c{i}" for i in range(6)])
    quitter.join(120)
    assert set(outcomes.values()) == {"accepted"}, outcomes
    wait_for(lambda: gw.model("drops")[0] == 1, timeout=120, what="the round with two dropouts")
    assert model_of(gw, "drops") == reference
