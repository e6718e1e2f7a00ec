"""Queries over retained updates (FLStore's non-training workloads) through a real node: what the
retention policy keeps, where queries find it, and who may ask."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from conftest import RunningNode, auth, wait_for
from lifl import format as fmt
from lifl.net import lifl_pb2 as pb

SHAPES = {"conv.weight": (16, 3, 3, 3), "fc.weight": (10, 64), "fc.bias": (10,)}
CLIENTS = 4


def tensors(rng: np.random.Generator, scale: float = 1.0, base: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    out = {k: (base[k] if base else 0) + scale * rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    out["bn.num_batches_tracked"] = np.array(3, np.int64)
    return {k: np.asarray(v, dtype=np.int64 if k.endswith("tracked") else np.float32) for k, v in out.items()}


def flat(t: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([t[k].astype(np.float64).ravel() for k in SHAPES])


def run_round(node: RunningNode, job: str, base: dict[str, np.ndarray], rng: np.random.Generator, version: int,
              scales: list[float] | None = None) -> list[dict[str, np.ndarray]]:
    common = tensors(rng, 0.1, base)  # the direction honest clients agree on, plus noise of their own
    updates = [{**tensors(rng, (scales or [0.01] * CLIENTS)[i], common), "bn.num_batches_tracked": common["bn.num_batches_tracked"]}
               for i in range(CLIENTS)]
    for i, u in enumerate(updates):
        status, reply = node.push(job, fmt.encode(u), client=f"c{i}", samples=i + 1, version=version)
        assert status == 202, reply
    wait_for(lambda: node.state.version(job) == version + 1, what=f"version {version + 1}")
    return updates


def create(node: RunningNode, job: str, retention: dict[str, Any], **extra: Any) -> dict[str, np.ndarray]:
    status, reply = node.json("POST", "/v1/jobs", {"job": job, "goal": CLIENTS, "retention": retention, **extra})
    assert status == 201, reply
    assert reply["retention"]["updates"] == retention.get("updates", 0)
    base = tensors(np.random.default_rng(1))
    assert node.json("PUT", f"/v1/jobs/{job}/model", fmt.encode(base))[0] == 201
    return base


def query(node: RunningNode, job: str, body: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    return node.json("POST", f"/v1/jobs/{job}/queries", body, auth(token) if token else None)


def cosine_reference(base: dict[str, np.ndarray], updates: list[dict[str, np.ndarray]]) -> np.ndarray:
    weights = np.arange(1, CLIENTS + 1, dtype=np.float64)
    deltas = [flat(u) - flat(base) for u in updates]
    change = sum(w * d for w, d in zip(weights, deltas)) / weights.sum()
    return np.array([d @ change / np.linalg.norm(d) / np.linalg.norm(change) for d in deltas])


@pytest.mark.slow
def test_retained_updates_answer_queries_from_memory_then_from_the_store_after_a_policy_change(node: RunningNode) -> None:
    rng = np.random.default_rng(7)
    base = create(node, "q", {"updates": 1, "models": 2, "history": 2})
    updates = run_round(node, "q", base, rng, 0)

    status, answer = query(node, "q", {"workload": "cosine"})
    assert status == 200, answer
    assert answer["round"] == 0 and answer["version"] == 0
    assert answer["result"]["clients"] == [f"c{i}" for i in range(CLIENTS)]
    np.testing.assert_allclose(answer["result"]["cosine"], cosine_reference(base, updates), rtol=1e-4)
    assert answer["data"] == {"objects": CLIENTS + 2, "memory": CLIENTS + 2, "store": 0, "bytes_fetched": 0}

    # the policy changes at run time: updates leave memory but stay queryable (written behind)
    assert node.json("PUT", "/v1/jobs/q/retention", {"models": 2, "history": 2})[0] == 200
    wait_for(lambda: node.json("GET", "/v1/jobs/q/retention")[1]["stats"]["evictions"] >= CLIENTS,
             what="the updates to leave memory")
    status, again = query(node, "q", {"workload": "cosine"})
    assert status == 200 and again["result"] == answer["result"]
    assert again["data"]["store"] == CLIENTS and again["data"]["bytes_fetched"] > 0

    # widened again: they are fetched back into memory ahead of the next query
    assert node.json("PUT", "/v1/jobs/q/retention", {"updates": 1, "models": 2, "history": 2})[0] == 200
    wait_for(lambda: node.json("GET", "/v1/jobs/q/retention")[1]["stats"]["bytes_retained"]["update"] > 0,
             what="the updates to come back")
    status, third = query(node, "q", {"workload": "cosine"})
    assert third["data"]["store"] == 0 and third["result"] == answer["result"]
    # the nodes publish their counts every second
    wait_for(lambda: node.json("GET", "/v1/jobs/q/retention")[1]["stats"]["hits"] == 2 * (CLIENTS + 2) + 2,
             what="the hits to be published")
    stats = node.json("GET", "/v1/jobs/q/retention")[1]["stats"]
    assert stats["misses"] == CLIENTS and stats["hit_rate"] == pytest.approx(14 / 18)

    # rounds move on: round 0 leaves the history after two more rounds, and says so
    base1 = node.state.version("q")
    assert base1 == 1
    run_round(node, "q", updates[0], rng, 1)
    run_round(node, "q", updates[0], rng, 2)
    wait_for(lambda: query(node, "q", {"workload": "cosine", "round": 0})[0] == 404, what="round 0 to be forgotten")
    status, error = query(node, "q", {"workload": "cosine", "round": 0})
    assert error["error"]["code"] == "not_retained"
    assert query(node, "q", {"workload": "cosine", "round": 2})[0] == 200


@pytest.mark.slow
def test_filter_flags_an_outlier_and_excludes_it_from_the_next_rounds(node: RunningNode) -> None:
    rng = np.random.default_rng(3)
    base = create(node, "f", {"updates": 1, "history": 1})
    run_round(node, "f", base, rng, 0, scales=[0.01, 0.01, 0.01, 5.0])
    status, answer = query(node, "f", {"workload": "filter", "exclude": True})
    assert status == 200, answer
    assert [s["client"] for s in answer["result"]["suspects"]] == ["c3"]
    assert answer["result"]["excluded"] == ["c3"]
    status, refused = node.push("f", fmt.encode(tensors(rng, 0.1, base)), client="c3", version=1)
    assert (status, refused["error"]["code"]) == (403, "client_excluded")
    assert node.push("f", fmt.encode(tensors(rng, 0.1, base)), client="c0", version=1)[0] == 202
    assert node.json("GET", "/v1/jobs/f/retention")[1]["excluded_clients"] == ["c3"]


@pytest.mark.slow
def test_workload_errors_and_other_tenants(node: RunningNode) -> None:
    rng = np.random.default_rng(5)
    base = create(node, "e", {"updates": 1, "history": 1})
    run_round(node, "e", base, rng, 0)
    cases = [
        ({"workload": "astrology"}, 400, "unknown_workload"),
        ({}, 400, "bad_query"),
        ({"workload": 3}, 400, "bad_query"),
        ({"workload": "cosine", "round": 7}, 404, "not_retained"),
        ({"workload": "cosine", "round": -1}, 400, "bad_query"),
        ({"workload": "cosine", "round": "0"}, 400, "bad_query"),
        ({"workload": "cosine", "against": "moon"}, 400, "bad_query"),
        ({"workload": "cluster", "k": 0}, 400, "bad_query"),
        ({"workload": "provenance", "tensor": "nope"}, 400, "no_such_tensor"),
        ({"workload": "inference", "inputs": [[[[0.0] * 8] * 8]]}, 400, "no_architecture"),
        ({"workload": "reputation", "round": 0}, 400, "bad_query"),
        ({"workload": "cosine", "scope": "node"}, 400, "bad_query"),  # set between nodes only
        ({"workload": "cosine", "rounds": [0]}, 400, "bad_query"),
    ]
    for body, status, code in cases:
        got, error = query(node, "e", body)
        assert (got, error["error"]["code"]) == (status, code), body
    assert node.request("POST", "/v1/jobs/e/queries", b"[1,2]")[0] == 400
    assert node.request("POST", "/v1/jobs/e/queries", b"{not json")[0] == 400
    assert node.request("POST", "/v1/jobs/e/queries", b"x" * ((8 << 20) + 1))[0] == 413
    assert node.json("PUT", "/v1/jobs/e/retention", {"updates": -1})[1]["error"]["code"] == "bad_retention"
    assert query(node, "nope", {"workload": "cosine"})[0] == 404

    # another tenant does not see the job; the job's own clients may not read its updates
    other = node.json("POST", "/v1/tokens", {"role": "tenant", "tenant": "other"})[1]["token"]
    assert query(node, "e", {"workload": "cosine"}, other)[0] == 404
    assert node.json("GET", "/v1/jobs/e/retention", headers=auth(other))[0] == 404
    client = node.json("POST", "/v1/tokens", {"role": "client", "tenant": "default", "job": "e", "client": "c0"})[1]["token"]
    assert query(node, "e", {"workload": "cosine"}, client)[0] == 403
    assert node.json("PUT", "/v1/jobs/e/retention", {}, headers=auth(client))[0] == 403
    # the route between nodes: a node's part of a split query, for nodes (and the operator) only
    tenant = node.json("POST", "/v1/tokens", {"role": "tenant", "tenant": "default"})[1]["token"]
    part = {"workload": "cosine", "scope": "node", "rounds": [0]}
    assert node.json("POST", "/v1/internal/jobs/e/queries", part, headers=auth(tenant))[0] == 403
    status, answer = node.json("POST", "/v1/internal/jobs/e/queries", part)
    assert status == 200 and [c["client"] for c in answer["partial"]["rounds"][0]["clients"]] == [f"c{i}" for i in range(CLIENTS)]
    assert node.json("POST", "/v1/internal/jobs/e/queries", {"workload": "cosine"})[1]["error"]["code"] == "bad_query"
    assert node.json("POST", "/v1/internal/jobs/e/queries", {**part, "rounds": [5]})[1]["error"]["code"] == "not_retained"


@pytest.mark.slow
def test_every_workload_over_grpc(node: RunningNode) -> None:
    rng = np.random.default_rng(11)
    base = create(node, "g", {"updates": 2, "models": 3, "history": 2})
    first = run_round(node, "g", base, rng, 0)
    run_round(node, "g", first[1], rng, 1)
    stub = node.grpc_stub()
    for body in ({"workload": "cosine", "against": "clients"}, {"workload": "filter"}, {"workload": "cluster", "k": 2},
                 {"workload": "reputation"}, {"workload": "provenance", "tensor": "fc.bias", "round": 0}):
        reply = json.loads(stub.Query(pb.QueryRequest(job="g", query_json=json.dumps(body))).json)
        assert reply["workload"] == body["workload"] and reply["data"]["store"] == 0, reply
        if body["workload"] == "reputation":
            assert reply["rounds"] == [0, 1] and set(reply["result"]["clients"]) == {f"c{i}" for i in range(CLIENTS)}
        if body["workload"] == "provenance":
            shares = [c["share"] for c in reply["result"]["tensor"]["contributions"]]
            assert abs(sum(shares) - 1) < 1e-4
    policy = json.loads(stub.SetRetention(pb.SetRetentionRequest(job="g", policy_json='{"models": 1}')).json)
    assert policy["policy"]["models"] == 1
    assert json.loads(stub.GetRetention(pb.GetRetentionRequest(job="g")).json)["policy"]["history"] == 0


@pytest.fixture
def start_node(redis_url: str, run_dir, shm_node: str):
    """Start a node with these options (stopped after the test)."""
    from lifl.node.supervisor import Node, NodeConfig
    from lifl.state import ClusterState

    nodes = []

    def start(**options: Any) -> RunningNode:
        config = NodeConfig(node=shm_node, http="127.0.0.1:0", grpc="127.0.0.1:0", redis=redis_url, run_dir=run_dir,
                            data_dir=run_dir.parent / "data", keep_warm=30, **{"shm_capacity": 1 << 30, **options})
        n = Node(config)
        addresses = n.start()
        nodes.append(n)
        return RunningNode(n, addresses.http, addresses.grpc, ClusterState(redis_url))

    yield start
    for n in nodes:
        n.stop()


def metric(node: RunningNode, name: str, **labels: str) -> float:
    text = node.request("GET", "/metrics")[2].decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and want in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_a_tenant_over_its_budget_keeps_the_most_recently_used_and_fetches_back_the_rest(start_node) -> None:
    update_bytes = len(fmt.encode(tensors(np.random.default_rng(0))))
    node = start_node(retain_budget=3 * update_bytes)
    rng = np.random.default_rng(9)
    base = create(node, "b", {"updates": 1, "models": 1, "history": 1})
    updates = run_round(node, "b", base, rng, 0)
    wait_for(lambda: metric(node, "lifl_retention_evictions_total", job="b", reason="budget") >= 3,
             what="the budget to evict")
    status, answer = query(node, "b", {"workload": "cosine"})
    assert status == 200 and answer["data"]["store"] >= 1
    np.testing.assert_allclose(answer["result"]["cosine"], cosine_reference(base, updates), rtol=1e-4)


@pytest.mark.slow
def test_retained_updates_give_way_to_the_next_rounds_when_memory_is_short(start_node) -> None:
    rng = np.random.default_rng(4)
    update_bytes = len(fmt.encode(tensors(rng)))
    # a round needs about 11 updates' worth (inputs, float64 accumulators, the next model): three
    # rounds retained would not fit beside the next one
    node = start_node(shm_capacity=16 * update_bytes, pool_limit=0)
    base = create(node, "p", {"updates": 3, "models": 3, "history": 3})
    for version in range(4):
        base = run_round(node, "p", base, rng, version)[0]
    assert metric(node, "lifl_retention_evictions_total", job="p", reason="pressure") > 0
    assert metric(node, "lifl_admission_refusals_total", job="p") == 0
    for round_id in range(1, 4):  # what pressure evicted is fetched back: nothing fails
        status, answer = query(node, "p", {"workload": "cosine", "round": round_id})
        assert status == 200, answer


@pytest.mark.slow
def test_inference_with_a_retained_version_matches_torch(node: RunningNode) -> None:
    torch = pytest.importorskip("torch")
    from lifl.client import to_blob
    from lifl.models import make_model
    from lifl.workload import load_digits_split

    model = make_model("cnn", seed=3)
    status, reply = node.json("POST", "/v1/jobs", {"job": "inf", "goal": 1, "architecture": "cnn",
                                                   "retention": {"models": 2}})
    assert status == 201, reply
    assert node.json("PUT", "/v1/jobs/inf/model", bytes(to_blob(model.state_dict())))[0] == 201
    images = load_digits_split(4, 0.5, 0).test[0][:5]
    model.eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).argmax(1).tolist()
    status, answer = query(node, "inf", {"workload": "inference", "version": 0, "inputs": images.tolist()})
    assert status == 200, answer
    assert answer["result"]["predictions"] == expected and answer["version"] == 0
    assert answer["data"] == {"objects": 1, "memory": 1, "store": 0, "bytes_fetched": 0}

    status, error = query(node, "inf", {"workload": "inference", "inputs": [[[0.0] * 7] * 8]})
    assert (status, error["error"]["code"]) == (400, "bad_inputs")
    assert "8" in error["error"]["message"]
    status, error = query(node, "inf", {"workload": "inference", "version": 1, "inputs": images.tolist()})
    assert (status, error["error"]["code"]) == (404, "not_retained")


@pytest.mark.slow
def test_concurrent_queries_all_get_answers_and_instances_are_reused_warm(node: RunningNode) -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(21)
    base = create(node, "c", {"updates": 1, "history": 1})
    run_round(node, "c", base, rng, 0)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: query(node, "c", {"workload": "cluster", "k": 2}), range(6)))
    assert all(status == 200 for status, _ in answers)
    assert all(a["result"] == answers[0][1]["result"] for _, a in answers)  # seeded: the same clusters
    warm = metric(node, "lifl_aggregator_starts_total", kind="warm")
    assert query(node, "c", {"workload": "cosine"})[0] == 200
    assert metric(node, "lifl_aggregator_starts_total", kind="warm") == warm + 1  # an idle instance took it
