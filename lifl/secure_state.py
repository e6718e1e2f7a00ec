"""A secure job's round stages in Redis (SecAgg+, ``lifl.secagg``): what any gateway of the
cluster reads and writes as the round's clients advertise keys, share, send masked inputs, sign
the survivor list and answer the unmasking request.

The stages and their rules are ``lifl.secagg_round``'s; here each transition that must not race
is one Lua script (timed by Redis's clock), and what needs no atomicity -- a payload's shape,
the round's graph, its degree and threshold -- is computed in Python around it. Keys (of job J):

- ``lifl:job:J:sa``: the round (the job's round number), its stage, public seed (hex), the
  stage's deadline (ms), the enrolment capacity (the job's goal), degree ``k``, threshold ``t``
  and signatures needed ``s`` once the advertise stage closed, and an abandoned round's reason;
- ``...:sa:keys`` (client -> mask public + share public + signing public, hex) and
  ``...:sa:pubkeys`` (every public key given, so that none is given twice);
- ``...:sa:sharing`` (the clients whose shares arrived; frozen when the share stage closes, it
  is the set masked inputs may come from) and ``...:sa:sealed`` (receiver NUL sender -> sealed
  shares, hex);
- ``...:sa:masked`` (the clients whose masked input is in the sum: the job's acceptance script
  adds them, while the stage collects, and moves the stage on with the last one; frozen then,
  it is the survivor list) and ``...:sa:signed`` (survivor -> its signature of the list, hex:
  the clients that may answer);
- ``...:sa:answered``, ``...:sa:shares`` (target NUL holder -> share, hex) and
  ``...:sa:counts`` (target -> shares held), with ``ready`` in the round's hash counting the
  targets that reached the threshold: the round is done when every client that shared has.

A new round of the job starts on its first advertisement (everything of the previous one is
deleted then). A stage ends when everyone it waits for acted, or at its deadline
(``close_due``, a periodic duty).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from lifl import secagg
from lifl.cluster_types import SecureRound as Round
from lifl.errors import BadRequest, Conflict, Unprocessable
from lifl.secagg import PublicKeys
from lifl.secagg_round import ABANDONED, ADVERTISE, COLLECT, CONSISTENCY, DONE, SEALED_BYTES, SHARE, UNMASK, Settings
from lifl.state import ACTIVE, EVENTS, ClusterState, hash_pairs, job_key, secure_key

_PARTS = ("keys", "pubkeys", "sharing", "sealed", "masked", "answered", "shares", "counts", "signed")
SEED_BYTES = 16
MAX_REMEMBERED_ROUNDS = 256  # rounds whose fixed keys, graph, request and signatures a process keeps

_LIB = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function at(stage, round)
  local r = redis.call('HMGET', KEYS[1], 'round', 'stage', 'deadline')
  if not r[1] then return 'wrong_stage:' end  -- no secure round yet: nobody advertised
  if r[1] ~= round then return 'wrong_round' end
  if r[2] ~= stage then return 'wrong_stage:' .. (r[2] or '') end
  if now_ms() > tonumber(r[3]) then return 'stage_closed:' .. stage end
  return nil
end
local function move(stage, timeout)  -- published (the job's name): clients waiting for the stage wake
  redis.call('HSET', KEYS[1], 'stage', stage, 'deadline', now_ms() + tonumber(timeout))
  redis.call('PUBLISH', '""" + EVENTS + """', string.sub(KEYS[1], #'lifl:job:' + 1, -#':sa' - 1))
end
"""

