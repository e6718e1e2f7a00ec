"""Cluster state in Redis: the one truth that gateways, agents and the autoscaler share.

Model bytes never go through Redis: only job specs, versions, round accounting, where each
global model lives (node and object key) and which aggregators each node runs.

Each job is a hash ``lifl:job:<name>``. Every transition that must not race (reserving a
slot in the round, installing a new version) is one Lua script, so it is atomic across all
nodes sharing the Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from lifl.errors import Conflict, NotFound
from lifl.format import ModelSpec
from lifl.jobs import JobSpec

NO_MODEL = -1
TENANT_UID_BASE = 610000  # tenants' functions run as uid/gid TENANT_UID_BASE + n

_RESERVE = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {-1, 0} end
local v = tonumber(redis.call('HGET', h, 'version'))
if v < 0 then return {-2, v} end
if v ~= tonumber(ARGV[1]) then return {-3, v} end
if tonumber(redis.call('HGET', h, 'reserved')) >= tonumber(redis.call('HGET', h, 'goal')) then return {-4, v} end
redis.call('HINCRBY', h, 'reserved', 1)
return {0, v}
"""

# ARGV: version, field, delta. Counts only for the round it was meant for.
_COUNT = """
if tonumber(redis.call('HGET', KEYS[1], 'version')) ~= tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# ARGV: old version, new version, key, node, spec json, round summary json
_INSTALL = """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'version')) ~= tonumber(ARGV[1]) then return 0 end
local fields = redis.call('HKEYS', h)
for _, f in ipairs(fields) do
  if string.sub(f, 1, 9) == 'rejected.' then redis.call('HDEL', h, f) end
end
redis.call('HSET', h, 'version', ARGV[2], 'model_key', ARGV[3], 'model_node', ARGV[4],
           'reserved', 0, 'accepted', 0, 'aggregated', 0, 'last_round', ARGV[6])
if ARGV[5] ~= '' then redis.call('HSET', h, 'model_spec', ARGV[5]) end
return 1
"""

RESERVE_OK, RESERVE_NO_JOB, RESERVE_NO_MODEL, RESERVE_STALE, RESERVE_FULL = 0, -1, -2, -3, -4


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    version: int
    model_key: str
    model_node: str
    model_spec: ModelSpec | None
    reserved: int
    accepted: int
    aggregated: int
    rejected: dict[str, int]
    last_round: dict[str, Any] | None


def job_key(name: str) -> str:
    return f"lifl:job:{name}"


class ClusterState:
    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url, decode_responses=True)
        self._reserve = self.redis.register_script(_RESERVE)
        self._count = self.redis.register_script(_COUNT)
        self._install = self.redis.register_script(_INSTALL)
        self._specs: dict[str, ModelSpec] = {}

    def ping(self) -> None:
        self.redis.ping()

    # -- jobs -----------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> None:
        created = self.redis.hsetnx(job_key(spec.job), "spec", spec.to_json())
        if not created:
            raise Conflict(f"job {spec.job!r} already exists", code="job_exists", grpc_status="ALREADY_EXISTS")
        self.redis.hset(
            job_key(spec.job),
            mapping={"goal": spec.goal, "version": NO_MODEL, "reserved": 0, "accepted": 0, "aggregated": 0, "model_key": "", "model_node": ""},
        )
        self.redis.sadd("lifl:jobs", spec.job)

    def job(self, name: str) -> Job:
        h = self.redis.hgetall(job_key(name))
        if not h or "version" not in h:
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        return Job(
            spec=JobSpec.from_json(h["spec"]),
            version=int(h["version"]),
            model_key=h.get("model_key", ""),
            model_node=h.get("model_node", ""),
            model_spec=self._model_spec(h.get("model_spec", "")),
            reserved=int(h["reserved"]),
            accepted=int(h["accepted"]),
            aggregated=int(h["aggregated"]),
            rejected={k[9:]: int(v) for k, v in h.items() if k.startswith("rejected.")},
            last_round=json.loads(h["last_round"]) if h.get("last_round") else None,
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

    # -- rounds ---------------------------------------------------------------------------------
    def reserve(self, name: str, base_version: int) -> tuple[int, int]:
        """Take one of the round's ``goal`` slots for an update trained from ``base_version``."""
        status, version = self._reserve(keys=[job_key(name)], args=[base_version])
        return int(status), int(version)

    def count(self, name: str, version: int, field: str, delta: int = 1) -> bool:
        """Add to a per-round counter (reserved, accepted, aggregated, rejected.<code>)."""
        return bool(self._count(keys=[job_key(name)], args=[version, field, delta]))

    def set_initial_model(self, name: str, key: str, node: str, spec: ModelSpec) -> None:
        if not self._install(keys=[job_key(name)], args=[NO_MODEL, 0, key, node, json.dumps(spec.to_json()), ""]):
            raise Conflict(f"job {name!r} already has a model", code="model_exists")

    def install(self, name: str, old_version: int, key: str, node: str, summary: dict[str, Any]) -> bool:
        """Make ``key`` version old_version + 1 if the job is still at old_version."""
        return bool(self._install(keys=[job_key(name)], args=[old_version, old_version + 1, key, node, "", json.dumps(summary)]))

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
