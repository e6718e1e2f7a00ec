"""Authentication and authorization: the pure rules (tables) and tokens in a real Redis."""

from __future__ import annotations

import time

import pytest

from lifl import auth
from lifl.auth import (
    CLIENT, NODE, OPERATOR, TENANT, Action, Principal, TokenSpec, Tokens, acting_client, authorize, bearer,
    certificate_principal, job_tenant, may_issue,
)
from lifl.errors import BadRequest, Forbidden, NotFound, QuotaExceeded, Unauthenticated
from lifl.quotas import Quota
from lifl.state import ClusterState

OP = Principal(OPERATOR)
TA = Principal(TENANT, "a")
CA = Principal(CLIENT, "a", "a1", "alice")
TB = Principal(TENANT, "b")
CB = Principal(CLIENT, "b", "b1", "bob")
NODE_P = Principal(NODE)
ALL = {"operator": OP, "tenant a": TA, "client a": CA, "tenant b": TB, "client b": CB, "node": NODE_P}

# What each caller gets doing each action on job a1 of tenant a: "ok", 403 or 404.
ON_A1 = {
    #                   operator tenant a client a tenant b client b node
    Action.READ_JOB:    ("ok",    "ok",    "ok",    404,     404,     403),
    Action.READ_ROUNDS: ("ok",    "ok",    403,     404,     404,     403),
    Action.SET_MODEL:   ("ok",    "ok",    403,     404,     404,     403),
    Action.READ_MODEL:  ("ok",    "ok",    "ok",    404,     404,     403),
    Action.PUSH_UPDATE: ("ok",    403,     "ok",    404,     404,     403),
    Action.LEASE:       ("ok",    403,     "ok",    404,     404,     403),
    Action.ASSIGNMENT:  ("ok",    403,     "ok",    404,     404,     403),
    Action.INTERNAL:    ("ok",    403,     403,     404,     404,     "ok"),
    Action.QUERY:       ("ok",    "ok",    403,     404,     404,     403),
    Action.RETENTION:   ("ok",    "ok",    403,     404,     404,     403),
}
# ... and actions on no job.
GLOBAL = {
    Action.CREATE_JOB:    ("ok", "ok", 403, "ok", 403, 403),
    Action.LIST_JOBS:     ("ok", "ok", "ok", "ok", "ok", 403),
    Action.MANAGE_TOKENS: ("ok", "ok", 403, "ok", 403, 403),
    Action.METRICS:       ("ok", 403, 403, 403, 403, 403),
    Action.READ_QUOTA:    ("ok", "ok", 403, "ok", 403, 403),  # a tenant its own (GatewayService._quota_scope)
    Action.SET_QUOTA:     ("ok", 403, 403, 403, 403, 403),
}


def outcome(call) -> object:
    try:
        call()
    except Forbidden:
        return 403
    except NotFound:
        return 404
    return "ok"


@pytest.mark.parametrize("action", list(ON_A1))
def test_actions_on_a_job_by_every_caller(action: Action) -> None:
    got = tuple(outcome(lambda p=p: authorize(p, action, tenant="a", job="a1")) for p in ALL.values())
    assert got == ON_A1[action], dict(zip(ALL, got))


@pytest.mark.parametrize("action", list(GLOBAL))
def test_actions_on_no_job_by_every_caller(action: Action) -> None:
    got = tuple(outcome(lambda p=p: authorize(p, action)) for p in ALL.values())
    assert got == GLOBAL[action], dict(zip(ALL, got))


def test_every_action_is_in_a_table() -> None:
    assert set(ON_A1) | set(GLOBAL) == set(Action) and not set(ON_A1) & set(GLOBAL)


def test_a_client_sees_only_its_own_job_of_its_own_tenant() -> None:
    assert CA.sees("a", "a1") and not CA.sees("a", "a2") and not CA.sees("b", "a1")
    assert TA.sees("a", "anything") and not TA.sees("b", "b1")
    assert OP.sees("b", "b1") and NODE_P.sees("b", "b1")


def test_out_of_scope_reads_like_a_missing_job() -> None:
    with pytest.raises(NotFound) as e:
        authorize(TB, Action.READ_JOB, tenant="a", job="a1")
    assert (e.value.code, e.value.message) == ("no_such_job", "job 'a1' does not exist")


@pytest.mark.parametrize(("principal", "requested", "expected"), [
    (OP, None, "default"), (OP, "b", "b"), (TA, None, "a"), (TA, "a", "a"), (TA, "b", Forbidden),
])
def test_the_tenant_a_job_is_created_in(principal: Principal, requested: object, expected: object) -> None:
    if expected is Forbidden:
        with pytest.raises(Forbidden):
            job_tenant(principal, requested)
    else:
        assert job_tenant(principal, requested) == expected