# KEYS: sa, then the parts (_PARTS order), then the job hash. ARGV: mask hex, share hex, client,
# capacity, stage timeout ms, a fresh seed (used if this starts the round), k, t and s if the
# stage fills, signing hex. -> {error} or {'', the round's hash}
_ADVERTISE = _LIB + """
local round = redis.call('HGET', KEYS[11], 'round')
if not round then return {'no_job'} end
local have = redis.call('HGET', KEYS[1], 'round')
if have ~= round then
  if have and tonumber(have) > tonumber(round) then return {'wrong_round'} end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10])
  redis.call('HSET', KEYS[1], 'round', round, 'stage', 'advertise', 'seed', ARGV[6], 'capacity', ARGV[4], 'ready', 0,
             'timeout', ARGV[5], 'deadline', now_ms() + tonumber(ARGV[5]))
  redis.call('SADD', '""" + ACTIVE + """', string.sub(KEYS[11], #'lifl:job:' + 1))  -- its stages' deadlines are duties now
end
local bad = at('advertise', round)
if bad then return {bad} end
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then return {'replayed'} end
for _, key in ipairs({ARGV[1], ARGV[2], ARGV[10]}) do
  if redis.call('SISMEMBER', KEYS[3], key) == 1 then return {'key_taken'} end
end
local count = redis.call('HLEN', KEYS[2])
if count >= tonumber(ARGV[4]) then return {'round_full'} end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1] .. ARGV[2] .. ARGV[10])
redis.call('SADD', KEYS[3], ARGV[1], ARGV[2], ARGV[10])
count = count + 1
if count == tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'k', ARGV[7], 't', ARGV[8], 's', ARGV[9])
  move('share', ARGV[5])
end
return {'', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: sa, parts. ARGV: round, client, stage timeout ms, then (receiver, sealed hex) pairs.
_SHARE = _LIB + """
local bad = at('share', ARGV[1])
if bad then return {bad} end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return {'not_in_round'} end
if redis.call('SADD', KEYS[4], ARGV[2]) == 0 then return {'replayed'} end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[5], ARGV[i] .. '\\0' .. ARGV[2], ARGV[i + 1]) end
if redis.call('SCARD', KEYS[4]) == redis.call('HLEN', KEYS[2]) then move('collect', ARGV[3]) end
return {'', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: sa, parts. ARGV: round, client, stage timeout ms, signature hex. The last survivor's
# signature moves the stage on.
_SIGN = _LIB + """
local bad = at('consistency', ARGV[1])
if bad then return {bad} end
if redis.call('SISMEMBER', KEYS[6], ARGV[2]) == 0 then return {'not_in_round'} end
if redis.call('HSETNX', KEYS[10], ARGV[2], ARGV[4]) == 0 then return {'replayed'} end
if redis.call('HLEN', KEYS[10]) == redis.call('SCARD', KEYS[6]) then move('unmask', ARGV[3]) end
return {'', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: sa, parts. ARGV: round, client, job name, then (target, share hex) pairs. The last share a
# secret needed makes the round done (published: the top waits for it).
_ANSWER = _LIB + """
local bad = at('unmask', ARGV[1])
if bad then return {bad} end
if redis.call('HEXISTS', KEYS[10], ARGV[2]) == 0 then return {'not_in_round'} end
if redis.call('SADD', KEYS[7], ARGV[2]) == 0 then return {'replayed'} end
local t = tonumber(redis.call('HGET', KEYS[1], 't'))
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[8], ARGV[i] .. '\\0' .. ARGV[2], ARGV[i + 1])
  if redis.call('HINCRBY', KEYS[9], ARGV[i], 1) == t then redis.call('HINCRBY', KEYS[1], 'ready', 1) end
end
if tonumber(redis.call('HGET', KEYS[1], 'ready')) == redis.call('SCARD', KEYS[4]) then
  redis.call('HSET', KEYS[1], 'stage', 'done')
  redis.call('PUBLISH', '""" + EVENTS + """', ARGV[3])
