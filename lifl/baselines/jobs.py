"""Jobs, rounds and models of the baseline systems, in Redis (the coordinator's store).

The same round rules as lifl's (``lifl.state``): a job has a goal of updates per round; an
update trained from another version than the current one is refused (``version_conflict``),
and so is one arriving after the round has its goal (``round_full``); the top aggregator
installs the next version. The baselines keep no leases, tokens or tenants: they stand for the
data and control planes being compared, not for lifl's API.

Redis keys (``bl:`` for baseline): ``bl:job:{job}`` a hash (goal, version, accepted, spec),
``bl:model:{job}`` the current model's blob, ``bl:rounds:{job}`` a list of finished rounds.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lifl import format as fmt
from lifl import kernels
from lifl.errors import BadRequest, Conflict, NotFound
from lifl.redisconn import bulk_client
from lifl.state import RESERVE_FULL, RESERVE_NO_JOB, RESERVE_NO_MODEL, RESERVE_STALE, refusal

JOB_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
MAX_GOAL = 10_000
INSTALLS = "bl:installs"  # pub/sub: "<job> <version>" each time a job's version is installed

# -> {slot, version} on success, else {RESERVE_*, version}
_TAKE_SLOT = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {%d, 0} end
local version = tonumber(redis.call('HGET', h, 'version'))
if version < 0 then return {%d, version} end
if tonumber(ARGV[1]) ~= version then return {%d, version} end
local accepted = tonumber(redis.call('HGET', h, 'accepted'))
if accepted >= tonumber(redis.call('HGET', h, 'goal')) then return {%d, version} end
redis.call('HINCRBY', h, 'accepted', 1)
return {accepted, version}
""" % (RESERVE_NO_JOB, RESERVE_NO_MODEL, RESERVE_STALE, RESERVE_FULL)

# ARGV: version the model is the result of, its blob, the round's record, the job -> 1 installed, 0 stale
_INSTALL = """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'version')) ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', h, 'version', tonumber(ARGV[1]) + 1, 'accepted', 0)
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('PUBLISH', '""" + INSTALLS + """', ARGV[4] .. ' ' .. (tonumber(ARGV[1]) + 1))
return 1
"""


def job_key(job: str) -> str:
    return f"bl:job:{job}"


def model_key(job: str) -> str:
    return f"bl:model:{job}"


def rounds_key(job: str) -> str:
    return f"bl:rounds:{job}"


def check_job_name(name: Any) -> str:
    if not isinstance(name, str) or not JOB_NAME.fullmatch(name):
        raise BadRequest(f"a job name is 1-63 lowercase letters, digits and dashes, got {str(name)[:80]!r}", code="bad_job")
    return name


@dataclass
class Status:
    job: str
    goal: int
    version: int  # -1: no model yet
    accepted: int  # updates taken in the current round

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "goal": self.goal, "version": self.version, "accepted": self.accepted}


