"""Cluster state in Redis: the one truth that gateways, agents and the autoscaler share.

Model bytes never go through Redis: only job specs, versions, rounds and their accounting,
client leases, where each global model lives (node and object key) and what each node runs.

A job is the hash ``lifl:job:<name>``. Its rounds are numbered apart from its versions: a
round that completes installs version v+1 and opens the next round; a round abandoned at its
deadline opens the next round on the same version. Clients may hold leases (a sorted set by
expiry, renewed by heartbeats) that keep them a place in the round while they train; up to
``over_selection`` x goal clients may train at once, and the first ``goal`` updates win.

Every transition that must not race is one Lua script, timed by the Redis server's clock, so
it is atomic across all nodes sharing the Redis.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

import redis

from lifl.errors import Conflict, NotFound
from lifl.format import ModelSpec
from lifl.jobs import JobSpec

NO_MODEL = -1
TENANT_UID_BASE = 610000  # tenants' functions run as uid/gid TENANT_UID_BASE + n
HISTORY = 10000  # rounds kept per job

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function field(h, f) return tonumber(redis.call('HGET', h, f)) end
"""

# KEYS: job, leases. ARGV: base version, lease ('' for none). -> {status, version, round}
_RESERVE = _NOW + """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1, 0, 0} end
local v, r = field(h, 'version'), field(h, 'round')
if v < 0 then return {-2, v, r} end
if v ~= tonumber(ARGV[1]) then return {-3, v, r} end
if field(h, 'closed') == 1 then return {-5, v, r} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms())
if ARGV[2] ~= '' then redis.call('ZREM', KEYS[2], ARGV[2]) end
if field(h, 'reserved') >= field(h, 'goal') then return {-4, v, r} end
redis.call('HINCRBY', h, 'reserved', 1)
return {0, v, r}
"""

# KEYS: job, leases. ARGV: lease id, ttl ms, max leases. -> {status, version, round}
_TAKE_LEASE = _NOW + """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1, 0, 0} end
local v, r = field(h, 'version'), field(h, 'round')
if v < 0 then return {-2, v, r} end
if field(h, 'closed') == 1 then return {-5, v, r} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if field(h, 'reserved') + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then return {-4, v, r} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return {0, v, r}
"""

# KEYS: leases. ARGV: lease, ttl ms. -> 1 renewed, 0 expired or unknown
_HEARTBEAT = _NOW + """
local now = now_ms()
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: job. ARGV: round, field, delta. Counts only for the round it was meant for.
_COUNT = """
if tonumber(redis.call('HGET', KEYS[1], 'round')) ~= tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# KEYS: job. ARGV: round. Closes the round to new updates -> accepted updates, or -1.
_CLOSE = """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) or tonumber(redis.call('HGET', h, 'closed')) == 1 then
  return -1
end
redis.call('HSET', h, 'closed', 1)
return tonumber(redis.call('HGET', h, 'accepted'))
"""

# KEYS: job, leases, history. ARGV: round expected, new version, model key ('' keeps it), node,
# summary json ('' records nothing), model spec json ('' keeps it). -> opening time (ms), or -1.
_NEXT_ROUND = _NOW + """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) then return -1 end
for _, f in ipairs(redis.call('HKEYS', h)) do
  if string.sub(f, 1, 9) == 'rejected.' then redis.call('HDEL', h, f) end
end
local now = now_ms()
redis.call('HSET', h, 'version', ARGV[2], 'round', tonumber(ARGV[1]) + 1, 'round_opened', now, 'closed', 0,
           'reserved', 0, 'accepted', 0, 'aggregated', 0)
if ARGV[3] ~= '' then redis.call('HSET', h, 'model_key', ARGV[3], 'model_node', ARGV[4]) end
if ARGV[6] ~= '' then redis.call('HSET', h, 'model_spec', ARGV[6]) end
redis.call('DEL', KEYS[2])
if ARGV[5] ~= '' then
  redis.call('HSET', h, 'last_round', ARGV[5])
  redis.call('RPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[7]), -1)
end
return now
"""