end
return {'', redis.call('HGETALL', KEYS[1])}
"""

# KEYS: sa. ARGV: round, the stage expected, the next, its timeout ms, then field/value pairs to
# set (k, t, s; why). -> 1 if moved (published), 0 if the round or stage had moved on.
_MOVE = _LIB + """
local r = redis.call('HMGET', KEYS[1], 'round', 'stage')
if r[1] ~= ARGV[1] or r[2] ~= ARGV[2] then return 0 end
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
move(ARGV[3], ARGV[4])
return 1
"""

_REFUSALS = {
    "no_job": (Conflict, "the job does not exist"),
    "wrong_round": (Conflict, "the secure round moved on"),
    "replayed": (Conflict, "this client sent it already"),
    "key_taken": (BadRequest, "a public key another client of the round gave"),
    "round_full": (Conflict, "the round enrolled as many clients as its goal"),
    "not_in_round": (Conflict, "this client is not in the round at this stage (a stage it skipped cannot be joined later)"),
}


class SecureRounds:
    """A secure job's stages, for every gateway and agent of the cluster."""

    def __init__(self, state: ClusterState) -> None:
        self.redis = state.redis
        self._advertise = self.redis.register_script(_ADVERTISE)
        self._share = self.redis.register_script(_SHARE)
        self._sign = self.redis.register_script(_SIGN)
        self._answer = self.redis.register_script(_ANSWER)
        self._move = self.redis.register_script(_MOVE)
        # what a round fixes once a stage closes, read once: its clients' keys (advertise), its request
        # (collect), its signatures (consistency)
        self._keys: dict[tuple[str, int, bytes], dict[str, PublicKeys]] = {}
        self._graphs: dict[tuple[str, int, bytes], dict[str, tuple[str, ...]]] = {}
        self._requests: dict[tuple[str, int, bytes], secagg.ShareRequest] = {}
        self._signatures: dict[tuple[str, int, bytes], dict[str, tuple[bytes, bytes]]] = {}

    # -- reading -----------------------------------------------------------------------------------
    def round(self, job: str) -> Round | None:
        return Round.parse(job, self.redis.hgetall(_key(job)))

    def keys(self, job: str) -> dict[str, PublicKeys]:
        """Each advertised client's public keys."""
        return {c: PublicKeys(bytes.fromhex(v[:64]), bytes.fromhex(v[64:128]), bytes.fromhex(v[128:]))
                for c, v in self.redis.hgetall(_part(job, "keys")).items()}

    def record(self, job: str) -> dict[str, Any]:
        """What a round's record says of its secure round: its clients at each stage, the dropouts,
        the graph's degree and threshold, and an abandoned one's reason."""
        r = self.round(job)
        if r is None:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for part in ("keys", "sharing", "masked", "signed"):
            (pipe.hlen if part in ("keys", "signed") else pipe.scard)(_part(job, part))
        advertised, shared, survivors, signed = pipe.execute()
        return {"round": r.round, "stage": r.stage, "advertised": advertised, "shared": shared, "survivors": survivors,
                "signed": signed, "dropped": advertised - survivors, "k": r.k, "threshold": r.threshold,
                "signatures_needed": r.signatures, **({"why": r.why} if r.why else {})}

    def graph(self, r: Round) -> dict[str, tuple[str, ...]]:
        """The round's graph over the clients that advertised (once the advertise stage closed)."""
        if r.stage == ADVERTISE:  # its clients are not final yet
            return secagg.neighbours(sorted(self.keys(r.job)), r.k, r.seed)
        graph = self._graphs.get((r.job, r.round, r.seed))
        if graph is None:
            graph = _remember(self._graphs, (r.job, r.round, r.seed),
                              secagg.neighbours(sorted(self.round_keys(r)), r.k, r.seed))
        return graph

    def round_keys(self, r: Round) -> dict[str, PublicKeys]:
        """``keys`` of round ``r``: read once, after the advertise stage closed (no key changes then)."""
        if r.stage == ADVERTISE:
            return self.keys(r.job)
        keys = self._keys.get((r.job, r.round, r.seed))
        if keys is None:
            keys = _remember(self._keys, (r.job, r.round, r.seed), self.keys(r.job))
        return keys

    # -- the stages --------------------------------------------------------------------------------
    def advertise(self, job: str, settings: Settings, capacity: int, client: str, keys: PublicKeys) -> Round:
        for name, key in zip(PublicKeys._fields, keys):
            if not isinstance(key, bytes) or len(key) != secagg.SEED_BYTES:
                raise BadRequest(f"the {name} public key must be {secagg.SEED_BYTES} bytes", code="bad_key")
        if len(set(keys)) != len(keys):
            raise BadRequest("the three public keys must differ", code="bad_key")
        full = secagg.choose_params(capacity, settings.dropout, settings.corruption)
        return _changed(job, self._advertise(keys=[_key(job), *_parts(job), job_key(job)], args=[
            keys.mask.hex(), keys.share.hex(), client, capacity, _ms(settings.stage_timeout_s),
            secrets.token_hex(SEED_BYTES), full.k, full.threshold, full.signatures, keys.signing.hex()]))

    def peers(self, job: str, client: str, at: Round | None = None) -> tuple[Round, dict[str, tuple[int, bytes, bytes]]]:
        """(the round, each of ``client``'s neighbours' Shamir point and public keys): what it
        needs to share its secrets. ``at``: the round as just read (not read again)."""
        r = self._at(job, SHARE, at=at)
        keys = self.round_keys(r)
        if client not in keys:
            raise _refused("not_in_round")
        point = {c: i + 1 for i, c in enumerate(sorted(keys))}
        return r, {p: (point[p], keys[p].mask, keys[p].share) for p in self.graph(r)[client]}

    def share(self, job: str, settings: Settings, client: str, sealed: Mapping[str, bytes]) -> Round:
        """``client``'s sealed shares, one for each of its neighbours, no more, no fewer."""
        r = self._at(job, SHARE)
        graph = self.graph(r)
        if client not in graph:
            raise _refused("not_in_round")
        wanted = set(graph[client])
        if set(sealed) != wanted:
            missing, extra = sorted(wanted - set(sealed)), sorted(set(sealed) - wanted)
            raise BadRequest(f"shares must go to exactly the client's {len(wanted)} neighbours"
                             + (f"; missing {missing[:3]}" if missing else "") + (f"; not neighbours {extra[:3]}" if extra else ""),
                             code="bad_shares")
        for receiver, blob in sealed.items():
            if not isinstance(blob, bytes) or len(blob) != SEALED_BYTES:
                raise BadRequest(f"the sealed shares for {receiver!r} must be {SEALED_BYTES} bytes", code="bad_shares")
        return _changed(job, self._share(keys=[_key(job), *_parts(job)], args=[
            r.round, client, _ms(settings.stage_timeout_s), *(x for p in sorted(sealed.items()) for x in (p[0], p[1].hex()))]))

    def inbox(self, job: str, client: str, at: Round | None = None) -> tuple[Round, dict[str, bytes]]:
        """(the round, the sealed shares ``client``'s neighbours that shared sent it): what it
        needs, with their public keys, to mask its input. Its neighbours to mask with are those."""
        r = self._at(job, COLLECT, at=at)
        if not self.redis.sismember(_part(job, "sharing"), client):
            raise _refused("not_in_round")
        peers = [p for p in self.graph(r)[client]]
        blobs = self.redis.hmget(_part(job, "sealed"), [f"{client}\0{p}" for p in peers]) if peers else []
        return r, {p: bytes.fromhex(b) for p, b in zip(peers, blobs) if b is not None}

    def request(self, job: str, at: Round | None = None) -> tuple[Round, secagg.ShareRequest]:
        """(the round, what its unmask stage asks): its survivors are the list the consistency stage signs."""
        r = self._at(job, CONSISTENCY, UNMASK, DONE, at=at)
        request = self._requests.get((job, r.round, r.seed))
        if request is None:  # the sets were frozen when their stages closed: the request is the round's for good
            pipe = self.redis.pipeline(transaction=False)
            pipe.smembers(_part(job, "sharing"))
            pipe.smembers(_part(job, "masked"))
            sharing, masked = pipe.execute()
            request = _remember(self._requests, (job, r.round, r.seed),
                                secagg.ShareRequest(frozenset(masked), frozenset(sharing - masked)))
        return r, request

    def sign(self, job: str, settings: Settings, client: str, signature: bytes) -> Round:
        """A survivor's signature of the survivor list (checked here: a forged one would make
        honest clients refuse the unmask request)."""
        r, request = self.request(job)
        if r.stage != CONSISTENCY:
            raise Conflict(f"the secure round of {job!r} is {r.stage}", code="wrong_stage")
        if client not in request.survivors:
            raise _refused("not_in_round")
        if not (isinstance(signature, bytes)
                and secagg.verify_signature(self.round_keys(r)[client].signing, signature,
                                            _survivor_list(r.context, request.survivors))):
            raise BadRequest(f"not {client!r}'s signature of the round's survivor list", code="bad_signature")
        return _changed(job, self._sign(keys=[_key(job), *_parts(job)], args=[
            r.round, client, _ms(settings.stage_timeout_s), signature.hex()]))

    def signatures(self, r: Round) -> dict[str, tuple[bytes, bytes]]:
        """Round ``r``'s signers (once its consistency stage closed): each one's signing key and
        signature of the survivor list, the first ``r.signatures`` of them by name (what a client
        checks before it answers; no more than it needs)."""
        if r.stage not in (UNMASK, DONE):
            raise Conflict(f"the secure round of {r.job!r} is {r.stage}: its signatures are not final", code="wrong_stage")
        shown = self._signatures.get((r.job, r.round, r.seed))
        if shown is None:
            signed, keys = self.redis.hgetall(_part(r.job, "signed")), self.round_keys(r)
            shown = _remember(self._signatures, (r.job, r.round, r.seed),
                              {c: (keys[c].signing, bytes.fromhex(signed[c])) for c in sorted(signed)[:r.signatures]})
        return shown

    def answer(self, job: str, client: str, answer: Mapping[str, tuple[str, bytes]]) -> Round:
        """``client``'s shares for the request: one per neighbour it names, of the kind asked."""
        r, request = self.request(job)
        if r.stage != UNMASK:
            raise Conflict(f"the secure round of {job!r} is {r.stage}", code="wrong_stage")
        graph = self.graph(r)
        wanted = {p for p in graph.get(client, ()) if p in request.survivors or p in request.dropped}
        for target, (kind, share) in answer.items():
            if target not in wanted:
                raise BadRequest(f"{client!r} holds no share of {target!r} that the round asks for", code="bad_answer")
            expected = secagg.KIND_SELF if target in request.survivors else secagg.KIND_KEY
            if kind != expected:
                raise BadRequest(f"{target!r} {'survived' if expected == secagg.KIND_SELF else 'dropped'}: its {expected} "
                                 f"share is asked, not its {kind!r} share", code="bad_answer")
            if not isinstance(share, bytes) or len(share) != secagg.SHARE_BYTES:
                raise BadRequest(f"the share of {target!r} must be {secagg.SHARE_BYTES} bytes", code="bad_answer")
        return _changed(job, self._answer(keys=[_key(job), *_parts(job)], args=[
            r.round, client, job, *(x for t, (_, s) in sorted(answer.items()) for x in (t, s.hex()))]))

    def unmask_secrets(self, job: str) -> tuple[Round, dict[str, bytes], dict[str, bytes]]:
        """(the round, each survivor's self-mask seed, each dropped client's mask private key),
        rebuilt from the shares once the round is done."""
        r, request = self.request(job)
        if r.stage != DONE:
            raise Conflict(f"the secure round of {job!r} is {r.stage}, not done", code="wrong_stage")
        point = {c: i + 1 for i, c in enumerate(sorted(self.redis.hkeys(_part(job, "keys"))))}
        held: dict[str, dict[int, bytes]] = {}
        for name, share in self.redis.hgetall(_part(job, "shares")).items():
            target, holder = name.split("\0")
            held.setdefault(target, {})[point[holder]] = bytes.fromhex(share)
        rebuilt = {c: secagg.reconstruct(held[c], r.threshold) for c in request.survivors | request.dropped}
        return r, {c: rebuilt[c] for c in request.survivors}, {c: rebuilt[c] for c in request.dropped}

    # -- deadlines ---------------------------------------------------------------------------------
    def close_due(self, job: str, settings: Settings) -> Round | None:
        """The periodic duty: a stage past its deadline ends -- the round moves on with the
        clients that acted, or is abandoned saying why. The round as it is then."""
        r = self.round(job)
        if r is None or r.stage in (DONE, ABANDONED) or int(self.redis.time()[0]) * 1000 < r.deadline_ms:
            return r
        timeout = _ms(settings.stage_timeout_s)
        if r.stage == ADVERTISE:
            count = self.redis.hlen(_part(job, "keys"))
            try:
                params = secagg.choose_params(count, settings.dropout, settings.corruption)
            except (BadRequest, Unprocessable) as e:
                self._move(keys=[_key(job)], args=[r.round, ADVERTISE, ABANDONED, 0, "why", e.message])
            else:
                self._move(keys=[_key(job)], args=[r.round, ADVERTISE, SHARE, timeout, "k", params.k, "t", params.threshold,
                                                   "s", params.signatures])
        elif r.stage == SHARE:
            shared = self.redis.scard(_part(job, "sharing"))
            self._next_or_abandon(r, SHARE, COLLECT, timeout, shared, "clients shared their keys", _threshold(r))
        elif r.stage == COLLECT:  # enough inputs to unmask, and enough survivors to sign
            masked = self.redis.scard(_part(job, "masked"))
            self._next_or_abandon(r, COLLECT, CONSISTENCY, timeout, masked, "clients sent masked inputs", _threshold(r),
                                  (r.signatures, f"the {r.signatures} signatures the consistency check needs"))
        elif r.stage == CONSISTENCY:
            signed = self.redis.hlen(_part(job, "signed"))
            self._next_or_abandon(r, CONSISTENCY, UNMASK, timeout, signed, "survivors signed the survivor list",
                                  (r.signatures, f"the {r.signatures} the consistency check needs"))
        elif r.stage == UNMASK:
            counts = self.redis.hgetall(_part(job, "counts"))
            short = sorted(c for c in self.redis.smembers(_part(job, "sharing")) if int(counts.get(c, 0)) < r.threshold)
            why = (f"{len(short)} clients' secrets have fewer than {r.threshold} shares (first {short[0]!r}): the sum "
                   "cannot be unmasked") if short else ""
            self._move(keys=[_key(job)], args=[r.round, UNMASK, ABANDONED if short else DONE, 0, "why", why])
        return self.round(job)

    def _next_or_abandon(self, r: Round, stage: str, following: str, timeout: int, count: int, what: str,
                         *needs: tuple[int, str]) -> None:
        """The stage ends: the round moves on if ``count`` clients (``what`` they did) meet every one
        of ``needs`` (the least count, and what it is), or is abandoned naming the first unmet."""
        short = next((label for least, label in needs if count < least), None)
        if short is not None:
            self._move(keys=[_key(r.job)], args=[r.round, stage, ABANDONED, 0, "why", f"{count} {what}, fewer than {short}"])
        else:
            self._move(keys=[_key(r.job)], args=[r.round, stage, following, timeout])

    def _at(self, job: str, *stages: str, at: Round | None = None) -> Round:
        r = at if at is not None else self.round(job)
        if r is None or r.stage not in stages:
            raise Conflict(f"the secure round of {job!r} is at {r.stage if r else 'no'} stage, not {' or '.join(stages)}",
                           code="wrong_stage")
        return r


