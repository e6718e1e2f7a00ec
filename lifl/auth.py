"""Who may call the gateway, and what each caller may do (docs/security.md).

Three roles, as in Kubernetes RBAC with namespaces: the **operator** administers the platform
(any tenant, anything; cluster-admin), a **tenant** manages its own jobs and its clients'
tokens, a **client** takes part in the one job its token enrols it in. Peer gateways talk to
each other as **node**, with a cluster-internal token kept in Redis, for the internal routes only.

Callers present bearer tokens (``lifl_<id>_<secret>``: a 16-hex-digit id and 256 random bits).
Redis keeps only a SHA-256 of the secret, with the token's role, scope and expiry, under
``lifl:token:<id>`` (expiring with the token: revocation deletes it); ``lifl:tokens:<tenant>``
indexes them for listing. With mutual TLS, a client certificate signed by the configured CA
stands for a client token: its subject's CN is the client, O its tenant, OU its job (the
Kubernetes convention: CN user, O group).

``authorize`` is pure: a table of which roles may do what, and the scope rule. Out of scope
is reported as the resource being absent (404), so a tenant never learns another's job names;
in scope but not allowed to is 403.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import redis

from lifl.errors import BadRequest, Forbidden, NotFound, Unauthenticated
from lifl.jobs import JOB_NAME, TENANT_NAME
from lifl.redisconn import SCAN_COUNT
from lifl.net.resp import Outage
from lifl.state import dependency_errors, quota_exceeded, read_quota, tenant_tokens_key as index_key

OPERATOR, TENANT, CLIENT, NODE = "operator", "tenant", "client", "node"
ISSUABLE_ROLES = (TENANT, CLIENT)  # what POST /v1/tokens creates; the operator's token is set at start
OPERATOR_TOKEN_ID = "operator"
TOKEN = re.compile(r"lifl_([0-9a-f]{16})_([0-9a-f]{64})")
OPERATOR_TOKEN = re.compile(r"[\x21-\x7e]{32,256}")  # an operator may bring a token of its own making
TOKEN_ID = re.compile(r"[0-9a-f]{16}|operator")
CLIENT_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: it is also a certificate CN
MAX_TTL_S = 366 * 86400  # the longest a token may live
DEFAULT_TTL_S = 86400.0
MIN_TTL_S = 1.0
MAX_TOKENS_PER_TENANT = 100_000  # tenant and client tokens of one tenant, live ones, whatever its quota
# A gateway authenticates a token from what it read of it at most CACHE_SECONDS ago: a token
# revoked (or replaced) is refused by every gateway within CACHE_SECONDS of its revocation, at
# once by the gateway that revoked it; an expired one from the millisecond it expires, cached or
# not (docs/security.md). The bound is at most 1 s (tests/test_auth.py, tests/test_security.py).
CACHE_SECONDS = 0.5
REFRESH_SECONDS = 0.2  # hot entries are read again this often, in the background: they never go stale while Redis answers
HOT_SECONDS = 10.0  # an entry used within this long is hot (refreshed); a colder one is read again when next used
MAX_REFRESHED = 4096  # hot entries read again per refresh (one pipelined Redis call); more are read when used
CACHE_ENTRIES = 65536  # tokens a gateway remembers at once (the cache is emptied past it)
INTERNAL_TOKEN_KEY = "lifl:internal-token"  # what gateways present to each other


class Action(Enum):
    CREATE_JOB = "create a job"
    LIST_JOBS = "list jobs"
    READ_JOB = "read a job's status"
    READ_ROUNDS = "read a job's rounds"
    SET_MODEL = "set a job's model"
    READ_MODEL = "read a job's model"
    PUSH_UPDATE = "push an update"
    LEASE = "take, renew or release a lease"
    ASSIGNMENT = "ask for an assignment"
    MANAGE_TOKENS = "manage tokens"
    METRICS = "read metrics"
    INTERNAL = "call a gateway-to-gateway route"
    QUERY = "query a job's retained updates and models"
    RETENTION = "read or change a job's retention policy"
    READ_QUOTA = "read a tenant's quota"
    SET_QUOTA = "set a tenant's quota"


# Who may do what, in their scope (the operator's scope is everything).
ALLOWED: dict[Action, frozenset[str]] = {
    Action.CREATE_JOB: frozenset({OPERATOR, TENANT}),
    Action.LIST_JOBS: frozenset({OPERATOR, TENANT, CLIENT}),
    Action.READ_JOB: frozenset({OPERATOR, TENANT, CLIENT}),  # clients see a reduced view (client_view)
    Action.READ_ROUNDS: frozenset({OPERATOR, TENANT}),
    Action.SET_MODEL: frozenset({OPERATOR, TENANT}),
    Action.READ_MODEL: frozenset({OPERATOR, TENANT, CLIENT}),
    Action.PUSH_UPDATE: frozenset({OPERATOR, CLIENT}),
    Action.LEASE: frozenset({OPERATOR, CLIENT}),
    Action.ASSIGNMENT: frozenset({OPERATOR, CLIENT}),
    Action.MANAGE_TOKENS: frozenset({OPERATOR, TENANT}),
    Action.METRICS: frozenset({OPERATOR}),
    Action.INTERNAL: frozenset({OPERATOR, NODE}),
    Action.QUERY: frozenset({OPERATOR, TENANT}),  # clients' updates are the tenant's data, not other clients'
    Action.RETENTION: frozenset({OPERATOR, TENANT}),
    Action.READ_QUOTA: frozenset({OPERATOR, TENANT}),  # a tenant its own
    Action.SET_QUOTA: frozenset({OPERATOR}),
}


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    role: str
    tenant: str = ""  # "" for the operator and nodes
    job: str = ""  # a client's job
    client: str = ""  # a client's identity
    token: str = ""  # the token's id ("" for a certificate)

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR

    def sees(self, tenant: str, job: str) -> bool:
        """Whether a job of ``tenant`` is in this caller's scope (else it does not exist for it)."""
        if self.role in (OPERATOR, NODE):
            return True
        if self.role == TENANT:
            return tenant == self.tenant
        return tenant == self.tenant and job == self.job