class Jobs:
    def __init__(self, url: str) -> None:
        self.redis = bulk_client(url)
        self._take = self.redis.register_script(_TAKE_SLOT)
        self._install = self.redis.register_script(_INSTALL)
        self._specs: dict[str, tuple[bytes, fmt.ModelSpec]] = {}

    def create(self, job: Any, goal: Any) -> Status:
        name = check_job_name(job)
        if not isinstance(goal, int) or isinstance(goal, bool) or not 1 <= goal <= MAX_GOAL:
            raise BadRequest(f"goal must be an integer in [1, {MAX_GOAL}], got {str(goal)[:32]!r}", code="bad_goal")
        if not self.redis.hsetnx(job_key(name), "goal", goal):
            raise Conflict(f"job {name!r} already exists", code="job_exists")
        self.redis.hset(job_key(name), mapping={"version": -1, "accepted": 0})
        return self.status(name)

    def status(self, job: str) -> Status:
        fields = self.redis.hmget(job_key(check_job_name(job)), "goal", "version", "accepted")
        if fields[0] is None:
            raise NotFound(f"job {job!r} does not exist", code="no_such_job")
        return Status(job, int(fields[0]), int(fields[1] or -1), int(fields[2] or 0))

    def spec(self, job: str) -> fmt.ModelSpec:
        """The job's model (what every update must match), cached by its JSON."""
        text = self.redis.hget(job_key(job), "spec")
        if text is None:
            raise Conflict(f"job {job!r} has no model yet; PUT /v1/jobs/{job}/model first", code="no_model")
        hit = self._specs.get(job)
        if hit is None or hit[0] != text:
            hit = self._specs[job] = (text, fmt.ModelSpec.from_json(json.loads(text)))
        return hit[1]

    def set_model(self, job: str, blob: bytes | bytearray | memoryview) -> int:
        """The initial model (version 0)."""
        status = self.status(job)
        layout = kernels.validate(blob)
        if status.version >= 0 or not self.redis.hsetnx(job_key(job), "spec", json.dumps(layout.spec().to_json())):
            raise Conflict(f"job {job!r} already has a model", code="model_exists")
        self.redis.set(model_key(job), bytes(blob))
        self.redis.hset(job_key(job), "version", 0)
        self.redis.publish(INSTALLS, f"{job} 0")
        return 0

    def model(self, job: str) -> tuple[int, bytes]:
        """(version, blob) of the current model."""
        if self.status(job).version < 0:
            raise Conflict(f"job {job!r} has no model yet", code="no_model")
        with self.redis.pipeline() as p:
            p.hget(job_key(job), "version")
            p.get(model_key(job))
            got_version, blob = p.execute()
        return int(got_version), blob

    def take_slot(self, job: str, base_version: int) -> tuple[int, int]:
        """(slot in the round, version) for an update trained from ``base_version``, or the refusal."""
        slot, version = self._take(keys=[job_key(job)], args=[base_version])
        if slot < 0:
            goal = int(self.redis.hget(job_key(job), "goal") or 0)
            raise refusal(slot, job, version, version, goal, base_version=base_version)
        return slot, version

    def mark_taken(self, job: str, updates: int) -> None:
        """An aggregator holds ``updates`` more client updates (``taken``, and when: ``taken_at``):
        where a comparison sees an update reach its aggregator."""
        with self.redis.pipeline(transaction=False) as p:
            p.hincrby(job_key(job), "taken", updates)
            p.hset(job_key(job), "taken_at", repr(time.time()))
            p.execute()

    def taken(self, job: str) -> tuple[int, float]:
        """(client updates aggregators took, when the last was taken)."""
        taken, at = self.redis.hmget(job_key(job), "taken", "taken_at")
        return int(taken or 0), float(at or "nan")

    def install(self, job: str, version: int, blob: bytes | bytearray | memoryview, samples: int, updates: int,
                started: float) -> bool:
        """Make ``blob`` version ``version + 1``; False if the round is no longer current (checked
        first, so a late top does not send its model for nothing; the script checks again)."""
        if int(self.redis.hget(job_key(job), "version") or -1) != version:
            return False
        record = json.dumps({"version": version + 1, "samples": samples, "updates": updates,
                             "installed_at": time.time(), "aggregation_s": time.time() - started})
        return bool(self._install(keys=[job_key(job), model_key(job), rounds_key(job)], args=[version, bytes(blob), record, job]))

    def installs(self) -> Iterator[tuple[str, int] | None]:
        """(job, version) as versions are installed, subscribed before this returns; None every
        second of quiet."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(INSTALLS)
        return self._installs(pubsub)

    @staticmethod
    def _installs(pubsub: Any) -> Iterator[tuple[str, int] | None]:
        try:
            while True:
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    yield None
                    continue
                job, _, version = message["data"].decode().partition(" ")
                yield job, int(version)
        finally:
            pubsub.close()

    def round_count(self, job: str) -> int:
        return int(self.redis.llen(rounds_key(job)))

    def rounds(self, job: str) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self.redis.lrange(rounds_key(job), 0, -1)]
