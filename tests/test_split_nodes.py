"""A sharded job on three nodes, each in a network namespace of its own, holds each node's
shards there only (docs/sharding.md, "Across nodes"): clients send each node its part of every
update, each node aggregates its own shards, the version installs once every node's part is
durable, the SDK reads the model back from the parts, and any gateway serves it whole."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import namespaced_cluster, wait_for
from lifl import format as fmt
from lifl import kernels, shards
from lifl.client import Gateway, SplitJob
from lifl.errors import LiflError
from lifl.node.cluster import Cluster, ClusterAddresses
from test_strategies_e2e import Reference

pytestmark = [
    pytest.mark.slow, pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates network namespaces, veth links and a bridge"),
]
PREFIX, SUBNET, STEM = "liflsp", "10.82.0.0/24", "sp"
SHAPES = {"a": (300, 257), "b": (1000,), "c": (64, 33, 7)}  # uneven tensors, cut by elements into 6 shards
GOAL = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, ClusterAddresses]]:
    with namespaced_cluster(3, STEM, PREFIX, SUBNET) as running:
        yield running


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def data_section(blob: bytes | bytearray) -> memoryview:
    """The data section of a blob."""
    return memoryview(blob)[kernels.validate(blob).data_start:]


def close(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> bool:
    return all(np.all(np.abs(got[n] - ref[n]) <= 1e-5 * (np.abs(ref[n]) + 1e-3)) for n in ref)


def test_each_node_holds_its_part_and_rounds_install_the_fedavg_of_whole_updates(cluster) -> None:
    c, addresses = cluster
    gw = {n: Gateway(a.http) for n, a in addresses.nodes.items()}
    first = gw[f"{STEM}1"]
    first.create_job("split", GOAL, shards=6, leaf_fan_in=2)
    rng = np.random.default_rng(7)
    first.set_model("split", fmt.encode(dict(reversed(model(rng).items()))))  # any tensor order
    doc = first.parts("split")
    assert [p["node"] for p in doc["parts"]] == sorted(gw) and doc["cut"] == [6, "element"]
    assert doc["parts"][0]["data"][0] == 0 and all(a["data"][1] == b["data"][0] for a, b in zip(doc["parts"], doc["parts"][1:]))
    job = SplitJob(first, "split")
    try:
        for version in range(2):
            updates = [(model(rng), int(rng.integers(1, 50))) for _ in range(GOAL)]
            for k, (update, samples) in enumerate(updates):
                job.push(fmt.encode(update), samples=samples, base_version=version, client=f"c{k}")
            wait_for(lambda v=version: first.job("split")["version"] == v + 1, timeout=120, what=f"version {version + 1}")
            last = first.job("split")["last_round"]
            assert last["outcome"] == "complete" and last["updates"] == GOAL
            assert last["nodes"] == {n: GOAL for n in gw}  # every node took a part of every update
            total = sum(s for _, s in updates)
            ref = {n: sum(u[n].astype(np.float64) * s for u, s in updates) / total for n in SHAPES}
            got_version, blob = job.model()
            assert got_version == version + 1 and close(fmt.views(blob, kernels.validate(blob)), ref)
            parts = {p.node: p for p in job.parts}
            for node, g in gw.items():  # each node holds its part only, and every gateway serves the model whole
                part_version, part = g.part("split")
                layout = kernels.validate(part)
                assert part_version == version + 1 and layout.spec() == parts[node].spec
                assert bytes(part[layout.data_start:]) == bytes(data_section(blob)[parts[node].data_begin:parts[node].data_end])
                served_version, served = g.model("split")
                assert served_version == version + 1 and bytes(served) == bytes(blob), node
    finally:
        job.close()


def test_an_update_with_a_part_missing_does_not_count_and_a_whole_update_is_refused(cluster) -> None:
    c, addresses = cluster
    gw = {n: Gateway(a.http) for n, a in addresses.nodes.items()}
    first = gw[f"{STEM}1"]
    first.create_job("partial", 2, shards=3)
    rng = np.random.default_rng(8)
    first.set_model("partial", fmt.encode(model(rng)))
    with pytest.raises(LiflError) as refused:  # a whole update to one node: not its part
        first.push("partial", fmt.encode(model(rng)), samples=1, base_version=0, client="whole")
    assert refused.value.status == 422, refused.value
    job = SplitJob(first, "partial")
    try:
        part = job.parts[0]
        gw[part.node].push("partial", shards.part_blob(fmt.encode(model(rng)), part), samples=1, base_version=0,
                           client="half")  # one part of its update: acknowledged as a part, not as an update
        status = first.job("partial")
        assert status["version"] == 0 and status["round"]["received"] == 0 and status["round"]["in_progress"] == 1
        assert status["round"]["nodes"] == {part.node: 1}
    finally:
        job.close()


def test_a_stateful_strategy_steps_each_nodes_shards_like_the_whole_model(cluster) -> None:
    """FedAdam's moments live with the shards they belong to: each node steps its part and keeps
    its part of the state, and the model equals the pure step of the whole model round after round."""
    c, addresses = cluster
    first = Gateway(addresses.nodes[f"{STEM}1"].http)
    first.create_job("adam", GOAL, shards=6, strategy={"name": "fedadam"})
    rng = np.random.default_rng(9)
    initial = model(rng)
    first.set_model("adam", fmt.encode(initial))
    ref = Reference(first.job("adam"), {k: v.astype(np.float32) for k, v in initial.items()})
    with SplitJob(first, "adam") as job:
        for version in range(3):
            updates = [(f"c{k}", model(rng), int(rng.integers(1, 50)), version) for k in range(GOAL)]
            for client, tensors, samples, base in updates:
                job.push(fmt.encode(tensors), samples=samples, base_version=base, client=client)
            wait_for(lambda v=version: first.job("adam")["version"] == v + 1, timeout=120, what=f"version {version + 1}")
            expected = ref.round(updates)
            got_version, blob = job.model()
            got = fmt.views(blob, kernels.validate(blob))
            assert got_version == version + 1
            for name in expected:
                assert np.allclose(got[name], expected[name], rtol=1e-6, atol=1e-7), name


def test_parts_stream_from_update_files_in_any_tensor_order(cluster, tmp_path: Path) -> None:
    """``SplitJob.push_file``: each node's part is sent from the file's ranges (sendfile), the
    update never read into memory; a file laid out in another tensor order sends the same parts."""
    c, addresses = cluster
    first = Gateway(addresses.nodes[f"{STEM}1"].http)
    first.create_job("files", 2, shards=5)
    rng = np.random.default_rng(11)
    first.set_model("files", fmt.encode(model(rng)))
    updates = [(model(rng), 3), (model(rng), 5)]
    with SplitJob(first, "files") as job:
        for k, (update, samples) in enumerate(updates):
            path = tmp_path / f"u{k}.safetensors"
            path.write_bytes(fmt.encode(update if k == 0 else dict(reversed(update.items()))))
            answer = job.push_file(path, samples=samples, base_version=0, client=f"f{k}")
            for part in job.parts:  # each node got its part's header and bytes, once
                assert answer["parts"][part.node]["sent_bytes"] == len(fmt.spec_header(part.spec)) + part.nbytes
        wait_for(lambda: first.job("files")["version"] == 1, timeout=120, what="version 1")
        ref = {n: sum(u[n].astype(np.float64) * s for u, s in updates) / 8 for n in SHAPES}
        version, blob = job.model()
        assert version == 1 and close(fmt.views(blob, kernels.validate(blob)), ref)


def test_a_node_killed_mid_round_loses_the_round_on_every_node_and_says_so(cluster) -> None:
    """(Last: it kills a node of the module's cluster.) Its parts of the round's updates are
    gone, so no node installs the round: it is recorded as interrupted, naming the node, and
    the version stays."""
    c, addresses = cluster
    first = Gateway(addresses.nodes[f"{STEM}1"].http)
    first.create_job("killed", 3, shards=3)
    rng = np.random.default_rng(10)
    first.set_model("killed", fmt.encode(model(rng)))
    with SplitJob(first, "killed") as job:
        for k in range(2):
            job.push(fmt.encode(model(rng)), samples=1, base_version=0, client=f"c{k}")
        assert first.job("killed")["round"]["received"] == 2
        c.kill_node(f"{STEM}3")
        wait_for(lambda: first.job("killed")["last_round"] is not None, timeout=120, what="the round's record")
    status = first.job("killed")
    last = status["last_round"]
    assert last["outcome"] == "interrupted" and f"{STEM}3 holding shards" in last["reason"], last
    assert last["new_version"] is None and status["version"] == 0 and status["round"]["id"] == 1