@pytest.mark.parametrize(("principal", "named", "expected"), [
    (CA, None, "alice"), (CA, "", "alice"), (CA, "alice", "alice"), (CA, "mallory", Forbidden),
    (OP, "anyone", "anyone"), (OP, None, None),
])
def test_the_client_a_call_acts_as(principal: Principal, named: object, expected: object) -> None:
    if expected is Forbidden:
        with pytest.raises(Forbidden) as e:
            acting_client(principal, named)
        assert e.value.code == "client_mismatch"
    else:
        assert acting_client(principal, named) == expected


@pytest.mark.parametrize(("header", "expected"), [
    (None, None), ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"),
    ("Basic dXNlcjpwYXNz", Unauthenticated), ("Bearer", Unauthenticated), ("Bearer   ", Unauthenticated),
    ("abc", Unauthenticated), ("", Unauthenticated),
])
def test_bearer_headers(header: str | None, expected: object) -> None:
    if expected is Unauthenticated:
        with pytest.raises(Unauthenticated):
            bearer(header)
    else:
        assert bearer(header) == expected


GOOD_CLIENT = {"role": "client", "tenant": "a", "job": "a1"}


@pytest.mark.parametrize("body", [
    None, [], "client", {}, {"role": "operator", "tenant": "a"}, {"role": "admin", "tenant": "a"},
    {"role": "tenant"}, {"role": "tenant", "tenant": "A"}, {"role": "tenant", "tenant": "-a"}, {"role": "tenant", "tenant": 3},
    {"role": "tenant", "tenant": "a", "job": "a1"}, {"role": "tenant", "tenant": "a", "client": "x"},
    {"role": "client", "tenant": "a"}, {**GOOD_CLIENT, "job": "A1"}, {**GOOD_CLIENT, "job": "a/1"},
    {**GOOD_CLIENT, "client": "has space"}, {**GOOD_CLIENT, "client": "x" * 257}, {**GOOD_CLIENT, "client": 5},
    {**GOOD_CLIENT, "ttl_s": 0}, {**GOOD_CLIENT, "ttl_s": 0.5}, {**GOOD_CLIENT, "ttl_s": auth.MAX_TTL_S + 1},
    {**GOOD_CLIENT, "ttl_s": True}, {**GOOD_CLIENT, "ttl_s": "60"}, {**GOOD_CLIENT, "ttl_s": float("nan")},
    {**GOOD_CLIENT, "extra": 1},
])
def test_malformed_token_requests_are_refused_with_their_reason(body: object) -> None:
    with pytest.raises(BadRequest) as e:
        TokenSpec.from_request(body)
    assert e.value.code == "bad_token_request" and e.value.message


def test_token_requests_at_their_limits() -> None:
    assert TokenSpec.from_request({**GOOD_CLIENT, "ttl_s": auth.MAX_TTL_S}).ttl_s == auth.MAX_TTL_S
    assert TokenSpec.from_request({**GOOD_CLIENT, "ttl_s": 1}).ttl_s == 1.0
    assert TokenSpec.from_request({**GOOD_CLIENT, "client": "x" * 256}).client == "x" * 256
    assert TokenSpec.from_request({"role": "tenant", "tenant": "a"}) == TokenSpec("tenant", "a")


@pytest.mark.parametrize(("issuer", "spec", "expected"), [
    (OP, TokenSpec(TENANT, "a"), "ok"), (OP, TokenSpec(CLIENT, "b", "b1"), "ok"),
    (TA, TokenSpec(CLIENT, "a", "a1"), "ok"), (TA, TokenSpec(TENANT, "a"), 403), (TA, TokenSpec(CLIENT, "b", "b1"), 403),
    (CA, TokenSpec(CLIENT, "a", "a1"), 403), (NODE_P, TokenSpec(CLIENT, "a", "a1"), 403),
])
def test_who_issues_which_tokens(issuer: Principal, spec: TokenSpec, expected: object) -> None:
    assert outcome(lambda: may_issue(issuer, spec)) == expected


def subject(**names: str) -> dict:
    return {"subject": tuple(((name, value),) for name, value in names.items())}


def test_client_certificates_map_cn_o_ou_to_client_tenant_job() -> None:
    cert = subject(commonName="alice", organizationName="a", organizationalUnitName="a1", countryName="FR")
    assert certificate_principal(cert) == Principal(CLIENT, "a", "a1", "alice")
    assert certificate_principal(None) is None and certificate_principal({}) is None
    for partial in (subject(commonName="alice", organizationName="a"), subject(organizationName="a", organizationalUnitName="a1"),
                    subject(commonName="alice", organizationName="A", organizationalUnitName="a1"),
                    subject(commonName="al ice", organizationName="a", organizationalUnitName="a1")):
        with pytest.raises(Unauthenticated):
            certificate_principal(partial)


