"""Tenant quotas (lifl.quotas): what the operator may set, and each quota refused at its limit
through the public API (HTTP, gRPC and `lifl quota`), naming the quota."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, auth, wait_for
from lifl import format as fmt
from lifl.client import Gateway
from lifl.errors import BadRequest, QuotaExceeded
from lifl.jobs import JobSpec
from lifl.state import RESERVE_OK, RESERVE_TENANT_ROUNDS, ClusterState, tenant_rounds_key
from lifl.quotas import DEFAULT_JOBS, DEFAULT_ROUNDS, DEFAULT_TOKENS, MAX_BYTES, MAX_COUNT, Quota, parse_limit

MODEL = fmt.encode({"w": np.ones(16, np.float32)})


@pytest.mark.parametrize("body, problem", [
    ([], "must be a JSON object"),
    ("jobs=3", "must be a JSON object"),
    ({"job": 3}, "unknown quota field(s): job"),
    ({"jobs": -1}, "'jobs' must be a whole number from 0 to"),
    ({"jobs": 1.5}, "'jobs' must be a whole number"),
    ({"jobs": "3"}, "'jobs' must be a whole number"),
    ({"jobs": True}, "'jobs' must be a whole number"),
    ({"rounds": MAX_COUNT + 1}, f"from 0 to {MAX_COUNT}"),
    ({"shm_bytes": MAX_BYTES + 1}, f"from 0 to {MAX_BYTES}"),
    ({"retained_bytes": [1]}, "'retained_bytes' must be a whole number"),
])
def test_a_malformed_quota_is_refused_by_name(body: Any, problem: str) -> None:
    with pytest.raises(BadRequest) as e:
        Quota.from_request(body)
    assert e.value.code == "bad_quota" and problem in e.value.message


@pytest.mark.parametrize("body, quota", [
    ({}, Quota()),
    ({"jobs": 0}, Quota(jobs=0)),
    ({"tokens": None, "shm_bytes": 1 << 30}, Quota(tokens=None, shm_bytes=1 << 30)),
    ({"rounds": MAX_COUNT, "retained_bytes": MAX_BYTES}, Quota(rounds=MAX_COUNT, retained_bytes=MAX_BYTES)),
])
def test_a_quota_takes_the_defaults_for_what_it_leaves_out(body: dict[str, Any], quota: Quota) -> None:
    assert Quota.from_request(body) == quota
    assert Quota.from_json(quota.to_json()) == quota
    assert Quota() == Quota(jobs=DEFAULT_JOBS, tokens=DEFAULT_TOKENS, rounds=DEFAULT_ROUNDS, shm_bytes=None, retained_bytes=None)


@pytest.mark.parametrize("annotations, quota", [
    ({}, None),
    ({"lifl.dev/tenants": "a,b", "other/quota-jobs": "3"}, None),  # not lifl's quota annotations
    ({"lifl.dev/quota-jobs": "20"}, Quota(jobs=20)),
    ({"lifl.dev/quota-shm-bytes": "512Mi", "lifl.dev/quota-retained-bytes": "2G"},
     Quota(shm_bytes=512 << 20, retained_bytes=2 * 10**9)),
    ({"lifl.dev/quota-tokens": "none", "lifl.dev/quota-rounds": " 7 "}, Quota(tokens=None, rounds=7)),
])
def test_namespace_annotations_make_a_quota(annotations: dict[str, str], quota: Quota | None) -> None:
    assert Quota.from_annotations(annotations) == quota


@pytest.mark.parametrize("annotations, problem", [
    ({"lifl.dev/quota-jobs": "1.5"}, "annotation lifl.dev/quota-jobs: '1.5' is not a whole number"),
    ({"lifl.dev/quota-jobs": "10Mi"}, "'10Mi' is not a whole number or 'none'"),  # a suffix is for bytes only
    ({"lifl.dev/quota-shm-bytes": "-1"}, "'-1' is not a whole number (with an optional suffix"),
    ({"lifl.dev/quota-shm-bytes": "5Xi"}, "'5Xi' is not a whole number"),
    ({"lifl.dev/quota-shm-bytes": "2Pi"}, "is not a whole number"),
    ({"lifl.dev/quota-jobs": ""}, "'' is not a whole number"),
    ({"lifl.dev/quota-cpus": "2"}, "unknown quota field(s): cpus"),
    ({"lifl.dev/quota-shm-bytes": "2048Ti"}, f"from 0 to {MAX_BYTES}"),
])
def test_a_malformed_annotation_is_refused_by_name(annotations: dict[str, str], problem: str) -> None:
    with pytest.raises(BadRequest) as e:
        Quota.from_annotations(annotations)
    assert problem in e.value.message, e.value.message


def test_a_limit_takes_kubernetes_suffixes_for_bytes() -> None:
    assert [parse_limit("shm_bytes", t, "x") for t in ("1k", "1Ki", "3M", "3Mi", "1G", "1Gi", "1T", "1Ti", "0")] == \
        [1000, 1024, 3 * 10**6, 3 << 20, 10**9, 1 << 30, 10**12, 1 << 40, 0]


def test_the_rounds_quota_counts_rounds_from_their_first_admission_to_their_end(state: ClusterState) -> None:
    state.set_quota("q6", Quota(rounds=1))
    for job in ("q6-a", "q6-b"):
        state.create_job(JobSpec(job, 1, tenant="q6"))
        state.next_round(job, -1, 0)
    assert state.reserve("q6-a", 0, "n1", client="c1")[0] == RESERVE_OK
    assert state.reserve("q6-b", 0, "n1", client="c1")[0] == RESERVE_TENANT_ROUNDS
    state.next_round("q6-a", 0, 1)  # q6-a's round ended
    assert state.reserve("q6-b", 0, "n1", client="c1")[0] == RESERVE_OK
    assert state.tenant_usage("q6")["rounds"] == 1
    assert state.quotas()["q6"] == Quota(rounds=1) and "q6-unset" not in state.quotas()


def test_a_round_whose_end_was_lost_with_redis_does_not_hold_the_quota(state: ClusterState) -> None:
    """Redis may lose its last second (appendfsync everysec): a job left in the set whose round
    holds nothing is dropped once the set is found full."""
    state.set_quota("q7", Quota(rounds=2))
    state.create_job(JobSpec("q7-a", 2, tenant="q7"))
    state.next_round("q7-a", -1, 0)
    state.redis.sadd(tenant_rounds_key("q7"), "q7-ended", "q7-deleted")  # their rounds' ends were lost
    state.create_job(JobSpec("q7-ended", 2, tenant="q7"))
    assert state.reserve("q7-a", 0, "n1", client="c1")[0] == RESERVE_OK
    assert state.redis.smembers(tenant_rounds_key("q7")) == {"q7-a"}


# -- through the API -----------------------------------------------------------------------------------
def tenant_gateway(node: RunningNode, tenant: str, protocol: str = "http") -> Gateway:
    op = Gateway(node.http, token=OPERATOR_TOKEN)
    token = op.create_token("tenant", tenant)["token"]
    op.close()
    return Gateway(node.http if protocol == "http" else node.grpc, protocol, token=token)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ("http", "grpc"))
def test_the_operator_sets_reads_and_resets_a_quota(node: RunningNode, protocol: str) -> None:
    op = Gateway(node.http if protocol == "http" else node.grpc, protocol, token=OPERATOR_TOKEN)
    assert op.quota("q1") == {"tenant": "q1", "quota": json.loads(Quota().to_json()),
                              "usage": {"jobs": 0, "tokens": 0, "rounds": 0}}
    op.create_job("q1-a", 2, tenant="q1")
    got = op.set_quota("q1", {"jobs": 5, "shm_bytes": 1 << 20})
    assert got["quota"] == {**json.loads(Quota().to_json()), "jobs": 5, "shm_bytes": 1 << 20}
    assert got["usage"]["jobs"] == 1
    tenant = tenant_gateway(node, "q1", protocol)
    assert tenant.quota("q1")["quota"]["jobs"] == 5  # a tenant reads its own
    assert op.set_quota("q1", None)["quota"] == json.loads(Quota().to_json())
    with pytest.raises(BadRequest) as e:
        op.set_quota("q1", {"jobs": -2})
    assert e.value.code == "bad_quota"
    with pytest.raises(BadRequest) as e:
        op.quota("Not_A_Tenant")
    assert e.value.code == "bad_tenant"
    op.close()
    tenant.close()


@pytest.mark.slow
def test_malformed_quota_requests_are_refused_and_change_nothing(node: RunningNode) -> None:
    node.state.set_quota("q2", Quota(jobs=4))
    for body in (b"", b"{", b"[]", b'{"jobs": "4"}', b'{"jobs": 4, "cpus": 1}', b'{"jobs": 1e3}', b"null"):
        status, _, raw = node.request("PUT", "/v1/tenants/q2/quota", body, {"Content-Type": "application/json"})
        assert status == 400, (body, raw)
    assert node.state.quota("q2") == Quota(jobs=4)
    stub = node.grpc_stub()
    from lifl.net import lifl_pb2 as pb
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        stub.SetQuota(pb.SetQuotaRequest(tenant="q2", quota_json=""))  # not a reset by omission
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert node.state.quota("q2") == Quota(jobs=4)


@pytest.mark.slow
def test_jobs_and_tokens_past_their_quota_are_refused_naming_it(node: RunningNode) -> None:
    node.state.set_quota("q3", Quota(jobs=2, tokens=2))
    tenant = tenant_gateway(node, "q3")  # its first token
    tenant.create_job("q3-a", 2)
    tenant.create_job("q3-b", 2)
    status, body = node.json("POST", "/v1/jobs", {"job": "q3-c", "goal": 2, "tenant": "q3"})
    assert status == 403 and body["error"] == {
        "code": "quota_exceeded", "quota": "jobs", "limit": 2, "used": 2,
        "message": "tenant 'q3' holds 2 jobs, its quota is 2: delete one of its jobs first"}
    tenant.create_token("client", "q3", job="q3-a")  # the second token
    with pytest.raises(QuotaExceeded) as e:
        tenant.create_token("client", "q3", job="q3-a")
    assert e.value.code == "quota_exceeded" and "2 tokens, its quota is 2" in e.value.message
    op = Gateway(node.http, token=OPERATOR_TOKEN)
    op.create_job("other-a", 2, tenant="q3-other")  # another tenant's count
    op.close()
    node.state.set_quota("q3", Quota(jobs=3))  # raised: room again
    tenant.create_job("q3-c", 2)
    assert node.state.tenant_usage("q3") == {"jobs": 3, "tokens": 2, "rounds": 0}
    tenant.close()


@pytest.mark.slow
def test_a_round_past_the_tenants_rounds_quota_waits_for_one_to_end(node: RunningNode) -> None:
    node.state.set_quota("q4", Quota(rounds=1))
    op = Gateway(node.http, token=OPERATOR_TOKEN)
    for job in ("q4-a", "q4-b"):
        op.create_job(job, 2, tenant="q4")
        op.set_model(job, MODEL)
    assert node.push("q4-a", MODEL, client="c1")[0] == 202  # q4-a's round is in progress
    status, headers, raw = node.request("POST", "/v1/jobs/q4-b/updates", MODEL, {
        "X-Lifl-Client": "c1", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"})
    error = json.loads(raw)["error"]
    assert status == 429 and headers["Retry-After"] == "1" and (error["code"], error["quota"]) == ("quota_exceeded", "rounds")
    assert "tenant 'q4' has as many rounds in progress as its quota (rounds) allows" in error["message"]
    assert node.state.tenant_usage("q4")["rounds"] == 1
    assert node.push("q4-a", MODEL, client="c2")[0] == 202  # the goal: q4-a's round ends
    wait_for(lambda: op.job("q4-a")["version"] == 1, what="q4-a's round installed")
    assert op.push("q4-b", MODEL, client="c1", samples=1, base_version=0) == {"version": 0}
    assert node.state.tenant_usage("q4")["rounds"] == 1  # q4-b's, now
    op.close()


@pytest.mark.slow
def test_lifl_quota_sets_shows_and_resets(node: RunningNode) -> None:
    def lifl(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lifl", "quota", "--gateway", node.http, *argv], text=True,
                              capture_output=True, env={**os.environ, "LIFL_TOKEN": OPERATOR_TOKEN}, timeout=120)

    done = lifl("set", "q5", "--jobs", "7", "--shm-bytes", "64Mi")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["quota"] == {**json.loads(Quota().to_json()), "jobs": 7, "shm_bytes": 64 << 20}
    done = lifl("set", "q5", "--rounds", "none")  # the others are kept
    assert json.loads(done.stdout)["quota"] == {**json.loads(Quota().to_json()), "jobs": 7, "shm_bytes": 64 << 20, "rounds": None}
    assert json.loads(lifl("show", "q5").stdout)["quota"]["jobs"] == 7
    bad = lifl("set", "q5", "--jobs", "7k")
    assert bad.returncode != 0 and "--jobs: '7k' is not a whole number or 'none'" in bad.stderr
    assert node.state.quota("q5").jobs == 7  # unchanged
    assert json.loads(lifl("reset", "q5").stdout)["quota"] == json.loads(Quota().to_json())
    assert node.json("GET", "/v1/tenants/q5/quota", headers=auth())[1]["quota"] == json.loads(Quota().to_json())