OPERATOR_PRINCIPAL = Principal(OPERATOR, token=OPERATOR_TOKEN_ID)
NODE_PRINCIPAL = Principal(NODE)


def authorize(principal: Principal, action: Action, *, tenant: str = "", job: str = "") -> None:
    """Raise unless ``principal`` may do ``action`` on ``job`` of ``tenant`` (or, for actions on
    no job, at all): NotFound when the job is out of its scope, Forbidden when its role may not."""
    if job and not principal.sees(tenant, job):
        raise NotFound(f"job {job!r} does not exist", code="no_such_job")
    if principal.role not in ALLOWED[action]:
        raise Forbidden(f"a {principal.role} token may not {action.value}", code="forbidden")


def job_tenant(principal: Principal, requested: Any) -> Any:
    """The tenant a job is created in: a tenant's own (naming another is forbidden); the operator
    names it (default "default")."""
    if principal.role == TENANT:
        if requested not in (None, principal.tenant):
            raise Forbidden(f"a tenant token of {principal.tenant!r} may create jobs in that tenant only", code="forbidden")
        return principal.tenant
    return "default" if requested is None else requested


def acting_client(principal: Principal, named: Any) -> Any:
    """The client identity a call acts as: a client token's own (a name sent along must match it);
    the operator names any client (as Kubernetes administrators impersonate users)."""
    if principal.role == CLIENT:
        if named not in (None, "", principal.client):
            raise Forbidden("the client named does not match the client's token", code="client_mismatch")
        return principal.client
    return named


# -- tokens -------------------------------------------------------------------------------------
def new_token() -> tuple[str, str]:
    """(id, token) of a fresh random token."""
    token_id = secrets.token_hex(8)
    return token_id, f"lifl_{token_id}_{secrets.token_hex(32)}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (None when absent)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <token>'", code="bad_authorization")
    return token.strip()


