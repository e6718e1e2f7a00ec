"""Integration: a real node aggregates updates arriving over HTTP and gRPC at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import RunningNode, wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.net import lifl_pb2 as pb

SHAPES = {"conv1.weight": (64, 3, 7, 7), "fc.weight": (10, 512), "fc.bias": (10,), "bn.running_mean": (64,)}


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    tensors["bn.num_batches_tracked"] = np.array(int(rng.integers(0, 1000)), np.int64)
    return tensors


def grpc_chunks(meta: pb.UpdateMeta, blob: bytes, size: int = 64 << 10):
    yield pb.UpdateChunk(meta=meta)
    for i in range(0, len(blob), size):
        yield pb.UpdateChunk(data=bytes(blob[i : i + size]))


@pytest.mark.slow
def test_twenty_updates_over_http_and_grpc_aggregate_into_version_one(node: RunningNode) -> None:
    rng = np.random.default_rng(2026)
    assert node.json("POST", "/v1/jobs", {"job": "resnet", "goal": 20})[0] == 201
    status, reply = node.json("PUT", "/v1/jobs/resnet/model", fmt.encode(model(rng)))
    assert (status, reply) == (201, {"version": 0})

    updates = [model(rng) for _ in range(20)]
    samples = [int(s) for s in rng.integers(1, 600, 20)]
    stub = node.grpc_stub()
    results: dict[int, object] = {}

    def send(i: int) -> None:
        blob = fmt.encode(updates[i])
        if i % 2:
            meta = pb.UpdateMeta(job="resnet", client=f"c{i}", samples=samples[i], base_version=0)
            results[i] = stub.PushUpdate(grpc_chunks(meta, blob))
        else:
            results[i] = node.push("resnet", blob, client=f"c{i}", samples=samples[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(20))  # a sender that raised left no result
    for i, r in results.items():
        if i % 2:
            assert r.version == 0
        else:
            assert r[0] == 202 and r[1]["version"] == 0

    wait_for(lambda: node.json("GET", "/v1/jobs/resnet")[1]["version"] == 1, what="version 1")
    status, headers, body = node.request("GET", "/v1/jobs/resnet/model")
    assert status == 200 and headers["X-Lifl-Version"] == "1"
    got = fmt.views(body, kernels.validate(body))
    total = sum(samples)
    for name in SHAPES:
        ref = sum(u[name].astype(np.float64) * c for u, c in zip(updates, samples)) / total
        assert np.all(np.abs(got[name] - ref) <= 1e-5 * (np.abs(ref) + 1e-3)), name
    ints = sum(int(u["bn.num_batches_tracked"]) * c for u, c in zip(updates, samples))
    q, r = divmod(ints, total)
    assert int(got["bn.num_batches_tracked"]) == q + (1 if 2 * r > total or (2 * r == total and q % 2) else 0)

    # the same model over gRPC
    chunks = list(stub.GetModel(pb.GetModelRequest(job="resnet")))
    assert chunks[0].meta.version == 1 and chunks[0].meta.size == len(body)
    assert b"".join(c.data for c in chunks) == body

    job = node.json("GET", "/v1/jobs/resnet")[1]
    assert job["last_round"]["updates"] == 20 and job["last_round"]["samples"] == total
    assert {k: job["round"][k] for k in ("id", "version", "received", "in_progress", "aggregated", "rejected", "closed")} == {
        "id": 1, "version": 1, "received": 0, "in_progress": 0, "aggregated": 0, "rejected": {}, "closed": False}
    _, _, metrics = node.request("GET", "/metrics")
    text = metrics.decode()
    assert 'lifl_update_arrivals_total{job="resnet",protocol="http"} 10.0' in text
    assert 'lifl_update_arrivals_total{job="resnet",protocol="grpc"} 10.0' in text
    for needle in ("lifl_bytes_received_total", "lifl_queue_length", "lifl_aggregator_step_seconds_bucket", "lifl_key_handoff_seconds"):
        assert needle in text
