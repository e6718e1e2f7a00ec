"""Cluster state in Redis: the one truth that gateways, agents and the control plane share.

Model bytes never go through Redis: only job specs, versions, rounds and their accounting,
client leases and assignments, tokens (lifl.auth), each round's shard plan, where each global model lives (node
and object key), what each node runs and how to reach its gateway.

A job is the hash ``lifl:job:<name>``. Its rounds are numbered apart from its versions: a
round that completes installs version v+1 and opens the next round; a round abandoned at its
deadline opens the next round on the same version. Clients may hold leases (a sorted set by
expiry, renewed by heartbeats) that keep them a place in the round while they train; up to
``over_selection`` x goal clients may train at once, and the first ``goal`` updates win. A
lease is bound to the client that took it, and a client holds one at most.

A round is global: every node's gateway takes updates for it, and its goal counts the
acknowledged updates of all nodes together. Its *shard* (``lifl:job:<name>:shard``, reset
with each round) records the plan (placement policy, expected updates per node, the planned
top node), how many updates each node acknowledged, and, once the round is closed, each
node's final count, the node hosting the top aggregator and its epoch (bumped when the top
moves because its node died), which nodes' partial results reached the top, which nodes
died and what they lost.

Every transition that must not race is one Lua script, timed by the Redis server's clock, so
it is atomic across all nodes; scripts that change a round publish the job's name on
``lifl:events`` so that agents react at once (they also re-read on a timer: a missed message
only delays).
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from lifl.cluster_types import NO_MODEL, Job, Loss, SecureRound, Shard
from lifl.errors import BadRequest, Conflict, Forbidden, NotFound, Overloaded, QuotaBusy, QuotaExceeded, Unavailable
from lifl.format import ModelSpec
from lifl.flstore.retention import RetentionPolicy
from lifl.jobs import JobSpec
from lifl.quotas import DEFAULT_ROUNDS, Quota
from lifl.protocol import NodeStatus, record_from_json, record_json
from lifl.net.resp import Outage
from lifl.redisconn import SCAN_COUNT, STATE_TIMEOUT_S

TENANT_UID_BASE = 610000  # tenants' functions run as uid/gid TENANT_UID_BASE + n
HISTORY = 10000  # rounds kept per job
EVENTS = "lifl:events"  # pub/sub channel: the name of a job whose round changed
ACTIVE = "lifl:active"  # the jobs with a round under way (_TENANT_ROUNDS): what periodic duties visit
EVENTS_RETRY_S = 0.5  # seconds between attempts to subscribe again while Redis is away
NODE_TTL = 6  # seconds of the store answering others in which a node did not refresh its membership (every second): it is gone
STORE_STALL_S = 3  # seconds in which nobody reached the store: it stalled (frozen, restarting), not its nodes
NODE_FORGET_S = 3600  # seconds after which a gone node's membership is removed
NODES, NODES_SEEN, STORE_PULSE = "lifl:nodes", "lifl:nodes:seen", "lifl:pulse"
QUOTAS = "lifl:quotas"  # tenant -> its quota's JSON (lifl.quotas); a tenant not in it has the defaults
CURRENT_ROUND = "*"  # a count's round: whichever is current when it is counted (count_call)

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function field(h, f) return tonumber(redis.call('HGET', h, f)) end
-- a closed round is full (-4) when it met its goal, else closed by its deadline (-5)
local function closed_status(h) if field(h, 'accepted') >= field(h, 'goal') then return -4 end return -5 end
"""

# A call whose answer was not awaited any more may still run: its command can wait in a frozen
# server's socket buffer and run when the server resumes, after its caller told the client 503
# and gave its slot back. Admissions and acceptances therefore carry the time after which they
# must not act (their last argument, the caller's clock in ms, STATE_TIMEOUT_S after sending;
# nodes' clocks must agree with Redis's to well within that), and a late one answers {LATE}.
STATE_LATE = -99
_IN_TIME = """
if now_ms() > tonumber(ARGV[#ARGV]) then return {""" + str(STATE_LATE) + """} end
"""


def late(reply: Any) -> bool:
    """Whether a script's reply says it came too late to act (_IN_TIME)."""
    return isinstance(reply, list) and reply == [STATE_LATE]


def not_after_ms(timeout: float) -> int:
    """The last moment (ms, this machine's clock) a call sent now may act: its caller, waiting
    ``timeout`` seconds for the answer, stops waiting then."""
    return int((time.time() + timeout) * 1000)


# Leases are bound to the client that took them: the hash ``owners`` maps 'lease.<id>' to its
# client and 'client.<id>' to the one lease a client may hold.
# KEYS: job, retention, all jobs, tenant's jobs. ARGV: name, jobs limit (NO_LIMIT: none), retention
# json, then the job's fields and values. -> 1 created, 0 exists, -(1 + jobs) over the quota.
_CREATE_JOB = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local held = redis.call('SCARD', KEYS[4])
if tonumber(ARGV[2]) >= 0 and held >= tonumber(ARGV[2]) then return -1 - held end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
return 1
"""

# A tenant's rounds in progress (its ``rounds`` quota): a job joins the tenant's set with its
# round's first admission and leaves it when the round ends (_NEXT_ROUND); one whose round holds
# nothing any longer (every slot given back, or a write lost with Redis's last second) is dropped
# when the set is found full. The key is tenant_rounds_key's. The job joins and leaves the
# cluster-wide ACTIVE set with it, so that periodic duties visit only jobs with a round under way.
_TENANT_ROUNDS = """
local function tenant_of(h)
  return cjson.decode(redis.call('HGET', h, 'spec')).tenant
end
local function tenant_rounds(tenant)
  return 'lifl:tenant:' .. tenant .. ':rounds'
end
local function round_may_start(h)
  local job, tenant = string.sub(h, #'lifl:job:' + 1), tenant_of(h)
  local rounds = tenant_rounds(tenant)
  redis.call('SADD', '""" + ACTIVE + """', job)
  if redis.call('SISMEMBER', rounds, job) == 1 then return true end
  local limit = """ + str(DEFAULT_ROUNDS) + """
  local quota = redis.call('HGET', '""" + QUOTAS + """', tenant)
  if quota then
    limit = cjson.decode(quota).rounds
    if limit == cjson.null then limit = -1 end
  end
  if limit >= 0 and redis.call('SCARD', rounds) >= limit then
    for _, other in ipairs(redis.call('SMEMBERS', rounds)) do
      local k = 'lifl:job:' .. other
      if tonumber(redis.call('HGET', k, 'reserved') or '0') == 0 and tonumber(redis.call('HGET', k, 'accepted') or '0') == 0 then
        redis.call('SREM', rounds, other)
        redis.call('SREM', '""" + ACTIVE + """', other)
      end
    end
    if redis.call('SCARD', rounds) >= limit then
      redis.call('SREM', '""" + ACTIVE + """', job)
      return false
    end
  end
  redis.call('SADD', rounds, job)
  return true
end
"""

_LEASES = """
local function owns(owners, lease, client)
  return client == '' or redis.call('HGET', owners, 'lease.' .. lease) == client
end
local function forget(owners, lease)
  local client = redis.call('HGET', owners, 'lease.' .. lease)
  redis.call('HDEL', owners, 'lease.' .. lease)
  if client and redis.call('HGET', owners, 'client.' .. client) == lease then redis.call('HDEL', owners, 'client.' .. client) end
end
"""

# The round's update records (a hash of their own, dropped with the round, so that the shard,
# read whole by every duty, stays as small as the number of nodes): 'client.<id>' for each
# client whose update was counted (the node that took it), and, for idempotent batches, each
# upload's token ('' for none): an admission records its slot as 'slot.<token>' (the node) and
# an acceptance its outcome as 'acc.<token>' ('<status>:<accepted>'), so a batch sent again
# because its answer was lost (the connection broke after the script ran) finds what it did and
# does nothing twice.

# KEYS: job, leases, shard, lease owners, excluded, updates, then a secure job's round (lifl.secure_state):
# its hash and its 'sharing' set. ARGV: node, then (token, base version, lease ('' for none), client
# ('' for any)) for each update arriving at that node. -> {status, version,
# round} for each, in order: a batch of admissions costs one call, each checked and counted as if
# alone. A client whose update of the round was counted gets -6. A lease that is not the
# client's is ignored. The slot is also counted against the node whose gateway receives the
# update, so that the slots of a node that dies with uploads in progress can be given back.
_RESERVE = _NOW + _LEASES + _IN_TIME + _TENANT_ROUNDS + """
local h = KEYS[1]
local function reserve(token, base, lease, node, client)
  if redis.call('EXISTS', h) == 0 then return {-1, 0, 0} end
  local v, r = field(h, 'version'), field(h, 'round')
  if v < 0 then return {-2, v, r} end
  if token ~= '' and redis.call('HEXISTS', KEYS[6], 'slot.' .. token) == 1 then return {0, v, r} end  -- sent again
  if base > v or v - base > (field(h, 'max_staleness') or 0) then return {-3, v, r} end
  -- before closed: a client told 503 whose update was counted after all hears so when it sends again
  if client ~= '' and redis.call('HEXISTS', KEYS[6], 'client.' .. client) == 1 then return {-6, v, r} end
  if field(h, 'closed') == 1 then return {closed_status(h), v, r} end
  if client ~= '' and redis.call('SISMEMBER', KEYS[5], client) == 1 then return {-7, v, r} end
  if field(h, 'secure') == 1 then  -- a masked input: from a client that shared its keys, while the round collects
    if client == '' then return {-9, v, r} end
    local sa = redis.call('HMGET', KEYS[7], 'round', 'stage')
    if tonumber(sa[1]) ~= r or sa[2] ~= 'collect' then return {-11, v, r} end
    if redis.call('SISMEMBER', KEYS[8], client) == 0 then return {-12, v, r} end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms())
  if lease ~= '' and owns(KEYS[4], lease, client) then
    redis.call('ZREM', KEYS[2], lease)
    forget(KEYS[4], lease)
  end
  local split = (field(h, 'part_count') or 0) > 0
  if split then
    if client == '' then return {-9, v, r} end
    if redis.call('HEXISTS', KEYS[6], 'gone.' .. client) == 1 then return {-10, v, r} end
    if token ~= '' then redis.call('HSET', KEYS[6], 'tclient.' .. token, client) end
    if redis.call('HEXISTS', KEYS[6], 'part.' .. client) == 1 then  -- another part of an update with a slot
      redis.call('HINCRBY', KEYS[3], 'inflight.' .. node, 1)
      if token ~= '' then redis.call('HSET', KEYS[6], 'slot.' .. token, node) end
      return {0, v, r}
    end
  end
  if field(h, 'reserved') >= field(h, 'goal') then return {-4, v, r} end
  if field(h, 'reserved') == 0 and not round_may_start(h) then return {-8, v, r} end
  redis.call('HINCRBY', h, 'reserved', 1)
  redis.call('HINCRBY', KEYS[3], 'inflight.' .. node, 1)
  if token ~= '' then redis.call('HSET', KEYS[6], 'slot.' .. token, node) end
  if split then redis.call('HSET', KEYS[6], 'part.' .. client, 1) end
  return {0, v, r}