@dataclass(frozen=True)
class TokenSpec:
    """What ``POST /v1/tokens`` asks for, validated."""

    role: str
    tenant: str
    job: str = ""
    client: str = ""
    ttl_s: float = DEFAULT_TTL_S

    @classmethod
    def from_request(cls, body: Any) -> TokenSpec:
        if not isinstance(body, dict):
            raise BadRequest("a token request must be a JSON object", code="bad_token_request")
        unknown = sorted(set(body) - {"role", "tenant", "job", "client", "ttl_s"})
        if unknown:
            raise BadRequest(f"unknown token field(s): {', '.join(unknown)}", code="bad_token_request")
        role, tenant = body.get("role"), body.get("tenant")
        if role not in ISSUABLE_ROLES:
            raise BadRequest(f"role must be one of {', '.join(ISSUABLE_ROLES)}", code="bad_token_request")
        if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
            raise BadRequest("tenant must name a tenant (1-31 characters of a-z, 0-9 and '-')", code="bad_token_request")
        job, client = body.get("job", ""), body.get("client", "")
        if role == CLIENT:
            if not isinstance(job, str) or not JOB_NAME.fullmatch(job):
                raise BadRequest("a client token needs the job it is enrolled in ('job')", code="bad_token_request")
            if client != "" and (not isinstance(client, str) or not CLIENT_ID.fullmatch(client)):
                raise BadRequest("client must be 1-256 printable ASCII characters without spaces", code="bad_token_request")
        elif job or client:
            raise BadRequest("only client tokens name a job and a client", code="bad_token_request")
        ttl = body.get("ttl_s", DEFAULT_TTL_S)
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise BadRequest(f"ttl_s must be a number of seconds in [{MIN_TTL_S:g}, {MAX_TTL_S}]", code="bad_token_request")
        return cls(role, tenant, job, client, float(ttl))


def may_issue(principal: Principal, spec: TokenSpec) -> None:
    """The operator issues any token; a tenant issues client tokens of its own tenant."""
    if principal.role == OPERATOR:
        return
    authorize(principal, Action.MANAGE_TOKENS)
    if spec.tenant != principal.tenant:
        raise Forbidden(f"a tenant token of {principal.tenant!r} issues tokens of that tenant only", code="forbidden")
    if spec.role != CLIENT:
        raise Forbidden("a tenant token issues client tokens only", code="forbidden")


@dataclass(frozen=True)
class TokenRecord:
    """A token as stored (its secret's hash aside) and listed."""

    id: str
    role: str
    tenant: str
    job: str
    client: str
    created: float  # seconds since the epoch
    expires: float  # seconds since the epoch; 0: never (the operator's)

    def public(self) -> dict[str, Any]:
        return asdict(self)

    def principal(self) -> Principal:
        return Principal(self.role, self.tenant, self.job, self.client, self.id)


def certificate_principal(certificate: dict[str, Any] | None) -> Principal | None:
    """The client a verified TLS client certificate stands for (``ssl.getpeercert()``'s form):
    CN the client, O its tenant, OU its job; None without a certificate. A certificate that
    lacks one of them authenticates nobody."""
    if not certificate:
        return None
    subject: dict[str, str] = {}
    for rdn in certificate.get("subject", ()):
        for name, value in rdn:
            subject.setdefault(name, value)
    client, tenant, job = subject.get("commonName", ""), subject.get("organizationName", ""), subject.get("organizationalUnitName", "")
    if not (CLIENT_ID.fullmatch(client) and TENANT_NAME.fullmatch(tenant) and JOB_NAME.fullmatch(job)):
        raise Unauthenticated("a client certificate must name the client (CN), its tenant (O) and its job (OU)",
                              code="bad_certificate")
    return Principal(CLIENT, tenant, job, client)


def token_key(token_id: str) -> str:
    return f"lifl:token:{token_id}"