RESERVE_OK, RESERVE_NO_JOB, RESERVE_NO_MODEL, RESERVE_STALE, RESERVE_FULL, RESERVE_CLOSED = 0, -1, -2, -3, -4, -5


def refusal(status: int, job: str, version: int, round_id: int, goal: int) -> Exception:
    """The error a client gets when it cannot take part in the round (reserve or lease)."""
    if status == RESERVE_NO_JOB:
        return NotFound(f"job {job!r} does not exist", code="no_such_job")
    if status == RESERVE_NO_MODEL:
        return Conflict(f"job {job!r} has no model yet; PUT /v1/jobs/{job}/model first", code="no_model")
    if status == RESERVE_STALE:
        return Conflict(f"update was trained from another version; the current version is {version}",
                        code="version_conflict", extra={"version": version})
    if status == RESERVE_FULL:
        return Conflict(f"round {round_id} (version {version}) already has its {goal} updates or clients; pull the next version",
                        code="round_full", extra={"version": version})
    return Conflict(f"round {round_id} (version {version}) is closed: its deadline passed", code="round_closed",
                    extra={"version": version})


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    version: int
    round: int
    round_opened: float  # seconds since the epoch
    closed: bool
    model_key: str
    model_node: str
    model_spec: ModelSpec | None
    reserved: int
    accepted: int
    aggregated: int
    rejected: dict[str, int]
    last_round: dict[str, Any] | None
    checkpoint: int  # latest version durably checkpointed, -1 if none


def job_key(name: str) -> str:
    return f"lifl:job:{name}"


def leases_key(name: str) -> str:
    return f"lifl:job:{name}:leases"


def history_key(name: str) -> str:
    return f"lifl:job:{name}:rounds"