# -- tokens in Redis ---------------------------------------------------------------------------
def test_an_issued_token_authenticates_as_its_record(state: ClusterState) -> None:
    tokens = Tokens(state.redis)
    record, token = tokens.create(TokenSpec(CLIENT, "a", "a1", ttl_s=60))
    assert auth.TOKEN.fullmatch(token) and record.id in token and record.client == record.id
    assert tokens.authenticate(token) == Principal(CLIENT, "a", "a1", record.id, record.id)
    named, token2 = tokens.create(TokenSpec(CLIENT, "a", "a1", client="alice"))
    assert tokens.authenticate(token2).client == "alice"
    tenant, token3 = tokens.create(TokenSpec(TENANT, "a"))
    assert tokens.authenticate(token3) == Principal(TENANT, "a", "", "", tenant.id)
    stored = state.redis.hgetall(auth.token_key(record.id))
    assert token not in str(stored) and stored["hash"] == auth.digest(token)  # only its hash is kept


def _flip_last(token: str) -> str:
    return token[:-1] + ("1" if token[-1] == "0" else "0")


FORGERIES = {
    "empty": lambda record, token: "",
    "junk": lambda record, token: "x",
    "unknown id": lambda record, token: "lifl_0000000000000000_" + "0" * 64,
    "right id, wrong secret": lambda record, token: f"lifl_{record.id}_" + "0" * 64,
    "one character changed": lambda record, token: _flip_last(token),
    "one character added": lambda record, token: token + "0",
    "secret in upper case": lambda record, token: f"lifl_{record.id}_" + token.rsplit("_", 1)[1].upper(),
}


@pytest.mark.parametrize("forge", list(FORGERIES.values()), ids=list(FORGERIES))
def test_forged_and_altered_tokens_authenticate_nobody(state: ClusterState, forge) -> None:
    tokens = Tokens(state.redis)
    record, token = tokens.create(TokenSpec(TENANT, "a"))
    with pytest.raises(Unauthenticated):
        tokens.authenticate(forge(record, token))


def test_the_operator_token_is_whatever_lifl_up_registered(state: ClusterState) -> None:
    tokens = Tokens(state.redis)
    tokens.register_operator("o" * 32)
    assert tokens.authenticate("o" * 32).role == OPERATOR
    tokens.register_operator("p" * 32)  # replaced: the old one no longer works (after the cache's age)
    assert Tokens(state.redis).authenticate("p" * 32).role == OPERATOR
    with pytest.raises(Unauthenticated):
        Tokens(state.redis).authenticate("o" * 32)
    for bad in ("short", "x" * 257, "has a space" * 4, "é" * 40):
        with pytest.raises(ValueError):
            tokens.register_operator(bad)


def test_a_token_expires_at_its_expiry_even_when_cached(state: ClusterState) -> None:
    tokens = Tokens(state.redis)
    record, token = tokens.create(TokenSpec(TENANT, "a", ttl_s=1))
    assert tokens.authenticate(token).role == TENANT  # now cached
    while time.time() < record.expires:
        time.sleep(0.05)
    with pytest.raises(Unauthenticated):
        tokens.authenticate(token)
    assert tokens.records("a") == []


def test_revocation_reaches_every_gateway_within_the_cache_age(state: ClusterState) -> None:
    clock = [0.0]
    here, there = Tokens(state.redis), Tokens(state.redis, clock=lambda: clock[0])
    record, token = here.create(TokenSpec(TENANT, "a"))
    assert there.authenticate(token).role == TENANT
    here.revoke(record.id)
    with pytest.raises(Unauthenticated):
        here.authenticate(token)  # the revoking gateway at once
    clock[0] = auth.CACHE_SECONDS * 0.9
    assert there.authenticate(token).role == TENANT  # another one may still have it cached...
    clock[0] = auth.CACHE_SECONDS
    with pytest.raises(Unauthenticated):
        there.authenticate(token)  # ...for CACHE_SECONDS at most
    assert auth.CACHE_SECONDS <= 1.0