# KEYS: token, index. ARGV: id, hash, record json, expiry ms, the tenant's limit. -> -1 created, or
# the live tokens held when the limit is reached.
_CREATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('ZCARD', KEYS[2])
if held >= tonumber(ARGV[5]) then return held end
redis.call('HSET', KEYS[1], 'hash', ARGV[2], 'record', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return -1
"""


class _Entry:
    """What a gateway read of one token: when it started reading (its age is counted from
    there, so a read that raced a revocation is never taken for a later one), the secret's
    hash and the record; ``used`` is when a request last presented it (hot entries are
    refreshed in the background)."""

    __slots__ = ("read_at", "hash", "record", "used")

    def __init__(self, read_at: float, token_hash: str, record: TokenRecord) -> None:
        self.read_at, self.hash, self.record, self.used = read_at, token_hash, record, read_at


class _NotCached(Exception):
    """The cache cannot answer without Redis (``Tokens.cached``)."""


@dependency_errors
class Tokens:
    """Tokens in Redis, and a gateway's cache of them.

    ``authenticate`` reads Redis when its cached entry is missing or older than CACHE_SECONDS;
    ``cached`` never does (an event loop's fast path: None when it cannot answer), and
    ``refresh`` (a periodic duty, off the loop) reads the hot entries again, every
    REFRESH_SECONDS, so that requests rarely find them stale. The cache is shared by the
    loop's thread and the pool's: a lock guards the dictionary, never a Redis call."""

    def __init__(self, client: redis.Redis, clock: Callable[[], float] = time.monotonic, outage: Outage | None = None) -> None:
        self.redis = client
        self.outage = outage or Outage()  # shared with the ClusterState whose client this is
        self._clock = clock  # ages cache entries
        self._create = client.register_script(_CREATE)
        self._cache: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._internal: str | None = None

    # -- issuing --------------------------------------------------------------------------------
    def create(self, spec: TokenSpec) -> tuple[TokenRecord, str]:
        token_id, token = new_token()
        now = time.time()
        client = (spec.client or token_id) if spec.role == CLIENT else ""  # a client is its token unless named
        # Microseconds: two tokens made in one millisecond still list oldest first.
        record = TokenRecord(token_id, spec.role, spec.tenant, spec.job, client, round(now, 6), round(now + spec.ttl_s, 3))
        quota = read_quota(self.redis, spec.tenant).tokens
        limit = MAX_TOKENS_PER_TENANT if quota is None else min(quota, MAX_TOKENS_PER_TENANT)
        held = int(self._create(keys=[token_key(token_id), index_key(spec.tenant)],
                                args=[token_id, digest(token), json.dumps(record.public()), int(record.expires * 1000),
                                      limit]))
        if held >= 0:
            raise quota_exceeded(spec.tenant, "tokens", limit, held, "revoke some first")
        return record, token

    def register_operator(self, token: str) -> None:
        """Make ``token`` the operator's (replacing any other): what `lifl up` does at start."""
        if not OPERATOR_TOKEN.fullmatch(token):
            raise ValueError("an operator token must be 32-256 printable ASCII characters without spaces")
        record = TokenRecord(OPERATOR_TOKEN_ID, OPERATOR, "", "", "", round(time.time(), 3), 0.0)
        self.redis.hset(token_key(OPERATOR_TOKEN_ID), mapping={"hash": digest(token), "record": json.dumps(record.public())})
        self.redis.persist(token_key(OPERATOR_TOKEN_ID))

    def internal_token(self) -> str:
        """The token gateways present to each other (made once per cluster, kept in Redis)."""
        if self._internal is None:
            self.redis.set(INTERNAL_TOKEN_KEY, secrets.token_hex(32), nx=True)
            self._internal = str(self.redis.get(INTERNAL_TOKEN_KEY))
        return self._internal

    # -- listing and revoking ---------------------------------------------------------------------
    def records(self, tenant: str | None) -> list[TokenRecord]:
        """Live tokens of ``tenant`` (None: of every tenant), without secrets, oldest first."""
        if tenant is None:
            indexes = sorted(self.redis.scan_iter(index_key("*"), count=SCAN_COUNT))
        else:
            indexes = [index_key(tenant)]
        now_ms = int(time.time() * 1000)
        ids: list[str] = []
        for index in indexes:
            self.redis.zremrangebyscore(index, "-inf", now_ms)
            ids += self.redis.zrange(index, 0, -1)
        pipe = self.redis.pipeline()
        for token_id in ids:
            pipe.hget(token_key(token_id), "record")
        records = [TokenRecord(**json.loads(raw)) for raw in pipe.execute() if raw]
        return sorted(records, key=lambda r: (r.created, r.id))

    def record(self, token_id: str) -> TokenRecord | None:
        raw = self.redis.hget(token_key(token_id), "record") if TOKEN_ID.fullmatch(token_id) else None
        return TokenRecord(**json.loads(raw)) if raw else None

    def revoke(self, token_id: str) -> None:
        record = self.record(token_id)
        if record is None or record.role == OPERATOR:
            raise NotFound(f"no live token {token_id!r}", code="no_such_token")
        pipe = self.redis.pipeline()
        pipe.delete(token_key(token_id))
        pipe.zrem(index_key(record.tenant), token_id)
        pipe.execute()
        with self._lock:
            self._cache.pop(token_id, None)

    # -- authenticating ---------------------------------------------------------------------------
    def authenticate(self, token: str) -> Principal:
        """The caller a bearer token stands for; Unauthenticated if it is unknown, expired or
        revoked. Reads Redis when the cache cannot answer."""
        return self._verify(token, self._lookup, self.internal_token)

    def cached(self, token: str) -> Principal | None:
        """``authenticate`` from the cache alone: the caller, Unauthenticated, or None when only
        Redis can tell (an entry missing or older than CACHE_SECONDS). Never blocks."""
        try:
            return self._verify(token, self._cached_entry, self._cached_internal)
        except _NotCached:
            return None

    def _verify(self, token: str, lookup: Callable[[str], _Entry | None], internal: Callable[[], str]) -> Principal:
        match = TOKEN.fullmatch(token)
        hashed = digest(token)
        # an issued token names its record; anything else may be the operator's (of its own making)
        # or the gateways' internal one
        for token_id in ([match.group(1)] if match else []) + [OPERATOR_TOKEN_ID]:
            entry = lookup(token_id)
            if entry is not None and hmac.compare_digest(entry.hash, hashed):
                record = entry.record
                if record.expires and record.expires <= time.time():
                    raise Unauthenticated("the token has expired", code="unauthenticated")
                return record.principal()
        if match is None and hmac.compare_digest(token.encode(), internal().encode()):
            return NODE_PRINCIPAL
        raise Unauthenticated("the token is unknown, expired or revoked", code="unauthenticated")

    def _cached_entry(self, token_id: str) -> _Entry | None:
        now = self._clock()
        with self._lock:
            entry = self._cache.get(token_id)
            if entry is None or now - entry.read_at >= CACHE_SECONDS:
                raise _NotCached(token_id)
            entry.used = now
        return entry

    def _cached_internal(self) -> str:
        if self._internal is None:
            raise _NotCached(INTERNAL_TOKEN_KEY)
        return self._internal

    def _lookup(self, token_id: str) -> _Entry | None:
        try:
            return self._cached_entry(token_id)
        except _NotCached:
            pass
        now = self._clock()
        stored = self.redis.hgetall(token_key(token_id))
        if not stored:
            with self._lock:
                self._cache.pop(token_id, None)
            return None
        fresh = _Entry(now, stored["hash"], TokenRecord(**json.loads(stored["record"])))
        with self._lock:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[token_id] = fresh
        return fresh

    def refresh(self) -> int:
        """Read the hot entries again in one pipelined call (at most MAX_REFRESHED) and forget
        entries nobody used for HOT_SECONDS; how many were read. Blocks: run it off the loop."""
        now = self._clock()
        with self._lock:
            cold = [i for i, e in self._cache.items() if now - e.used >= HOT_SECONDS]
            for token_id in cold:
                del self._cache[token_id]
            hot = list(itertools.islice(self._cache, MAX_REFRESHED))
        if not hot:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for token_id in hot:
            pipe.hgetall(token_key(token_id))
        stored = pipe.execute()
        with self._lock:
            for token_id, fields in zip(hot, stored):
                old = self._cache.get(token_id)
                if not fields:
                    self._cache.pop(token_id, None)  # revoked or expired: the next request is refused
                elif old is not None and old.read_at < now:  # not revoked here meanwhile, nor read since
                    fresh = _Entry(now, fields["hash"], TokenRecord(**json.loads(fields["record"])))
                    fresh.used = old.used
                    self._cache[token_id] = fresh
        return len(hot)