end
local out = {}
for i = 2, #ARGV - 1, 4 do
  local status = reserve(ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[1], ARGV[i + 3])
  out[#out + 1] = status[1]
  out[#out + 1] = status[2]
  out[#out + 1] = status[3]
end
return out
"""

# KEYS: job, shard, updates. ARGV: node, then (token, round, counter ('' for none)) for each upload
# that gives its slot back (refused, aborted, lost): the slot goes, once, and the refusal is
# counted then. A token names its slot (tokens live as long as their round: the round given is not
# needed); an upload without one gives back a slot of its round on that node. A part of a split
# job's update gives back its update's slot if no other part of it was acknowledged, else marks
# the round lost (``parts_lost``: the round duties abandon it). -> how many went back.
_UNRESERVE = """
local given = 0
for i = 2, #ARGV, 3 do
  local token = ARGV[i]
  local back
  if token ~= '' then
    back = redis.call('HDEL', KEYS[3], 'slot.' .. token) == 1
  else
    back = tonumber(redis.call('HGET', KEYS[1], 'round')) == tonumber(ARGV[i + 1])
  end
  local client = token ~= '' and redis.call('HGET', KEYS[3], 'tclient.' .. token)
  if back and client then  -- a part of an update split across nodes
    redis.call('HINCRBY', KEYS[2], 'inflight.' .. ARGV[1], -1)
    if redis.call('HEXISTS', KEYS[3], 'pacc.' .. client .. '.' .. ARGV[1]) == 0 then  -- not a duplicate's
      if tonumber(redis.call('HGET', KEYS[3], 'pdone.' .. client) or '0') > 0 then
        -- another node folds a part of it already: the round can only be abandoned
        redis.call('HSETNX', KEYS[1], 'parts_lost', 'a part of the update of client ' .. client .. ' on node ' ..
                   ARGV[1] .. ' was given up after other parts of it were acknowledged')
      elseif redis.call('HDEL', KEYS[3], 'part.' .. client) == 1 then
        redis.call('HSET', KEYS[3], 'gone.' .. client, 1)
        redis.call('HINCRBY', KEYS[1], 'reserved', -1)
        if ARGV[i + 2] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[i + 2], 1) end
      end
    end
    given = given + 1
  elseif back then
    redis.call('HINCRBY', KEYS[1], 'reserved', -1)
    redis.call('HINCRBY', KEYS[2], 'inflight.' .. ARGV[1], -1)
    if ARGV[i + 2] ~= '' then redis.call('HINCRBY', KEYS[1], ARGV[i + 2], 1) end
    given = given + 1
  end
end
return given
"""

# KEYS: job, leases, shard, lease owners, excluded, updates. ARGV: lease id, ttl ms, max leases, client.
# -> {status, version, round, lease}. A client holds at most one lease: asking again renews and
# returns the one it holds. A client whose update of the round was counted gets -6.
_TAKE_LEASE = _NOW + _LEASES + """
local h, owners, client = KEYS[1], KEYS[4], ARGV[4]
if redis.call('EXISTS', h) == 0 then return {-1, 0, 0, ''} end
local v, r = field(h, 'version'), field(h, 'round')
if v < 0 then return {-2, v, r, ''} end
if field(h, 'closed') == 1 then return {closed_status(h), v, r, ''} end
if redis.call('HEXISTS', KEYS[6], 'client.' .. client) == 1 then return {-6, v, r, ''} end
if redis.call('SISMEMBER', KEYS[5], client) == 1 then return {-7, v, r, ''} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('HGET', owners, 'client.' .. client)
if held then
  if redis.call('ZSCORE', KEYS[2], held) then
    redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[2]), held)
    return {0, v, r, held}
  end
  forget(owners, held)
end
if field(h, 'reserved') + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then return {-4, v, r, ''} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', owners, 'lease.' .. ARGV[1], client, 'client.' .. client, ARGV[1])
return {0, v, r, ARGV[1]}
"""

# KEYS: leases, lease owners. ARGV: lease, ttl ms, client ('' for any). -> 1 renewed, 0 expired,
# unknown or another client's
_HEARTBEAT = _NOW + _LEASES + """
if not owns(KEYS[2], ARGV[1], ARGV[3]) then return 0 end
local now = now_ms()
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  forget(KEYS[2], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: leases, lease owners. ARGV: lease, client ('' for any). -> 1 released, 0 unknown or another's
_RELEASE_LEASE = _LEASES + """
if not owns(KEYS[2], ARGV[1], ARGV[2]) then return 0 end
forget(KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

# KEYS: job. ARGV: (round, field, delta) for each count. Counts only for the round it was meant
# for (CURRENT_ROUND: whichever is current), and only for a job that exists.
_COUNT = """
local counted = 0
local round = redis.call('HGET', KEYS[1], 'round')
for i = 1, #ARGV, 3 do
  if round and (ARGV[i] == '*' or tonumber(round) == tonumber(ARGV[i])) then
    redis.call('HINCRBY', KEYS[1], ARGV[i + 1], ARGV[i + 2])
    counted = counted + 1
  end
end
return counted
"""

# KEYS: job, shard, leases, retention, secure round. A job as one snapshot: the Redis clock (ms), the
# job's and its shard's fields, the live leases, the retention policy (false: the spec's), and a
# secure job's round (lifl.secure_state).
_JOB_VIEW = _NOW + """
local now = now_ms()
return {now, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]),
        redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf'), redis.call('GET', KEYS[4]), redis.call('HGETALL', KEYS[5])}
"""

# Freezes the round: no more updates; each node's count becomes final. (Lua, shared)
_FINALIZE = """
local function finalize(h, s)
  redis.call('HSET', h, 'closed', 1)
  local all = redis.call('HGETALL', s)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 6) == 'count.' then
      redis.call('HSET', s, 'final.' .. string.sub(all[i], 7), all[i + 1])
    end
  end
  redis.call('HSET', s, 'finalized', 1, 'closed_ms', now_ms())