def test_the_cache_alone_answers_from_fresh_entries_only(state: ClusterState) -> None:
    """``cached`` (an event loop's fast path) never reads Redis: it answers from entries younger
    than CACHE_SECONDS, and says it cannot (None) otherwise."""
    clock = [0.0]
    here, there = Tokens(state.redis), Tokens(state.redis, clock=lambda: clock[0])
    record, token = here.create(TokenSpec(TENANT, "a"))
    assert there.cached(token) is None  # never read here: only Redis can tell
    assert there.authenticate(token).role == TENANT
    assert there.cached(token) == there.authenticate(token)
    forged = _flip_last(token)
    assert there.cached(forged) is None  # it might be the operator's token (any string is): Redis decides
    here.register_operator("o" * 32)
    assert there.authenticate("o" * 32).role == OPERATOR  # now the operator's entry is cached too
    with pytest.raises(Unauthenticated):
        there.cached(forged)  # neither entry's secret: refused without Redis
    here.revoke(record.id)
    clock[0] = auth.CACHE_SECONDS * 0.9
    assert there.cached(token).role == TENANT  # another gateway may still take it...
    clock[0] = auth.CACHE_SECONDS
    assert there.cached(token) is None  # ...until its entry is CACHE_SECONDS old: then Redis decides
    with pytest.raises(Unauthenticated):
        there.authenticate(token)


def test_refresh_keeps_hot_entries_fresh_and_forgets_revoked_and_cold_ones(state: ClusterState) -> None:
    clock = [0.0]
    here, there = Tokens(state.redis), Tokens(state.redis, clock=lambda: clock[0])
    (_, kept_token), (revoked, revoked_token) = here.create(TokenSpec(TENANT, "a")), here.create(TokenSpec(TENANT, "a"))
    _, cold_token = here.create(TokenSpec(TENANT, "a"))
    for token in (kept_token, revoked_token, cold_token):
        assert there.authenticate(token).role == TENANT
    clock[0] = auth.HOT_SECONDS / 2
    assert there.cached(kept_token) is None and there.authenticate(kept_token)  # used again: hot
    assert there.authenticate(revoked_token)
    here.revoke(revoked.id)
    clock[0] = auth.HOT_SECONDS
    assert there.refresh() == 2  # the two used within HOT_SECONDS; the cold one is forgotten
    clock[0] = auth.HOT_SECONDS + auth.CACHE_SECONDS * 0.9
    assert there.cached(kept_token).role == TENANT  # read again by the refresh: fresh without a request's read
    assert there.cached(revoked_token) is None  # gone from the cache: the next request asks Redis...
    with pytest.raises(Unauthenticated):
        there.authenticate(revoked_token)  # ...which refuses it
    assert there.cached(cold_token) is None
    assert auth.REFRESH_SECONDS < auth.CACHE_SECONDS <= 1.0  # hot entries never go stale while Redis answers


def test_listing_and_revoking(state: ClusterState) -> None:
    tokens = Tokens(state.redis)
    a1, _ = tokens.create(TokenSpec(CLIENT, "a", "a1"))
    a2, _ = tokens.create(TokenSpec(TENANT, "a"))
    b1, _ = tokens.create(TokenSpec(CLIENT, "b", "b1"))
    tokens.register_operator("o" * 32)
    assert [r.id for r in tokens.records("a")] == [a1.id, a2.id]
    assert {r.id for r in tokens.records(None)} == {a1.id, a2.id, b1.id}  # the operator's is not listed
    tokens.revoke(a1.id)
    assert [r.id for r in tokens.records("a")] == [a2.id]
    for unknown in (a1.id, "operator", "0" * 16, "../x", ""):
        with pytest.raises(NotFound):
            tokens.revoke(unknown)


def test_live_tokens_per_tenant_are_capped_by_its_quota(state: ClusterState, monkeypatch: pytest.MonkeyPatch) -> None:
    state.set_quota("a", Quota(tokens=3))
    tokens = Tokens(state.redis)
    made = [tokens.create(TokenSpec(CLIENT, "a", "a1"))[0] for _ in range(3)]
    with pytest.raises(QuotaExceeded) as e:
        tokens.create(TokenSpec(CLIENT, "a", "a1"))
    assert (e.value.status, e.value.code, e.value.extra) == (403, "quota_exceeded", {"quota": "tokens", "limit": 3, "used": 3})
    tokens.create(TokenSpec(CLIENT, "b", "b1"))  # another tenant's count
    tokens.revoke(made[0].id)
    tokens.create(TokenSpec(CLIENT, "a", "a1"))  # room again
    state.set_quota("a", Quota(tokens=None))  # no quota of its own: the hard cap still holds
    monkeypatch.setattr(auth, "MAX_TOKENS_PER_TENANT", 4)
    tokens.create(TokenSpec(CLIENT, "a", "a1"))
    with pytest.raises(QuotaExceeded) as e:
        tokens.create(TokenSpec(CLIENT, "a", "a1"))
    assert e.value.extra["limit"] == 4


def test_gateways_share_one_internal_token(state: ClusterState) -> None:
    first, second = Tokens(state.redis), Tokens(state.redis)
    assert first.internal_token() == second.internal_token()
    assert second.authenticate(first.internal_token()) == auth.NODE_PRINCIPAL
