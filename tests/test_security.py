"""Authentication and authorization end to end, on a real node over HTTP and gRPC: every role
against every operation, token lifetimes, one lease and one update per client, sample caps,
and responses that reveal no internal names."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, auth, read_response, wait_for
from lifl import format as fmt
from lifl.auth import CACHE_SECONDS, Tokens
from lifl.client import Gateway
from lifl.errors import BadRequest, Conflict, Forbidden, NotFound, Unauthenticated, Unprocessable
from lifl.gateway.auth_backoff import AUTH_FAILURE_WINDOW_S, MAX_AUTH_FAILURES
from lifl.net import lifl_pb2 as pb

pytestmark = pytest.mark.slow
MODEL = {"w": np.zeros(8, np.float32)}
PROTOCOLS = ("http", "grpc")


def update(value: float) -> bytearray:
    return fmt.encode({"w": np.full(8, value, np.float32)})


class World:
    """Tenants a and b, a job each with a model, and a token for every kind of caller."""

    def __init__(self, node: RunningNode) -> None:
        self.node = node
        op = Gateway(node.http)
        for tenant, job in (("a", "a1"), ("b", "b1")):
            op.create_job(job, 4, tenant=tenant)
            op.set_model(job, fmt.encode(MODEL))
        self.tokens = {
            "operator": OPERATOR_TOKEN,
            "tenant a": op.create_token("tenant", "a")["token"],
            "client a": op.create_token("client", "a", job="a1", client="alice")["token"],
            "tenant b": op.create_token("tenant", "b")["token"],
            "client b": op.create_token("client", "b", job="b1", client="bob")["token"],
            "revoked": (revoked := op.create_token("tenant", "a"))["token"],
            "no token": "",
            "garbage": "lifl_0123456789abcdef_" + "0" * 64,
        }
        op.revoke_token(revoked["id"])
        op.close()

    def gateway(self, who: str, protocol: str) -> Gateway:
        address = self.node.http if protocol == "http" else self.node.grpc
        return Gateway(address, protocol, token=self.tokens[who])


CALLERS = ("operator", "tenant a", "client a", "tenant b", "client b", "revoked", "no token", "garbage")
OPERATIONS: dict[str, Callable[[Gateway], Any]] = {
    "create job in a": lambda g: g.create_job(f"new-{time.monotonic_ns()}", 2, tenant="a"),
    "read job a1": lambda g: g.job("a1"),
    "read rounds of a1": lambda g: g.rounds("a1"),
    "set model of a1": lambda g: g.set_model("a1", fmt.encode(MODEL)),  # it has one: allowed is 409
    "read model of a1": lambda g: g.model("a1"),
    "push to a1": lambda g: g.push("a1", update(1), samples=1, base_version=0, client="alice" if g.token == OPERATOR_TOKEN else None),
    "lease in a1": lambda g: g.take_lease("a1", "alice" if g.token == OPERATOR_TOKEN else None),
    "assignment in a1": lambda g: g.assignment("a1", "alice" if g.token == OPERATOR_TOKEN else None),
    "client token for a1": lambda g: g.create_token("client", "a", job="a1"),
    "list tokens": lambda g: g.tokens(),
    "read quota of a": lambda g: g.quota("a"),
    "set quota of a": lambda g: g.set_quota("a", {}),  # the defaults: harmless to the other operations
}
# What each caller gets: "ok" (Conflict counts as allowed: the state refused, not the rules),
# 401, 403 or 404.
EXPECTED = {
    #                      operator tenant a client a tenant b client b revoked no token garbage
    "create job in a":     ("ok",    "ok",    403,     403,     403,     401,    401,     401),
    "read job a1":         ("ok",    "ok",    "ok",    404,     404,     401,    401,     401),
    "read rounds of a1":   ("ok",    "ok",    403,     404,     404,     401,    401,     401),
    "set model of a1":     ("ok",    "ok",    403,     404,     404,     401,    401,     401),
    "read model of a1":    ("ok",    "ok",    "ok",    404,     404,     401,    401,     401),
    "push to a1":          ("ok",    403,     "ok",    404,     404,     401,    401,     401),
    "lease in a1":         ("ok",    403,     "ok",    404,     404,     401,    401,     401),
    "assignment in a1":    ("ok",    403,     "ok",    404,     404,     401,    401,     401),
    "client token for a1": ("ok",    "ok",    403,     403,     403,     401,    401,     401),
    "list tokens":         ("ok",    "ok",    403,     "ok",    403,     401,    401,     401),
    "read quota of a":     ("ok",    "ok",    403,     404,     403,     401,    401,     401),
    "set quota of a":      ("ok",    403,     403,     403,     403,     401,    401,     401),
}


def outcome(call: Callable[[], Any]) -> object:
    try:
        call()
    except Unauthenticated:
        return 401
    except Forbidden:
        return 403
    except NotFound as e:
        assert e.code in ("no_such_job", "no_such_tenant"), e  # the same answer as for one that does not exist
        return 404
    except Conflict:
        return "ok"
    return "ok"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_role_against_every_operation(node: RunningNode, protocol: str) -> None:
    world = World(node)
    got = {}
    for operation, call in OPERATIONS.items():
        row = []
        for who in CALLERS:
            gateway = world.gateway(who, protocol)
            try:
                row.append(outcome(lambda: call(gateway)))
            finally:
                gateway.close()
        got[operation] = tuple(row)
    assert got == EXPECTED


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_caller_lists_the_jobs_of_its_scope(node: RunningNode, protocol: str) -> None:
    world = World(node)
    seen = {who: world.gateway(who, protocol).jobs() for who in ("operator", "tenant a", "client a", "tenant b", "client b")}
    assert seen == {"operator": ["a1", "b1"], "tenant a": ["a1"], "client a": ["a1"], "tenant b": ["b1"], "client b": ["b1"]}


def test_http_refusals_say_what_is_missing(node: RunningNode) -> None:
    world = World(node)
    status, headers, body = node.request("GET", "/v1/jobs/a1", headers={"Authorization": None})
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="lifl"' and b"unauthenticated" in body
    status, _, body = node.request("GET", "/v1/jobs/a1", headers={"Authorization": "Basic YTpi"})
    assert status == 401 and b"bad_authorization" in body
    missing = node.json("GET", "/v1/jobs/a9", headers=auth(world.tokens["tenant b"]))
    hidden = node.json("GET", "/v1/jobs/a1", headers=auth(world.tokens["tenant b"]))
    assert missing == (404, {"error": {"code": "no_such_job", "message": "job 'a9' does not exist"}})
    assert hidden == (404, {"error": {"code": "no_such_job", "message": "job 'a1' does not exist"}})  # alike
    assert node.request("GET", "/healthz", headers={"Authorization": None})[0] == 200  # stays open
    assert node.request("GET", "/metrics", headers={"Authorization": None})[0] == 401  # names every tenant's jobs
    assert node.request("GET", "/metrics", headers=auth(world.tokens["tenant a"]))[0] == 403
    assert node.request("GET", "/metrics")[0] == 200


def test_an_unauthenticated_upload_is_refused_before_its_body(node: RunningNode) -> None:
    World(node)
    host, port = node.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/jobs/a1/updates HTTP/1.1\r\nHost: x\r\nX-Lifl-Samples: 1\r\nX-Lifl-Base-Version: 0\r\n"
                     b"Expect: 100-continue\r\nContent-Length: 1000000000\r\n\r\n")
        status, _, body = read_response(sock)  # answered at once, not after a gigabyte
    assert status == 401 and b"unauthenticated" in body


def test_internal_routes_take_only_peer_gateways(node: RunningNode) -> None:
    world = World(node)
    well_formed = {"X-Lifl-From-Node": "n9", "X-Lifl-Epoch": "0", "X-Lifl-Samples": "1", "X-Lifl-Updates": "1", "X-Lifl-Partial": "1"}
    malformed = {"X-Lifl-From-Node": "not a node!", "X-Lifl-Epoch": "-1", "X-Lifl-Samples": "many", "X-Lifl-Partial": "2"}
    for who in ("tenant a", "client a", "tenant b", "client b"):
        status, _, _ = node.request("GET", "/v1/internal/jobs/a1/model", headers=auth(world.tokens[who]))
        assert status == 403, who
        # the caller's role is refused before anything of the request is parsed (headers, body)
        for headers in (well_formed, malformed):
            refused = node.json("POST", "/v1/internal/jobs/a1/rounds/0/partials", b"x", {**auth(world.tokens[who]), **headers})
            assert refused == (403, {"error": {"code": "forbidden", "message": f"a {who.split()[0]} token may not call a "
                                                                                "gateway-to-gateway route"}}), who
        status, body = node.json("POST", "/v1/internal/jobs/a1/queries", b"{not json", auth(world.tokens[who]))
        assert (status, body["error"]["code"]) == (403, "forbidden"), who
    assert node.request("GET", "/v1/internal/jobs/a1/model", headers={"Authorization": None})[0] == 401
    internal = Tokens(node.state.redis).internal_token()  # what peer gateways present
    status, headers, _ = node.request("GET", "/v1/internal/jobs/a1/model", headers=auth(internal))
    assert status == 200 and headers["X-Lifl-Version"] == "0"


def test_failed_authentication_backs_off_per_address_but_valid_callers_are_served(node: RunningNode) -> None:
    world = World(node)
    garbage = auth(world.tokens["garbage"])
    for _ in range(MAX_AUTH_FAILURES - 1):
        assert node.request("GET", "/v1/jobs", headers=garbage)[0] == 401
    revoked = node.grpc_stub(world.tokens["revoked"])
    with pytest.raises(grpc.RpcError) as info:
        revoked.ListJobs(pb.ListJobsRequest())  # failures over gRPC count for the address as well: the limit
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    status, headers, body = node.request("GET", "/v1/jobs", headers=garbage)  # past the limit
    assert (status, json.loads(body)["error"]["code"]) == (429, "too_many_auth_failures")
    assert 1 <= int(headers["Retry-After"]) <= AUTH_FAILURE_WINDOW_S and headers["Connection"] == "close"
    assert node.request("GET", "/v1/jobs", headers={"Authorization": None})[0] == 429  # no token at all
    with pytest.raises(grpc.RpcError) as info:
        revoked.ListJobs(pb.ListJobsRequest())
    trailers = dict(info.value.trailing_metadata() or ())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and trailers["lifl-error-code"] == "too_many_auth_failures"
    assert 0 < int(trailers["grpc-retry-pushback-ms"]) <= AUTH_FAILURE_WINDOW_S * 1000

    # valid callers from the backing-off address are served: tokens never used before (read from
    # Redis), and cached ones
    assert node.json("GET", "/v1/jobs", headers=auth(world.tokens["tenant a"])) == (200, {"jobs": ["a1"]})
    assert node.json("GET", "/v1/jobs") == (200, {"jobs": ["a1", "b1"]})
    assert list(node.grpc_stub(world.tokens["client a"]).ListJobs(pb.ListJobsRequest()).jobs) == ["a1"]
    assert node.request("GET", "/v1/jobs", headers=garbage)[0] == 429  # while its failures are still refused


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_revocation_takes_effect_at_once_and_expiry_at_the_expiry(node: RunningNode, protocol: str) -> None:
    World(node)
    op = Gateway(node.http)
    revoked = op.create_token("client", "a", job="a1")
    expiring = op.create_token("client", "a", job="a1", ttl_s=1)
    address = node.http if protocol == "http" else node.grpc
    client, short = Gateway(address, protocol, token=revoked["token"]), Gateway(address, protocol, token=expiring["token"])
    assert client.job("a1")["version"] == 0 and short.job("a1")["version"] == 0
    op.revoke_token(revoked["id"])  # on this node's gateway: its cache forgets the token at once
    with pytest.raises(Unauthenticated):
        client.job("a1")
    wait_for(lambda: time.time() > expiring["expires"], what="the token's expiry")
    with pytest.raises(Unauthenticated):
        short.job("a1")
    assert {t["id"] for t in op.tokens()}.isdisjoint({revoked["id"], expiring["id"]})
    assert all("token" not in t for t in op.tokens())  # listed without secrets


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tenant_manages_its_clients_tokens_only(node: RunningNode, protocol: str) -> None:
    world = World(node)
    address = node.http if protocol == "http" else node.grpc
    tenant_a = Gateway(address, protocol, token=world.tokens["tenant a"])
    tenant_b = Gateway(address, protocol, token=world.tokens["tenant b"])
    made = tenant_a.create_token("client", "a", job="a1", client="carol", ttl_s=60)
    assert (made["role"], made["tenant"], made["job"], made["client"]) == ("client", "a", "a1", "carol")
    assert made["token"].startswith("lifl_") and made["expires"] - made["created"] == pytest.approx(60, abs=0.01)
    assert made["id"] in {t["id"] for t in tenant_a.tokens()}
    assert made["id"] not in {t["id"] for t in tenant_b.tokens()}
    assert {t["tenant"] for t in tenant_a.tokens()} == {"a"}
    with pytest.raises(NotFound):
        tenant_b.revoke_token(made["id"])  # another tenant's token does not exist for it
    with pytest.raises(NotFound):
        tenant_a.create_token("client", "a", job="b1")  # b1 is not a job of tenant a
    with pytest.raises(NotFound):
        tenant_a.create_token("client", "a", job="zz")
    tenant_a_id = next(t["id"] for t in Gateway(node.http).tokens() if t["role"] == "tenant" and t["tenant"] == "a")
    with pytest.raises(Forbidden):
        tenant_a.revoke_token(tenant_a_id)  # tenant tokens are the operator's to manage
    tenant_a.revoke_token(made["id"])
    with pytest.raises(Unauthenticated):
        Gateway(address, protocol, token=made["token"]).job("a1")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tenant_creates_jobs_in_its_own_tenant(node: RunningNode, protocol: str) -> None:
    world = World(node)
    address = node.http if protocol == "http" else node.grpc
    tenant_a = Gateway(address, protocol, token=world.tokens["tenant a"])
    assert tenant_a.create_job("a2", 2)["tenant"] == "a"  # no tenant named: its own
    with pytest.raises(Forbidden):
        tenant_a.create_job("a3", 2, tenant="b")
    assert "a3" not in Gateway(node.http).jobs()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_client_is_who_its_token_says(node: RunningNode, protocol: str) -> None:
    world = World(node)
    address = node.http if protocol == "http" else node.grpc
    alice = Gateway(address, protocol, token=world.tokens["client a"])
    with pytest.raises(Forbidden) as e:
        alice.push("a1", update(1), samples=1, base_version=0, client="mallory")
    assert e.value.code == "client_mismatch"
    assert alice.push("a1", update(1), samples=1, base_version=0, client="alice") == {"version": 0}
    with pytest.raises(Conflict) as e:
        alice.push("a1", update(2), samples=1, base_version=0)  # one update per client and round
    assert e.value.code == "already_acknowledged"
    with pytest.raises(Conflict) as e:
        alice.take_lease("a1")  # nor a lease once its update is in
    assert e.value.code == "already_acknowledged"
    status = Gateway(node.http).job("a1")
    assert status["round"]["received"] == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_client_holds_one_lease_bound_to_it(node: RunningNode, protocol: str) -> None:
    world = World(node)
    address = node.http if protocol == "http" else node.grpc
    alice = Gateway(address, protocol, token=world.tokens["client a"])
    op = Gateway(address, protocol)
    first, again = alice.take_lease("a1"), alice.take_lease("a1")
    assert first["lease"] == again["lease"]  # asking again renews the one it holds
    other = op.take_lease("a1", "dave")  # the operator acting as another client
    assert other["lease"] != first["lease"]
    assert Gateway(node.http).job("a1")["round"]["leases"] == 2
    with pytest.raises(NotFound):
        alice.heartbeat("a1", other["lease"])  # not hers
    with pytest.raises(NotFound):
        alice.release_lease("a1", other["lease"])
    alice.heartbeat("a1", first["lease"])
    # her push with dave's lease does not use it up
    alice.push("a1", update(1), samples=1, base_version=0, lease=other["lease"])
    op.heartbeat("a1", other["lease"])
    assert Gateway(node.http).job("a1")["round"]["leases"] == 2  # hers is still held: she pushed without it
    alice.release_lease("a1", first["lease"])
    assert Gateway(node.http).job("a1")["round"]["leases"] == 1


def test_over_selection_is_per_client_not_per_request(node: RunningNode) -> None:
    """One client with one token can hold one place, however often it asks."""
    World(node)
    op = Gateway(node.http)
    op.create_job("sel", 10)  # 13 leases may be out at once (over-selection 1.3)
    op.set_model("sel", fmt.encode(MODEL))
    token = op.create_token("client", "default", job="sel")["token"]
    attacker = Gateway(node.http, token=token)
    leases = {attacker.take_lease("sel")["lease"] for _ in range(20)}
    assert len(leases) == 1
    honest = [Gateway(node.http, token=op.create_token("client", "default", job="sel")["token"]) for _ in range(12)]
    assert len({g.take_lease("sel")["lease"] for g in honest}) == 12  # everyone else still gets a place


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_job_caps_the_samples_one_update_claims(node: RunningNode, protocol: str) -> None:
    op = Gateway(node.http if protocol == "http" else node.grpc, protocol)
    op.create_job("capped", 3, max_samples=100)
    op.set_model("capped", fmt.encode(MODEL))
    with pytest.raises(Unprocessable if protocol == "http" else BadRequest) as e:  # 422 / INVALID_ARGUMENT
        op.push("capped", update(1), samples=101, base_version=0, client="c1")
    assert e.value.code == "too_many_samples"
    op.push("capped", update(1), samples=100, base_version=0, client="c1")
    assert Gateway(node.http).job("capped")["round"]["received"] == 1
    if protocol == "http":  # (gRPC's field is unsigned)
        with pytest.raises(BadRequest):
            op.create_job("badcap", 3, max_samples=-1)


def test_responses_name_no_internal_objects(node: RunningNode) -> None:
    world = World(node)
    alice = Gateway(node.http, token=world.tokens["client a"])
    reply = alice.push("a1", update(1), samples=1, base_version=0)
    assert reply == {"version": 0}  # no object key
    status = Gateway(node.http, token=world.tokens["tenant a"]).job("a1")
    assert "key" not in status["model"] and status["model"]["node"] == node.node.config.node
    view = alice.job("a1")  # a client sees its version and round, nothing of the nodes
    assert view == {"job": "a1", "tenant": "a", "version": 0, "round": {"id": 0, "version": 0, "closed": False}}
    grpc_view = Gateway(node.grpc, "grpc", token=world.tokens["client a"]).job("a1")
    assert grpc_view["version"] == 0 and not grpc_view["aggregators"] and grpc_view["round"]["id"] == 0


def test_metrics_can_be_opened_to_scrapers_without_a_token(node: RunningNode) -> None:
    from lifl.gateway.http import HttpServer
    from lifl.gateway.service import GatewayService

    service = GatewayService(node.node.config.node, node.state, str(node.node.run_dir / "agent.sock"), open_metrics=True)
    server = HttpServer(service, "127.0.0.1", 0)
    server.start()
    try:
        with socket.create_connection(server.address, timeout=60) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = read_response(s)
        assert status == 200 and b"lifl_" in body
        with socket.create_connection(server.address, timeout=60) as s:
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n")  # nothing else opens with it
            assert read_response(s)[0] == 401
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_token_revoked_through_another_gateway_is_refused_by_one_that_cached_it(node: RunningNode, protocol: str) -> None:
    """The node's gateway answered a request with a token (it has it cached, and keeps it hot);
    the token is revoked through another gateway of the cluster. Every gateway refuses it within
    CACHE_SECONDS of the revocation (docs/security.md): the test waits for the refusal,
    then checks that it lasts."""
    from lifl.gateway.http import HttpServer
    from lifl.gateway.service import GatewayService

    World(node)
    made = Gateway(node.http).create_token("tenant", "a")
    cached = Gateway(node.http if protocol == "http" else node.grpc, protocol, token=made["token"])
    assert cached.job("a1")["job"] == "a1"  # answered with it: in the node's gateway's cache now
    other = HttpServer(GatewayService("other", node.state, str(node.node.run_dir / "agent.sock")), "127.0.0.1", 0)
    other.start()
    try:
        with socket.create_connection(other.address, timeout=60) as s:
            s.sendall(f"DELETE /v1/tokens/{made['id']} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OPERATOR_TOKEN}\r\n\r\n"
                      .encode())
            assert read_response(s)[0] == 204
    finally:
        other.stop()

    def refused() -> bool:
        try:
            cached.job("a1")
        except Unauthenticated:
            return True
        return False

    wait_for(refused, what="the node's gateway to refuse the revoked token")
    for _ in range(5):  # and for good: nothing brings the revoked token back
        assert refused()
    assert CACHE_SECONDS <= 1.0
    cached.close()


def run_cli(node: RunningNode, token: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lifl", "token", "--gateway", node.http, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LIFL_TOKEN": token})


def test_the_token_command_line(node: RunningNode, tmp_path: Path) -> None:
    World(node)
    made = run_cli(node, OPERATOR_TOKEN, "create", "--role", "tenant", "--tenant", "a", "--ttl", "600")
    assert made.returncode == 0, made.stderr
    tenant = json.loads(made.stdout)
    assert (tenant["role"], tenant["tenant"]) == ("tenant", "a") and tenant["expires"] - tenant["created"] == pytest.approx(600, abs=0.01)
    token_file = tmp_path / "tenant-token"
    token_file.write_text(tenant["token"] + "\n")
    client = subprocess.run([sys.executable, "-m", "lifl", "token", "--gateway", node.http, "--token-file", str(token_file),
                             "create", "--role", "client", "--tenant", "a", "--job", "a1", "--client", "erin"],
                            capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "LIFL_TOKEN"})
    assert client.returncode == 0, client.stderr
    erin = json.loads(client.stdout)
    assert Gateway(node.http, token=erin["token"]).job("a1")["version"] == 0
    listed = [json.loads(line) for line in run_cli(node, tenant["token"], "list").stdout.splitlines()]
    assert erin["id"] in {t["id"] for t in listed} and all("token" not in t for t in listed)
    assert run_cli(node, tenant["token"], "revoke", erin["id"]).returncode == 0
    with pytest.raises(Unauthenticated):
        Gateway(node.http, token=erin["token"]).job("a1")
    refused = run_cli(node, erin["token"], "list")
    assert refused.returncode != 0 and "unauthenticated" in refused.stderr
    denied = run_cli(node, tenant["token"], "create", "--role", "tenant", "--tenant", "a")
    assert denied.returncode != 0 and "forbidden" in denied.stderr