def _threshold(r: Round) -> tuple[int, str]:
    return r.threshold, f"the threshold of {r.threshold}"


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    """``value``, kept in ``cache`` under ``key`` (emptied when it is full: rounds move on)."""
    if len(cache) >= MAX_REMEMBERED_ROUNDS:
        cache.clear()
    cache[key] = value
    return value


@lru_cache(maxsize=16)
def _survivor_list(context: bytes, survivors: frozenset[str]) -> bytes:
    return secagg.survivor_list(context, survivors)


def _key(job: str) -> str:
    return secure_key(job)


def _part(job: str, part: str) -> str:
    return secure_key(job, part)


def _parts(job: str) -> list[str]:
    return [_part(job, p) for p in _PARTS]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _refused(code: str) -> Exception:
    cls, message = _REFUSALS[code]
    return cls(message, code=code)


def _changed(job: str, reply: Any) -> Round:
    """The round as the script that changed it left it (its reply: an error, or none and the
    round's hash)."""
    _check(reply)
    r = Round.parse(job, hash_pairs(reply[1]))
    assert r is not None
    return r


def _check(reply: Any) -> None:
    error = reply[0]
    if not error:
        return
    code, _, detail = error.partition(":")
    if code == "wrong_stage":
        raise Conflict(f"the secure round is at its {detail or 'no'} stage", code="wrong_stage")
    if code == "stage_closed":
        raise Conflict(f"the {detail} stage's deadline passed", code="stage_closed")
    raise _refused(code)