end
"""

# KEYS: job, shard, updates, then a secure job's round (lifl.secure_state): its hash, its 'sharing' and
# 'masked' sets. ARGV: node, job name, then (token, round, client ('' for any)) for each update
# that arrived whole at that node; one update per client and round. Each is an acknowledged
# update, counted once for the whole round, on the node that took it; the one that meets the
# goal closes the round (and the batch's later ones find it closed). -> {status, accepted} for
# each: 1 closed it, 0 counted, -1 another round, -5 closed, -6 this node was declared dead for
# this round, -7 the client's update of this round was counted already (its slot is given back).
# An update whose token was accepted already gets the same answer again.
_ACCEPT = _NOW + _FINALIZE + _IN_TIME + """
local h, s, t, node = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local function decided(token, status, accepted)
  if token ~= '' then
    redis.call('HDEL', t, 'slot.' .. token)
    redis.call('HSET', t, 'acc.' .. token, status .. ':' .. accepted)
  end
  return status, accepted
end
local secure = field(h, 'secure') == 1
local function count_update()  -- one more acknowledged update: the one that meets the goal closes the round
  local accepted = redis.call('HINCRBY', h, 'accepted', 1)
  -- a secure round's goal: a masked input from every client that shared; then its survivors sign the list of them
  local goal = secure and redis.call('SCARD', KEYS[5]) or field(h, 'goal')
  if accepted >= goal then
    if secure then
      redis.call('HSET', KEYS[4], 'stage', 'consistency', 'deadline', now_ms() + tonumber(redis.call('HGET', KEYS[4], 'timeout')))
    end
    finalize(h, s)
    redis.call('PUBLISH', '""" + EVENTS + """', ARGV[2])
    return 1, accepted
  end
  return 0, accepted
end
local function arrived()  -- an update (or a part of one) arrived whole at this node
  redis.call('HINCRBY', s, 'count.' .. node, 1)
  redis.call('HINCRBY', s, 'inflight.' .. node, -1)
  redis.call('HSETNX', s, 'first_ms', now_ms())
end
local function accept(token, round, client)
  if token ~= '' then
    local prior = redis.call('HGET', t, 'acc.' .. token)
    if prior then
      local colon = string.find(prior, ':', 1, true)
      return tonumber(string.sub(prior, 1, colon - 1)), tonumber(string.sub(prior, colon + 1))
    end
  end
  if field(h, 'round') ~= round then return -1, 0 end
  if field(h, 'closed') == 1 then return -5, 0 end
  if redis.call('HEXISTS', s, 'dead.' .. node) == 1 then return -6, 0 end
  local parts = field(h, 'part_count') or 0
  if parts > 0 then  -- a part of an update split across nodes: the update counts once all its parts are in
    if client == '' or redis.call('HEXISTS', t, 'gone.' .. client) == 1 then
      redis.call('HINCRBY', s, 'inflight.' .. node, -1)
      return decided(token, -8, 0)
    end
    if redis.call('HSETNX', t, 'pacc.' .. client .. '.' .. node, 1) == 0 then  -- this part came twice
      redis.call('HINCRBY', s, 'inflight.' .. node, -1)
      return decided(token, -7, 0)
    end
    arrived()
    if redis.call('HINCRBY', t, 'pdone.' .. client, 1) < parts then return decided(token, 0, field(h, 'accepted')) end
    redis.call('HSET', t, 'client.' .. client, node)
    return decided(token, count_update())
  end
  if secure then  -- the stage moved on (its deadline): no masked input enters the sum after the unmask request
    local sa = redis.call('HMGET', KEYS[4], 'round', 'stage')
    if tonumber(sa[1]) ~= round or sa[2] ~= 'collect' or redis.call('SISMEMBER', KEYS[5], client) == 0 then return -5, 0 end
  end
  if client ~= '' and redis.call('HSETNX', t, 'client.' .. client, node) == 0 then
    redis.call('HINCRBY', h, 'reserved', -1)
    redis.call('HINCRBY', s, 'inflight.' .. node, -1)
    return decided(token, -7, 0)
  end
  if secure then redis.call('SADD', KEYS[6], client) end
  arrived()
  return decided(token, count_update())
end
local out = {}
for i = 3, #ARGV - 1, 3 do
  local status, accepted = accept(ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2])
  out[#out + 1] = status
  out[#out + 1] = accepted
end
return out
"""

# KEYS: job, shard. ARGV: round, min updates, job name. Closes the round at its deadline:
# 1 closed with what arrived (final counts set), 2 closed to be abandoned (fewer than the
# minimum, or, split across nodes, parts of updates that are not whole: no final counts, so no node starts finishing its tree), -1 not open.
_CLOSE = _NOW + _FINALIZE + """
local h, s = KEYS[1], KEYS[2]
if field(h, 'round') ~= tonumber(ARGV[1]) or field(h, 'closed') == 1 then return -1 end
redis.call('PUBLISH', '""" + EVENTS + """', ARGV[3])
local parts_in = 0  -- a job split across nodes closes with whole updates only: every part counted belongs to one
for _, f in ipairs(redis.call('HKEYS', s)) do
  if string.sub(f, 1, 6) == 'count.' then parts_in = parts_in + tonumber(redis.call('HGET', s, f)) end
end
local parts = field(h, 'part_count') or 0
if field(h, 'accepted') < tonumber(ARGV[2]) or (parts > 0 and parts_in ~= field(h, 'accepted') * parts) then
  redis.call('HSET', h, 'closed', 1)
  return 2
end
finalize(h, s)
return 1
"""

# KEYS: job, shard. ARGV: round, epoch, node, job name. Sets where the top runs, once per epoch.
_SET_TOP = """
local h, s = KEYS[1], KEYS[2]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) then return 0 end
if tonumber(redis.call('HGET', s, 'epoch') or '0') ~= tonumber(ARGV[2]) then return 0 end
if redis.call('HSETNX', s, 'top', ARGV[3]) == 0 then return 0 end
redis.call('PUBLISH', '""" + EVENTS + """', ARGV[4])
return 1
"""

# KEYS: job, shard. ARGV: round, node, epoch. A node's partial result reached the top of
# that epoch. -> 1 first delivery, 0 a duplicate, -1 stale (another round or epoch).
_DELIVERED = """
local h, s = KEYS[1], KEYS[2]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) then return -1 end
if tonumber(redis.call('HGET', s, 'epoch') or '0') ~= tonumber(ARGV[3]) then return -1 end
if tonumber(redis.call('HGET', s, 'delivered.' .. ARGV[2]) or '-1') == tonumber(ARGV[3]) then return 0 end
redis.call('HSET', s, 'delivered.' .. ARGV[2], ARGV[3])
return 1
"""

# KEYS: job, shard, updates. ARGV: round, dead node, job name.
# A node died (or restarted) during the round: what it acknowledged and had not delivered to
# the top is lost (recorded per node); while the round is open its slots reopen. If it hosted
# the top, every partial delivered there is gone too: the epoch moves on and the survivors
# resend theirs (dead senders' are lost). -> {status, remaining updates, closed, top lost}:
# status -1 another round, 0 already handled, 1 handled.
_NODE_LOST = _NOW + """
local h, s, node = KEYS[1], KEYS[2], ARGV[2]
if field(h, 'round') ~= tonumber(ARGV[1]) then return {-1, 0, 0, 0} end
if redis.call('HSETNX', s, 'dead.' .. node, 1) == 0 then return {0, 0, 0, 0} end
local closed = field(h, 'closed') == 1 and redis.call('HEXISTS', s, 'finalized') == 1
local epoch = tonumber(redis.call('HGET', s, 'epoch') or '0')
local function lose(n)
  local c = tonumber(redis.call('HGET', s, 'count.' .. n) or '0')
  if c <= 0 then return end
  redis.call('HINCRBY', s, 'lost.' .. n, c)
  redis.call('HSET', s, 'count.' .. n, 0)
  if redis.call('HEXISTS', s, 'final.' .. n) == 1 then redis.call('HSET', s, 'final.' .. n, 0) end
  if not closed then
    redis.call('HINCRBY', h, 'accepted', -c)
    redis.call('HINCRBY', h, 'reserved', -c)
  end
end
local top_lost = 0
if redis.call('HGET', s, 'top') == node then
  top_lost = 1
  local all = redis.call('HGETALL', s)
  for i = 1, #all, 2 do  -- dead senders cannot resend what the dead top had received
    if string.sub(all[i], 1, 5) == 'dead.' and string.sub(all[i], 6) ~= node then lose(string.sub(all[i], 6)) end
  end
  redis.call('HDEL', s, 'top')
  redis.call('HSET', s, 'epoch', epoch + 1)
  lose(node)