class ClusterState:
    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self._reserve = self.redis.register_script(_RESERVE)
        self._take_lease = self.redis.register_script(_TAKE_LEASE)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._count = self.redis.register_script(_COUNT)
        self._close = self.redis.register_script(_CLOSE)
        self._next_round = self.redis.register_script(_NEXT_ROUND)
        self._specs: dict[str, ModelSpec] = {}

    def ping(self) -> None:
        self.redis.ping()

    # -- jobs -----------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> None:
        created = self.redis.hsetnx(job_key(spec.job), "spec", spec.to_json())
        if not created:
            raise Conflict(f"job {spec.job!r} already exists", code="job_exists", grpc_status="ALREADY_EXISTS")
        self.redis.hset(job_key(spec.job), mapping={
            "goal": spec.goal, "version": NO_MODEL, "round": -1, "round_opened": 0, "closed": 0, "reserved": 0,
            "accepted": 0, "aggregated": 0, "model_key": "", "model_node": "", "checkpoint": -1,
        })
        self.redis.sadd("lifl:jobs", spec.job)

    def job(self, name: str) -> Job:
        h = self.redis.hgetall(job_key(name))
        if not h or "version" not in h:
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        return Job(
            spec=JobSpec.from_json(h["spec"]),
            version=int(h["version"]),
            round=int(h["round"]),
            round_opened=int(h["round_opened"]) / 1000,
            closed=h["closed"] == "1",
            model_key=h.get("model_key", ""),
            model_node=h.get("model_node", ""),
            model_spec=self._model_spec(h.get("model_spec", "")),
            reserved=int(h["reserved"]),
            accepted=int(h["accepted"]),
            aggregated=int(h["aggregated"]),
            rejected={k[9:]: int(v) for k, v in h.items() if k.startswith("rejected.")},
            last_round=json.loads(h["last_round"]) if h.get("last_round") else None,
            checkpoint=int(h["checkpoint"]),
        )

    def _model_spec(self, text: str) -> ModelSpec | None:
        """Parsed once per distinct spec (it never changes once a job's model is set)."""
        if not text:
            return None
        spec = self._specs.get(text)
        if spec is None:
            if len(self._specs) > 256:
                self._specs.clear()
            spec = self._specs[text] = ModelSpec.from_json(json.loads(text))
        return spec

    def job_names(self) -> list[str]:
        return sorted(self.redis.smembers("lifl:jobs"))

    def version(self, name: str) -> int:
        v = self.redis.hget(job_key(name), "version")
        if v is None:
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        return int(v)

    def rounds(self, name: str, limit: int) -> list[dict[str, Any]]:
        """The last ``limit`` finished rounds, oldest first."""
        if not self.redis.exists(job_key(name)):
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        return [json.loads(r) for r in self.redis.lrange(history_key(name), -limit, -1)]

    # -- rounds ---------------------------------------------------------------------------------
    def reserve(self, name: str, base_version: int, lease: str = "") -> tuple[int, int, int]:
        """Take one of the round's ``goal`` slots for an update: (status, version, round)."""
        status, version, round_id = self._reserve(keys=[job_key(name), leases_key(name)], args=[base_version, lease])
        return int(status), int(version), int(round_id)

    def take_lease(self, spec: JobSpec) -> tuple[str, int, int]:
        """A lease for a client about to train: (lease id, version, round); raises if refused."""
        lease = secrets.token_hex(12)
        limit = math.ceil(spec.goal * spec.over_selection)
        status, version, round_id = self._take_lease(
            keys=[job_key(spec.job), leases_key(spec.job)], args=[lease, int(spec.lease_ttl_s * 1000), limit])
        if status != RESERVE_OK:
            raise refusal(int(status), spec.job, int(version), int(round_id), spec.goal)
        return lease, int(version), int(round_id)

    def heartbeat(self, spec: JobSpec, lease: str) -> bool:
        return bool(self._heartbeat(keys=[leases_key(spec.job)], args=[lease, int(spec.lease_ttl_s * 1000)]))

    def release_lease(self, name: str, lease: str) -> bool:
        return bool(self.redis.zrem(leases_key(name), lease))

    def active_leases(self, name: str) -> int:
        t = self.redis.time()
        now = t[0] * 1000 + t[1] // 1000
        return int(self.redis.zcount(leases_key(name), f"({now}", "+inf"))

    def count(self, name: str, round_id: int, field: str, delta: int = 1) -> bool:
        """Add to a counter of round ``round_id`` (reserved, accepted, aggregated, rejected.<code>)."""
        return bool(self._count(keys=[job_key(name)], args=[round_id, field, delta]))

    def close_round(self, name: str, round_id: int) -> int:
        """Stop round ``round_id`` taking updates; returns how many it accepted, -1 if not open."""
        return int(self._close(keys=[job_key(name)], args=[round_id]))

    def next_round(self, name: str, round_id: int, version: int, *, key: str = "", node: str = "",
                   summary: dict[str, Any] | None = None, spec: ModelSpec | None = None) -> float:
        """Finish round ``round_id`` (recording ``summary``) and open the next on ``version``;
        returns its opening time (s), or -1 if the round had moved on already."""
        opened = self._next_round(
            keys=[job_key(name), leases_key(name), history_key(name)],
            args=[round_id, version, key, node, json.dumps(summary) if summary else "",
                  json.dumps(spec.to_json()) if spec else "", HISTORY],
        )
        return int(opened) / 1000 if int(opened) >= 0 else -1.0

    def set_checkpoint(self, name: str, version: int) -> None:
        self.redis.hset(job_key(name), "checkpoint", version)

    # -- tenants and nodes ----------------------------------------------------------------------
    def tenant_id(self, tenant: str) -> int:
        """The uid/gid of a tenant's functions, the same on every node."""
        existing = self.redis.hget("lifl:tenants", tenant)
        if existing is not None:
            return int(existing)
        candidate = TENANT_UID_BASE + int(self.redis.incr("lifl:tenant-seq"))
        self.redis.hsetnx("lifl:tenants", tenant, candidate)
        return int(self.redis.hget("lifl:tenants", tenant))

    def publish_node(self, node: str, status: dict[str, Any], ttl: int = 10) -> None:
        self.redis.set(f"lifl:node:{node}", json.dumps(status), ex=ttl)

    def nodes(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key in self.redis.scan_iter("lifl:node:*"):
            raw = self.redis.get(key)
            if raw:
                out[key.split(":", 2)[2]] = json.loads(raw)
        return out