elseif tonumber(redis.call('HGET', s, 'delivered.' .. node) or '-1') ~= epoch then
  lose(node)
end
local inflight = tonumber(redis.call('HGET', s, 'inflight.' .. node) or '0')
if inflight > 0 then  -- its uploads in progress died with it
  redis.call('HINCRBY', h, 'reserved', -inflight)
  redis.call('HSET', s, 'inflight.' .. node, 0)
end
local tokens = redis.call('HGETALL', KEYS[3])
for i = 1, #tokens, 2 do  -- their slots too: a fenced node giving one back gives back nothing
  if string.sub(tokens[i], 1, 5) == 'slot.' and tokens[i + 1] == node then redis.call('HDEL', KEYS[3], tokens[i]) end
end
local remaining = 0
local all = redis.call('HGETALL', s)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 6) == 'count.' then remaining = remaining + tonumber(all[i + 1]) end
end
redis.call('PUBLISH', '""" + EVENTS + """', ARGV[3])
return {1, remaining, closed and 1 or 0, top_lost}
"""

# KEYS: job, leases, history, shard, assignments, lease owners, updates. ARGV: round expected, new version, model key
# ('' keeps it), node, summary json ('' records nothing), model spec json ('' keeps it),
# history length, job name, parts record ('' keeps it: lifl.shards.split_record, set with the
# first model). -> opening time (ms), or -1.
_NEXT_ROUND = _NOW + _TENANT_ROUNDS + """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) then return -1 end
redis.call('SREM', tenant_rounds(tenant_of(h)), string.sub(h, #'lifl:job:' + 1))
redis.call('SREM', '""" + ACTIVE + """', string.sub(h, #'lifl:job:' + 1))
for _, f in ipairs(redis.call('HKEYS', h)) do
  if string.sub(f, 1, 9) == 'rejected.' then redis.call('HDEL', h, f) end
end
local now = now_ms()
local next_round = tonumber(ARGV[1]) + 1
redis.call('HSET', h, 'version', ARGV[2], 'round', next_round, 'round_opened', now, 'closed', 0,
           'reserved', 0, 'accepted', 0, 'aggregated', 0)
if ARGV[3] ~= '' then redis.call('HSET', h, 'model_key', ARGV[3], 'model_node', ARGV[4]) end
if ARGV[6] ~= '' then redis.call('HSET', h, 'model_spec', ARGV[6]) end
if ARGV[9] ~= '' then redis.call('HSET', h, 'parts', ARGV[9], 'part_count', #cjson.decode(ARGV[9]).parts) end
redis.call('HDEL', h, 'parts_lost')
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('HSET', KEYS[4], 'round', next_round, 'epoch', 0)
if ARGV[5] ~= '' then
  redis.call('HSET', h, 'last_round', ARGV[5])
  redis.call('RPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[7]), -1)
end
redis.call('PUBLISH', '""" + EVENTS + """', ARGV[8])
return now
"""

# KEYS: shard, assignments. ARGV: round, client, live nodes (space-separated, in plan order
# for nodes without a quota). Sticky within a round: a client keeps its node. A client goes
# to the first node of the plan with quota left (the bin-packing policies), or to the node
# with the fewest clients (least-connection, or when every quota is used up).
_ASSIGN = """
local s, a = KEYS[1], KEYS[2]
if tonumber(redis.call('HGET', s, 'round') or '-1') ~= tonumber(ARGV[1]) then return '' end
-- clients assigned are demand the controller plans for before their updates arrive (ACTIVE)
redis.call('SADD', '""" + ACTIVE + """', string.sub(s, #'lifl:job:' + 1, -#':shard' - 1))
local existing = redis.call('HGET', a, ARGV[2])
local live = {}
for n in string.gmatch(ARGV[3], '%S+') do live[n] = true end
if existing and live[existing] then return existing end
local plan = cjson.decode(redis.call('HGET', s, 'plan') or '{"quotas": [], "policy": "least_connection"}')
local chosen = nil
if plan.policy ~= 'least_connection' then
  for _, q in ipairs(plan.quotas) do
    local n, quota = q[1], q[2]
    if live[n] and tonumber(redis.call('HGET', s, 'assigned.' .. n) or '0') < quota then chosen = n break end
  end
end
if not chosen then
  local fewest = nil
  for n in string.gmatch(ARGV[3], '%S+') do
    local c = tonumber(redis.call('HGET', s, 'assigned.' .. n) or '0')
    if not fewest or c < fewest then chosen, fewest = n, c end
  end
end
if not chosen then return '' end
redis.call('HSET', a, ARGV[2], chosen)
redis.call('HINCRBY', s, 'assigned.' .. chosen, 1)
return chosen
"""

# Membership. KEYS: statuses, last seen (ms), pulse. ARGV: node ('' to read only), its status json,
# ttl ms, stall ms, forget ms. Refreshes the node's membership; -> [node, status] of each live node.
# Every call is a pulse: a gap of more than ``stall`` between pulses means nobody could reach the
# store (it was frozen or restarting), so no node could refresh either; each gets a fresh ttl
# from now instead of being declared gone. Real loss is still seen: the others keep pulsing.
_MEMBERSHIP = _NOW + """
local now = now_ms()
local pulse = tonumber(redis.call('GET', KEYS[3]) or '0')
if pulse > 0 and now - pulse > tonumber(ARGV[4]) then
  for _, node in ipairs(redis.call('HKEYS', KEYS[2])) do redis.call('HSET', KEYS[2], node, now) end
end
redis.call('SET', KEYS[3], now)
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], now)
end
local live = {}
local seen = redis.call('HGETALL', KEYS[2])
for i = 1, #seen, 2 do
  local node, age = seen[i], now - tonumber(seen[i + 1])
  if age > tonumber(ARGV[5]) then
    redis.call('HDEL', KEYS[1], node)
    redis.call('HDEL', KEYS[2], node)
  elseif age <= tonumber(ARGV[3]) then
    local status = redis.call('HGET', KEYS[1], node)
    if status then live[#live + 1] = node; live[#live + 1] = status end
  end
end
return live
"""

# KEYS: updates. ARGV: node, token prefix. -> the tokens of the round slots the node holds (its run's only).
_HELD_SLOTS = """
local held = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local f = all[i]
  if all[i + 1] == ARGV[1] and string.sub(f, 1, 5 + #ARGV[2]) == 'slot.' .. ARGV[2] then held[#held + 1] = string.sub(f, 6) end
end
return held
"""

# KEYS: lease. ARGV: holder, ttl ms. Takes or renews a lease; -> 1 if ``holder`` holds it.
_LEAD = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: job, shard. ARGV: round, node. A node of a job split across nodes has its part of the
# round's next version (written and checkpointed). -> the number of parts that have theirs (the
# node whose part completes them installs the version: next_round), -1 another round or a
# round that was lost.
_PART_INSTALLED = """
local h = KEYS[1]
if tonumber(redis.call('HGET', h, 'round')) ~= tonumber(ARGV[1]) or redis.call('HEXISTS', h, 'parts_lost') == 1 then
  return -1
end
if redis.call('HSETNX', KEYS[2], 'installed.' .. ARGV[2], 1) == 0 then return 0 end
local n = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(f, 1, 10) == 'installed.' then n = n + 1 end
end
return n
"""

# KEYS: shard. ARGV: round, plan json. The round's plan is written once (first writer wins).
_SET_PLAN = """
if tonumber(redis.call('HGET', KEYS[1], 'round') or '-1') ~= tonumber(ARGV[1]) then return 0 end
return redis.call('HSETNX', KEYS[1], 'plan', ARGV[2])
"""

RESERVE_OK, RESERVE_NO_JOB, RESERVE_NO_MODEL, RESERVE_STALE, RESERVE_FULL, RESERVE_CLOSED = 0, -1, -2, -3, -4, -5
RESERVE_DUPLICATE = -6  # the client's update of this round was acknowledged already
RESERVE_EXCLUDED = -7  # a query's filter excluded the client from the job's rounds
RESERVE_TENANT_ROUNDS = -8  # the tenant's other jobs have as many rounds in progress as its quota allows
RESERVE_NO_CLIENT = -9  # a job split across nodes joins an update's parts by their client: it needs one
RESERVE_UPDATE_GONE = -10  # another part of the client's update was given up: the update is out of the round
RESERVE_NOT_COLLECTING = -11  # a secure round takes masked inputs at its collect stage only
RESERVE_NOT_SHARED = -12  # a secure round takes masked inputs only from the clients that shared their keys
QUOTA_RETRY_AFTER = 1.0  # seconds a client refused by a quota of what ends by itself is told to wait
ACCEPT_CLOSED_ROUND, ACCEPT_COUNTED, ACCEPT_OTHER_ROUND, ACCEPT_ROUND_CLOSED, ACCEPT_FENCED = 1, 0, -1, -5, -6
ACCEPT_DUPLICATE = -7  # another upload of the same client's update was counted first
ACCEPT_UPDATE_GONE = -8  # another part of the client's update was given up: the update is out of the round
CLOSE_FINAL, CLOSE_ABANDON, CLOSE_NOT_OPEN = 1, 2, -1


def stale(base_version: int | None, version: int, max_staleness: int) -> Conflict:
    """An update trained from a version the job no longer takes (``base_version`` None: unknown)."""
    trained = "another version" if base_version is None else f"version {base_version}"
    return Conflict(f"update was trained from {trained}, the current version is {version}"
                    + (f" (this job takes updates at most {max_staleness} versions stale)" if max_staleness else ""),
                    code="version_conflict", extra={"version": version})


def refusal(status: int, job: str, version: int, round_id: int, goal: int, *, base_version: int | None = None,
            max_staleness: int = 0, tenant: str = "") -> Exception:
    """The error a client gets when it cannot take part in the round (reserve or lease)."""
    if status == RESERVE_TENANT_ROUNDS:
        return QuotaBusy(f"round {round_id} of job {job!r} cannot start: tenant {tenant!r} has as many rounds in progress "
                         f"as its quota (rounds) allows; retry after {QUOTA_RETRY_AFTER:g} s",
                         retry_after=QUOTA_RETRY_AFTER, extra={"quota": "rounds"})
    if status == RESERVE_NO_JOB:
        return NotFound(f"job {job!r} does not exist", code="no_such_job")
    if status == RESERVE_NO_MODEL:
        return Conflict(f"job {job!r} has no model yet; PUT /v1/jobs/{job}/model first", code="no_model")
    if status == RESERVE_STALE:
        return stale(base_version, version, max_staleness)
    if status == RESERVE_FULL:
        return Conflict(f"round {round_id} (version {version}) already has its {goal} updates or clients; pull the next version",
                        code="round_full", extra={"version": version})
    if status == RESERVE_DUPLICATE:
        return duplicate(round_id, version)
    if status == RESERVE_EXCLUDED:
        return Forbidden(f"this client is excluded from the rounds of job {job!r} (a filter query flagged it)",
                         code="client_excluded")
    if status == RESERVE_NO_CLIENT:
        return BadRequest(f"job {job!r} must know which client sent an update (it joins a split update's parts, or counts "
                          "a secure round's masked inputs, by client id): send X-Lifl-Client", code="client_required")
    if status == RESERVE_UPDATE_GONE:
        return part_given_up(job, round_id, version)
    if status == RESERVE_NOT_COLLECTING:
        return Conflict(f"the secure round {round_id} of job {job!r} is not collecting masked inputs (see GET "
                        f"/v1/jobs/{job}/secure)", code="wrong_stage", extra={"version": version, "round": round_id})
    if status == RESERVE_NOT_SHARED:
        return Conflict(f"this client did not share its keys in secure round {round_id} of job {job!r}: a stage it skipped "
                        "cannot be joined later", code="not_in_round", extra={"version": version, "round": round_id})
    return Conflict(f"round {round_id} (version {version}) is closed: its deadline passed", code="round_closed",
                    extra={"version": version})


def quota_exceeded(tenant: str, quota: str, limit: int | None, used: int, hint: str) -> QuotaExceeded:
    return QuotaExceeded(f"tenant {tenant!r} holds {used} {quota}, its quota is {limit}: {hint}",
                         extra={"quota": quota, "limit": limit, "used": used})


def duplicate(round_id: int, version: int) -> Conflict:
    """One update per client and round: a second one (a retry whose first try was taken) is refused
    with a code that tells the client its update is in."""
    return Conflict(f"this client's update of round {round_id} (version {version}) was acknowledged already",
                    code="already_acknowledged", extra={"version": version, "round": round_id})


def part_given_up(job: str, round_id: int, version: int) -> Conflict:
    """A part of an update whose other part was given up (refused, cut off, expired) before any
    was acknowledged: the update left the round, and its slot went to another client."""
    return Conflict(f"another part of this client's update of round {round_id} (version {version}) of job {job!r} was "
                    "given up, so the update is out of the round; send it again in the next round",
                    code="update_given_up", extra={"version": version, "round": round_id})


def accept_refusal(status: int, job: str, round_id: int, version: int, node: str) -> Exception:
    """The error for an update that arrived whole but cannot count (``accept``)."""
    if status == ACCEPT_FENCED:
        return Overloaded(f"node {node} was declared dead for round {round_id} of {job!r} and may not take part in it; "
                          f"retry (another node, or the next round)", code="node_fenced")
    if status == ACCEPT_DUPLICATE:
        return duplicate(round_id, version)
    if status == ACCEPT_UPDATE_GONE:
        return part_given_up(job, round_id, version)
    return Conflict(f"round {round_id} closed while the update was arriving; pull version {version}",
                    code="round_closed", extra={"version": version})


def job_key(name: str) -> str:
    return f"lifl:job:{name}"


def secure_key(name: str, part: str = "") -> str:
    """A secure job's round (lifl.secure_state): its hash, or one of its sets and hashes."""
    return f"lifl:job:{name}:sa" + (f":{part}" if part else "")


def leases_key(name: str) -> str:
    return f"lifl:job:{name}:leases"


def history_key(name: str) -> str:
    return f"lifl:job:{name}:rounds"


def shard_key(name: str) -> str:
    return f"lifl:job:{name}:shard"


def updates_key(name: str) -> str:
    """The current round's records of its updates: upload tokens (see the admission and
    acceptance scripts) and the clients whose update was counted. Dropped with the round."""
    return f"lifl:job:{name}:updates"


def assignments_key(name: str) -> str:
    return f"lifl:job:{name}:assign"


def tenant_jobs_key(tenant: str) -> str:
    return f"lifl:tenant:{tenant}:jobs"


def tenant_tokens_key(tenant: str) -> str:
    """The tenant's live tokens (lifl.auth), scored by expiry."""
    return f"lifl:tokens:{tenant}"


def tenant_rounds_key(tenant: str) -> str:
    """The tenant's jobs with a round in progress (its ``rounds`` quota)."""
    return f"lifl:tenant:{tenant}:rounds"


NO_LIMIT = -1  # a script's limit argument for a quota of None


def read_quota(client: redis.Redis, tenant: str) -> Quota:
    text = client.hget(QUOTAS, tenant)
    return Quota.from_json(text) if text is not None else Quota()


def lease_owners_key(name: str) -> str:
    return f"lifl:job:{name}:lease-owners"


def excluded_key(name: str) -> str:
    return f"lifl:job:{name}:excluded"


def retention_key(name: str) -> str:
    return f"lifl:job:{name}:retention"


def retained_rounds_key(name: str) -> str:
    return f"lifl:job:{name}:retained"


def retained_key(name: str, round_id: int) -> str:
    return f"lifl:job:{name}:retained:{round_id}"


def hash_pairs(flat: list[str]) -> dict[str, str]:
    """A hash as a script returns it (field, value, field, value, ...)."""
    return dict(zip(flat[::2], flat[1::2]))


@dataclass(frozen=True)
class JobView:
    """A job as one snapshot (``ClusterState.job_view``): what its status shows and its round's
    duties are decided from."""

    job: Job
    shard: Shard
    leases: int
    retention: RetentionPolicy
    now: float  # the Redis clock (s), the one deadlines are measured by
    secure: SecureRound | None = None  # a secure job's round


def _ms(t: list[int]) -> int:
    return t[0] * 1000 + t[1] // 1000


# A Redis outage: each command tries a few quick reconnects (a restarting server refuses at
# once), and waits STATE_TIMEOUT_S for an answer (a frozen one never answers); then the caller
# gets Unavailable (503 / UNAVAILABLE with Retry-After), and until Redis answers again every call
# does at once (redisconn.Outage). A command that got no answer is not sent again: it may have run.
REDIS_RETRIES = 2
REDIS_BACKOFF = ExponentialBackoff(cap=0.5, base=0.05)  # seconds
REDIS_CONNECT_TIMEOUT = 2.0  # seconds
REDIS_RETRY_AFTER = 2.0  # seconds a client is told to wait

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def state_unavailable(detail: str) -> Unavailable:
    return Unavailable(f"the cluster state (Redis) is unavailable: {detail}", code="state_unavailable",
                       retry_after=REDIS_RETRY_AFTER)


def _unavailable_when_unreachable(method: F) -> F:
    @functools.wraps(method)
    def call(self: ClusterState, *args: Any, **kwargs: Any) -> Any:
        if not self.outage.admits():
            raise state_unavailable("it did not answer the last call")
        try:
            result = method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:  # BusyLoadingError too: still loading its data
            self.outage.failed()
            raise state_unavailable(str(e)) from None
        self.outage.answered()
        return result
    return call  # type: ignore[return-value]


def dependency_errors(cls: type) -> type:
    """Every public call of ``cls`` reports Redis being unreachable as Unavailable (the event
    followers excepted: they wait for Redis themselves; and the ``*_call`` builders: no I/O)."""
    for name, member in list(vars(cls).items()):
        if (callable(member) and not name.startswith("_") and name not in ("events", "follow_events")
                and not name.endswith("_call")):
            setattr(cls, name, _unavailable_when_unreachable(member))
    return cls


@dataclass(frozen=True)
class ScriptCall:
    """One of the state's scripts with its keys and arguments, to run blocking (``ClusterState.run``)
    or from an event loop (``lifl.net.resp``)."""

    script: Any  # a redis-py Script: its text and SHA-1
    keys: list[str]
    args: list[Any]


def reserved(raw: list[Any]) -> list[tuple[int, int, int]]:
    """(status, version, round) of each admission of a ``reserve_call``."""
    return [(int(raw[i]), int(raw[i + 1]), int(raw[i + 2])) for i in range(0, len(raw), 3)]


def accepted(raw: list[Any]) -> list[tuple[int, int]]:
    """(status, accepted so far) of each update of an ``accept_call``."""
    return [(int(raw[i]), int(raw[i + 1])) for i in range(0, len(raw), 2)]


def retained_index(name: str, kept: list[tuple[int, dict[str, Any]]]) -> list[tuple[Any, ...]]:
    """The commands that index retained client updates, each (round, where it lives)."""
    commands: list[tuple[Any, ...]] = []
    for round_id, meta in kept:
        commands.append(("HSET", retained_key(name, round_id), meta["client"], json.dumps(meta, sort_keys=True)))
        commands.append(("ZADD", retained_rounds_key(name), round_id, str(round_id)))
    return commands


@dependency_errors
class ClusterState:
    def __init__(self, url: str, timeout: float = STATE_TIMEOUT_S) -> None:
        """``timeout``: seconds each call waits for Redis's answer (STATE_TIMEOUT_S: $LIFL_STATE_TIMEOUT_S)."""
        self.url = url
        self.timeout = timeout
        self.redis = redis.Redis.from_url(
            url, decode_responses=True, retry=Retry(REDIS_BACKOFF, REDIS_RETRIES, supported_errors=(redis.ConnectionError,)),
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT, socket_timeout=timeout)
        self.outage = Outage()
        r = self.redis
        self._reserve = r.register_script(_RESERVE)
        self._job_view = r.register_script(_JOB_VIEW)
        self._take_lease = r.register_script(_TAKE_LEASE)
        self._heartbeat = r.register_script(_HEARTBEAT)
        self._release_lease = r.register_script(_RELEASE_LEASE)
        self._count = r.register_script(_COUNT)
        self._unreserve = r.register_script(_UNRESERVE)
        self._accept = r.register_script(_ACCEPT)
        self._close = r.register_script(_CLOSE)
        self._set_top = r.register_script(_SET_TOP)
        self._delivered = r.register_script(_DELIVERED)
        self._node_lost = r.register_script(_NODE_LOST)
        self._next_round = r.register_script(_NEXT_ROUND)
        self._assign = r.register_script(_ASSIGN)
        self._set_plan = r.register_script(_SET_PLAN)
        self._part_installed = r.register_script(_PART_INSTALLED)
        self._lead = r.register_script(_LEAD)
        self._membership = r.register_script(_MEMBERSHIP)
        self._held_slots = r.register_script(_HELD_SLOTS)
        self._specs: dict[str, Any] = {}  # parsed JobSpecs and ModelSpecs, by their text

    def ping(self) -> None:
        self.redis.ping()

    def now(self) -> float:
        """The Redis server's clock (s): the one clock deadlines are measured by."""
        return _ms(self.redis.time()) / 1000

    # -- jobs -----------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> None:
        """Create the job, within its tenant's ``jobs`` quota (checked and taken in one script)."""
        limit = self.quota(spec.tenant).jobs
        fields = {
            "spec": spec.to_json(), "goal": spec.goal, "version": NO_MODEL, "round": -1, "round_opened": 0, "closed": 0,
            "reserved": 0, "accepted": 0, "aggregated": 0, "model_key": "", "model_node": "", "checkpoint": -1,
            "max_staleness": spec.strategy_spec.max_staleness, "strategy_seed": secrets.randbits(62),
            **({"secure": 1} if spec.secure_aggregation else {}),
        }
        flat = [str(x) for pair in fields.items() for x in pair]
        created = int(self.redis.eval(_CREATE_JOB, 4, job_key(spec.job), retention_key(spec.job), "lifl:jobs",
                                      tenant_jobs_key(spec.tenant), spec.job, NO_LIMIT if limit is None else limit,
                                      spec.retention_policy.to_json(), *flat))
        if created == 0:
            raise Conflict(f"job {spec.job!r} already exists", code="job_exists", grpc_status="ALREADY_EXISTS")
        if created < 0:
            raise quota_exceeded(spec.tenant, "jobs", limit, -created - 1, "delete one of its jobs first")

    def quota(self, tenant: str) -> Quota:
        """``tenant``'s quota (the defaults unless the operator set one)."""
        return read_quota(self.redis, tenant)

    def quotas(self) -> dict[str, Quota]:
        """Every quota the operator set, by tenant (others have the defaults)."""
        return {tenant: Quota.from_json(quota) for tenant, quota in self.redis.hgetall(QUOTAS).items()}

    def set_quota(self, tenant: str, quota: Quota | None) -> None:
        """Set ``tenant``'s quota; None: back to the defaults."""
        if quota is None:
            self.redis.hdel(QUOTAS, tenant)
        else:
            self.redis.hset(QUOTAS, tenant, quota.to_json())

    def tenant_usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds of its counted quotas, cluster-wide."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(tenant_jobs_key(tenant))
        pipe.zcount(tenant_tokens_key(tenant), int(time.time() * 1000), "+inf")
        pipe.scard(tenant_rounds_key(tenant))
        jobs, tokens, rounds = pipe.execute()
        return {"jobs": int(jobs), "tokens": int(tokens), "rounds": int(rounds)}

    def job(self, name: str) -> Job:
        return self._job(name, self.redis.hgetall(job_key(name)))

    def job_view(self, name: str) -> JobView:
        """The job, its round's shard, its live leases, its retention policy and the clock: one
        snapshot, one call."""
        now, job, shard, leases, retention, secure = self._job_view(
            keys=[job_key(name), shard_key(name), leases_key(name), retention_key(name), secure_key(name)])
        j = self._job(name, hash_pairs(job))
        policy = RetentionPolicy.from_json(retention) if retention else j.spec.retention_policy  # none: created before retention existed
        return JobView(j, Shard.parse(hash_pairs(shard)), int(leases), policy, int(now) / 1000, SecureRound.parse(name, hash_pairs(secure)))

    def _job(self, name: str, h: dict[str, str]) -> Job:
        if not h or "version" not in h:
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        return Job(
            spec=self._parsed(h["spec"], JobSpec.from_json),
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
            checkpoint_error=h.get("checkpoint_error", ""),
            parts=h.get("parts", ""),
            parts_lost=h.get("parts_lost", ""),
        )

    def _model_spec(self, text: str) -> ModelSpec | None:
        return self._parsed(text, lambda t: ModelSpec.from_json(json.loads(t))) if text else None

    def _parsed(self, text: str, parse: Callable[[str], T]) -> T:
        """A job's spec or model spec, parsed once per distinct text (neither changes once set;
        the cluster's hot paths read jobs often)."""
        value = self._specs.get(text)
        if value is None:
            if len(self._specs) > 1024:
                self._specs.clear()
            value = self._specs[text] = parse(text)
        return value

    def job_names(self, tenant: str | None = None) -> list[str]:
        """Every job's name, or those of ``tenant``."""
        return sorted(self.redis.smembers("lifl:jobs" if tenant is None else tenant_jobs_key(tenant)))

    def active_job_names(self) -> list[str]:
        """The jobs with a round under way (admitted an update and not ended), cluster-wide."""
        return sorted(self.redis.smembers(ACTIVE))

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

    # -- retention (lifl.flstore) ------------------------------------------------------------------
    def retention(self, name: str) -> RetentionPolicy:
        text = self.redis.get(retention_key(name))
        if text is None:
            return self.job(name).spec.retention_policy  # a job created before retention existed
        return RetentionPolicy.from_json(text)

    def set_retention(self, name: str, policy: RetentionPolicy) -> None:
        if not self.redis.exists(job_key(name)):
            raise NotFound(f"job {name!r} does not exist", code="no_such_job")
        self.redis.set(retention_key(name), policy.to_json())

    def record_retained(self, name: str, round_id: int, client: str, meta: dict[str, Any]) -> None:
        """Where a retained client update of round ``round_id`` lives (its node and object, its
        copy in the checkpoint store) and what it is (client, samples, base version)."""
        pipe = self.redis.pipeline()
        pipe.hset(retained_key(name, round_id), client, json.dumps(meta, sort_keys=True))
        pipe.zadd(retained_rounds_key(name), {str(round_id): round_id})
        pipe.execute()

    def retained(self, name: str, round_id: int) -> dict[str, dict[str, Any]]:
        """The retained updates of a round, by client."""
        return {c: json.loads(m) for c, m in self.redis.hgetall(retained_key(name, round_id)).items()}

    def strategy_seed(self, name: str) -> int:
        """The job's secret seed for its strategy's randomness (DP noise): a rerun of a step draws the
        same noise, and nobody outside the cluster can predict it."""
        seed = self.redis.hget(job_key(name), "strategy_seed")
        if seed is None:  # a job created before strategies existed
            self.redis.hsetnx(job_key(name), "strategy_seed", secrets.randbits(62))
            seed = self.redis.hget(job_key(name), "strategy_seed")
        return int(seed)

    def retained_rounds(self, name: str) -> list[int]:
        return [int(r) for r in self.redis.zrange(retained_rounds_key(name), 0, -1)]

    def forget_retained(self, name: str, round_id: int) -> None:
        pipe = self.redis.pipeline()
        pipe.delete(retained_key(name, round_id))
        pipe.zrem(retained_rounds_key(name), str(round_id))
        pipe.execute()

    def exclude(self, name: str, clients: list[str]) -> None:
        """Refuse these clients' leases and updates from now on."""
        if clients:
            self.redis.sadd(excluded_key(name), *clients)

    def excluded(self, name: str) -> list[str]:
        return sorted(self.redis.smembers(excluded_key(name)))

    # -- rounds ---------------------------------------------------------------------------------
    # The round's hot path (admission, acceptance, slots, counters) is built as ``ScriptCall``s
    # that either run here, blocking (redis-py), or from an event loop (``lifl.net.resp``, the
    # agent's way): the same scripts, keys and arguments, the same parsing of their answers.
    def reserve(self, name: str, base_version: int, node: str, lease: str = "", client: str = "",
                token: str = "") -> tuple[int, int, int]:
        """Take one of the round's ``goal`` slots for ``client``'s update arriving at ``node``:
        (status, version, round). ``token``: the upload's, so that sending this again is harmless."""
        return self.reserve_many(name, node, [(token, base_version, lease, client)])[0]

    def reserve_many(self, name: str, node: str, items: list[tuple[str, int, str, str]]) -> list[tuple[int, int, int]]:
        """``reserve`` for each (token, base version, lease, client) of updates arriving at
        ``node``, in one script (each checked and counted as if alone)."""
        return reserved(self.run(self.reserve_call(name, node, items)))

    def reserve_call(self, name: str, node: str, items: list[tuple[str, int, str, str]]) -> ScriptCall:
        return ScriptCall(self._reserve, [job_key(name), leases_key(name), shard_key(name), lease_owners_key(name),
                                          excluded_key(name), updates_key(name), secure_key(name), secure_key(name, "sharing")],
                          [node, *[x for item in items for x in item], not_after_ms(self.timeout)])

    def unreserve(self, name: str, round_id: int, node: str, token: str = "") -> bool:
        """Give back the slot of an upload that will not be accepted."""
        return self.give_back(name, node, [(token, round_id, "")]) == 1

    def give_back(self, name: str, node: str, refused: list[tuple[str, int, str]]) -> int:
        """Uploads that will not be accepted, each (token, round, reason): their slots go back
        and the refusals are counted (``rejected.<reason>``; no reason: not counted); how many
        slots went back (a token's goes back once)."""
        return int(self.run(self.give_back_call(name, node, refused)))

    def give_back_call(self, name: str, node: str, refused: list[tuple[str, int, str]]) -> ScriptCall:
        args: list[Any] = [node]
        for token, round_id, reason in refused:
            args += [token, round_id, f"rejected.{reason}" if reason else ""]
        return ScriptCall(self._unreserve, [job_key(name), shard_key(name), updates_key(name)], args)

    def held_slots_call(self, name: str, node: str, prefix: str) -> ScriptCall:
        """The tokens of the round slots ``node`` holds in ``name``, of those starting with ``prefix``."""
        return ScriptCall(self._held_slots, [updates_key(name)], [node, prefix])

    def count_call(self, name: str, counts: list[tuple[int | str, str, int]]) -> ScriptCall:
        """Add to counters of rounds of the job, each (round, field, delta): rejected.<code>,
        aggregated (counted only while that round is the current one; ``CURRENT_ROUND``: the one
        current when the call runs)."""
        return ScriptCall(self._count, [job_key(name)], [x for count in counts for x in count])

    def run(self, call: ScriptCall) -> Any:
        """Run a script call here (blocking)."""
        result = call.script(keys=call.keys, args=call.args)
        if late(result):
            raise state_unavailable("the call reached Redis after its caller stopped waiting (it did nothing)")
        return result

    def take_lease(self, spec: JobSpec, client: str) -> tuple[str, int, int]:
        """``client``'s lease for training in the current round, bound to it: (lease id, version,
        round); the one it holds already, renewed, if any; raises if refused."""
        limit = math.ceil(spec.goal * spec.over_selection)
        keys = [job_key(spec.job), leases_key(spec.job), shard_key(spec.job), lease_owners_key(spec.job),
                excluded_key(spec.job), updates_key(spec.job)]
        status, version, round_id, lease = self._take_lease(
            keys=keys, args=[secrets.token_hex(12), int(spec.lease_ttl_s * 1000), limit, client])
        if status != RESERVE_OK:
            raise refusal(int(status), spec.job, int(version), int(round_id), spec.goal)
        return str(lease), int(version), int(round_id)

    def heartbeat(self, spec: JobSpec, lease: str, client: str = "") -> bool:
        """Renew ``lease`` if it is ``client``'s ('' for any client's)."""
        return bool(self._heartbeat(keys=[leases_key(spec.job), lease_owners_key(spec.job)],
                                    args=[lease, int(spec.lease_ttl_s * 1000), client]))

    def release_lease(self, name: str, lease: str, client: str = "") -> bool:
        """Give back ``lease`` if it is ``client``'s ('' for any client's)."""
        return bool(self._release_lease(keys=[leases_key(name), lease_owners_key(name)], args=[lease, client]))

    def count(self, name: str, round_id: int, field: str, delta: int = 1) -> bool:
        """Add to a counter of round ``round_id`` (aggregated, rejected.<code>)."""
        return bool(self.run(self.count_call(name, [(round_id, field, delta)])))

    def accept(self, name: str, round_id: int, node: str, client: str = "", token: str = "") -> tuple[int, int]:
        """Count ``client``'s arrived update of round ``round_id`` on ``node``: (status, accepted so
        far); ACCEPT_CLOSED_ROUND when it met the goal and closed the round."""
        return self.accept_many(name, node, [(token, round_id, client, None)])[0]

    def accept_many(self, name: str, node: str, items: list[tuple[str, int, str, dict[str, Any] | None]]
                    ) -> list[tuple[int, int]]:
        """``accept`` for each (token, round, client, retained) of updates that arrived at ``node``,
        in one script; then, for those accepted and ``retained`` (where the update lives, see
        ``record_retained``), the retention index (a second round trip, only when there are some)."""
        results = accepted(self.run(self.accept_call(name, node, [(token, round_id, client)
                                                                  for token, round_id, client, _ in items])))
        index = retained_index(name, [(round_id, meta) for (_, round_id, _, meta), (status, _) in zip(items, results)
                                      if status >= 0 and meta])
        if index:
            pipe = self.redis.pipeline(transaction=False)
            for command in index:
                pipe.execute_command(*command)
            pipe.execute()
        return results

    def accept_call(self, name: str, node: str, items: list[tuple[str, int, str]]) -> ScriptCall:
        return ScriptCall(self._accept, [job_key(name), shard_key(name), updates_key(name), secure_key(name),
                                         secure_key(name, "sharing"), secure_key(name, "masked")],
                          [node, name, *[x for item in items for x in item], not_after_ms(self.timeout)])

    def close_round(self, name: str, round_id: int, min_updates: int) -> int:
        """Close round ``round_id`` at its deadline: CLOSE_FINAL (finishes with what arrived),
        CLOSE_ABANDON (fewer than ``min_updates``: abandon it) or CLOSE_NOT_OPEN."""
        return int(self._close(keys=[job_key(name), shard_key(name)], args=[round_id, min_updates, name]))

    def shard(self, name: str) -> Shard:
        return Shard.parse(self.redis.hgetall(shard_key(name)))

    def set_top(self, name: str, round_id: int, epoch: int, node: str) -> bool:
        return bool(self._set_top(keys=[job_key(name), shard_key(name)], args=[round_id, epoch, node, name]))

    def delivered(self, name: str, round_id: int, node: str, epoch: int) -> int:
        """Record that ``node``'s partial reached the top of ``epoch``: 1 first, 0 duplicate, -1 stale."""
        return int(self._delivered(keys=[job_key(name), shard_key(name)], args=[round_id, node, epoch]))

    def node_lost(self, name: str, round_id: int, node: str) -> Loss:
        status, remaining, closed, top_lost = self._node_lost(keys=[job_key(name), shard_key(name), updates_key(name)],
                                                              args=[round_id, node, name])
        return Loss(int(status) == 1, int(remaining), bool(closed), bool(top_lost))

    def next_round(self, name: str, round_id: int, version: int, *, key: str = "", node: str = "",
                   summary: dict[str, Any] | None = None, spec: ModelSpec | None = None, parts: str = "") -> float:
        """Finish round ``round_id`` (recording ``summary``) and open the next on ``version``;
        returns its opening time (s), or -1 if the round had moved on already."""
        opened = self._next_round(
            keys=[job_key(name), leases_key(name), history_key(name), shard_key(name), assignments_key(name),
                  lease_owners_key(name), updates_key(name)],
            args=[round_id, version, key, node, json.dumps(summary) if summary else "",
                  json.dumps(spec.to_json()) if spec else "", HISTORY, name, parts],
        )
        return int(opened) / 1000 if int(opened) >= 0 else -1.0

    def part_installed(self, name: str, round_id: int, node: str) -> int:
        """``node`` has its part of the next version of round ``round_id``: how many parts have
        theirs now (the part count: this node installs the version), 0 if it said so before, -1 if
        the round moved on or was lost."""
        return int(self._part_installed(keys=[job_key(name), shard_key(name)], args=[round_id, node]))

    def set_checkpoint(self, name: str, version: int) -> None:
        pipe = self.redis.pipeline()
        pipe.hset(job_key(name), "checkpoint", version)
        pipe.hdel(job_key(name), "checkpoint_error")
        pipe.execute()

    def set_checkpoint_error(self, name: str, version: int, error: str) -> None:
        """The checkpoint of ``version`` failed (it stays unseen until a retry succeeds)."""
        self.redis.hset(job_key(name), "checkpoint_error", f"version {version}: {error}")

    # -- placement --------------------------------------------------------------------------------
    def set_plan(self, name: str, round_id: int, plan: dict[str, Any]) -> bool:
        """Record the round's plan, unless one is recorded already (first writer wins)."""
        return bool(self._set_plan(keys=[shard_key(name)], args=[round_id, json.dumps(plan)]))

    def assign(self, name: str, round_id: int, client: str, live: list[str]) -> str | None:
        """The node ``client`` should send its update of round ``round_id`` to."""
        node = self._assign(keys=[shard_key(name), assignments_key(name)], args=[round_id, client, " ".join(live)])
        return node or None

    # -- tenants and nodes ----------------------------------------------------------------------
    def known_tenant(self, tenant: str) -> bool:
        """Whether ``tenant`` has its id already (no allocation)."""
        return bool(self.redis.hexists("lifl:tenants", tenant))

    def tenant_id(self, tenant: str) -> int:
        """The uid/gid of a tenant's functions, the same on every node."""
        existing = self.redis.hget("lifl:tenants", tenant)
        if existing is not None:
            return int(existing)
        candidate = TENANT_UID_BASE + int(self.redis.incr("lifl:tenant-seq"))
        self.redis.hsetnx("lifl:tenants", tenant, candidate)
        return int(self.redis.hget("lifl:tenants", tenant))

    def publish_node(self, node: str, status: NodeStatus) -> None:
        """A node agent's status; its refreshes are the node's liveness (_MEMBERSHIP)."""
        self._membership_call(node, json.dumps(record_json(status)))

    def nodes(self) -> dict[str, NodeStatus]:
        """Live nodes' statuses."""
        return self._membership_call("", "")

    def _membership_call(self, node: str, status: str) -> dict[str, NodeStatus]:
        flat = self._membership(keys=[NODES, NODES_SEEN, STORE_PULSE],
                                args=[node, status, NODE_TTL * 1000, STORE_STALL_S * 1000, NODE_FORGET_S * 1000])
        return {name: record_from_json(NodeStatus, json.loads(text)) for name, text in hash_pairs(flat).items()}

    def publish_gateway(self, node: str, addresses: dict[str, str], ttl: int = NODE_TTL) -> None:
        """Where clients and other gateways reach a node's gateway."""
        self.redis.set(f"lifl:gateway:{node}", json.dumps(addresses), ex=ttl)

    def gateways(self) -> dict[str, dict[str, str]]:
        return self._scan_json("lifl:gateway:*")

    def gateway(self, node: str) -> dict[str, str] | None:
        raw = self.redis.get(f"lifl:gateway:{node}")
        return json.loads(raw) if raw else None

    def _scan_json(self, pattern: str) -> dict[str, Any]:
        keys = sorted(self.redis.scan_iter(pattern, count=SCAN_COUNT))
        out = {}
        for key, raw in zip(keys, self.redis.mget(keys) if keys else []):
            if raw:
                out[key.split(":", 2)[2]] = json.loads(raw)
        return out

    def set_capacity(self, node: str, capacity: float, detail: dict[str, Any]) -> None:
        """MC_i of a node, as measured by `lifl calibrate`."""
        self.redis.hset("lifl:capacity", node, json.dumps({"capacity": capacity, **detail}))

    def capacities(self) -> dict[str, float]:
        return {n: float(json.loads(v)["capacity"]) for n, v in self.redis.hgetall("lifl:capacity").items()}

    def lead(self, role: str, holder: str, ttl: float) -> bool:
        """Take or keep the cluster-wide lease of ``role`` (one controller at a time)."""
        return bool(self._lead(keys=[f"lifl:lease:{role}"], args=[holder, int(ttl * 1000)]))

    def set_control(self, warm: dict[str, dict[str, int]], loads: dict[str, float], ttl: float) -> None:
        """The controller's latest plan: instances to keep warm per node and tenant, and each
        node's smoothed queue (what placement subtracts from its capacity)."""
        pipe = self.redis.pipeline()
        pipe.set("lifl:control:warm", json.dumps(warm), px=int(ttl * 1000))
        pipe.set("lifl:control:loads", json.dumps(loads), px=int(ttl * 1000))
        pipe.execute()

    def warm_plan(self) -> dict[str, dict[str, int]]:
        raw = self.redis.get("lifl:control:warm")
        return json.loads(raw) if raw else {}

    def loads(self) -> dict[str, float]:
        raw = self.redis.get("lifl:control:loads")
        return json.loads(raw) if raw else {}

    def events(self) -> Iterator[str | None]:
        """Names of jobs whose round changed, as they are published; None every second of quiet."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(EVENTS)
        try:
            while True:
                message = pubsub.get_message(timeout=1.0)
                yield message["data"] if message else None
        finally:
            pubsub.close()

    def follow_events(self, on_job: Callable[[str], None], stopping: Callable[[], bool], who: str) -> None:
        """Call ``on_job(name)`` for each round change published until ``stopping()`` (checked at
        least every second), subscribing again while Redis restarts. A message missed meanwhile
        only delays: whoever follows also re-reads on a timer."""
        while not stopping():
            try:
                for job in self.events():
                    if stopping():
                        return
                    if job is not None:
                        on_job(job)
            except (redis.RedisError, OSError) as e:
                if not stopping():
                    print(f"{who}: lost the round events ({type(e).__name__}: {e}); subscribing again", file=sys.stderr)
                    time.sleep(EVENTS_RETRY_S)
