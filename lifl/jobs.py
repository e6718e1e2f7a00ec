"""Job specifications: what ``POST /v1/jobs`` accepts, validated field by field."""

from __future__ import annotations

import json
import math
import re
import reprlib
import urllib.parse
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from lifl.errors import BadRequest
from lifl.format import ACCUMULATORS, DType, ModelSpec
from lifl.fixedpoint import FixedPoint
from lifl.flstore.retention import RetentionPolicy
from lifl.models import MODELS
from lifl.secagg import choose_params
from lifl.secagg_round import STAGES as SECURE_STAGES
from lifl.secagg_round import Settings as SecureSettings
from lifl.shards import ELEMENT, check_request as check_shards
from lifl.strategy import StrategySpec
from lifl.strategy.spec import MAX_SHARDED_GRAM_UPDATES

# Always fullmatch: "$" also matches before a final newline, and a name ending in one would become
# a checkpoint directory and a shared-memory object with a newline in their names.
JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")
DEFAULT_MAX_UPDATE_BYTES = 4 << 30
MAX_SAMPLES = 1 << 53  # X-Lifl-Samples of any update: counts stay exact in float64 weights
AUTO_LEAF_BYTES = 4 << 20  # leaf_fan_in 0: a leaf takes about this many bytes of updates
AUTO_FAN_IN = (2, 256)  # ... and between this many updates
SECURE_LEAVES = 4  # leaf_fan_in 0: a secure round's goal is cut into this many leaves
# From this size on a leaf's partial sum (2 to 4 times an update's bytes in float64) costs the
# middle seconds to fold again: a leaf folds at least REFOLD_BOUND times the bytes it hands on.
LARGE_UPDATE_BYTES = 256 << 20
REFOLD_BOUND = 2
# A wait for a job's next version (GET /v1/jobs/{job}/version?after=N&wait_s=S):
NO_VERSION = -1  # after=-1: any version (a job without a model yet has none)
MAX_VERSION = 1 << 62
MAX_VERSION_WAIT_S = 60.0  # the longest a wait is held (a client asks again after it)


@dataclass(frozen=True)
class JobSpec:
    job: str
    goal: int  # client updates aggregated per round (the aggregation goal n)
    tenant: str = "default"
    leaf_fan_in: int = 0  # updates per leaf aggregator (the paper's I); 0: sized from the model (fan_in_for)
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    max_inflight: int = 0  # updates received but not yet aggregated; 0 means the goal
    round_deadline_s: float = 0.0  # a round still short of its goal this long after opening closes; 0: none
    min_updates: int = 1  # at the deadline, fewer updates than this abandon the round
    lease_ttl_s: float = 30.0  # a lease lapses without a heartbeat for this long
    over_selection: float = 1.3  # clients training at once, as a multiple of the goal
    max_samples: int = 0  # the largest sample count one update may claim (its weight); 0: MAX_SAMPLES
    retention: dict[str, Any] = field(default_factory=dict, hash=False)  # the initial retention policy (lifl.flstore.retention)
    architecture: str = ""  # the model's torch architecture (lifl.models.MODELS), for inference queries
    strategy: dict[str, Any] = field(default_factory=dict, hash=False)  # lifl.strategy, every parameter filled in; {}: fedavg
    fixed_point: dict[str, Any] = field(default_factory=dict, hash=False)  # lifl.fixedpoint; {}: float aggregation
    shards: int = 1  # tensor shards, each aggregated in a hierarchy of its own (lifl.shards); 0: "auto"
    shard_alignment: str = ELEMENT  # where shards are cut: between elements, or between tensors
    accumulator: str = "float64"  # what partial sums of float tensors are kept in (format.ACCUMULATORS)
    secure_aggregation: dict[str, Any] = field(default_factory=dict, hash=False)  # lifl.secagg_round.Settings, filled in; {}: off

    @property
    def sample_cap(self) -> int:
        return self.max_samples or MAX_SAMPLES

    @property
    def inflight_budget(self) -> int:
        return self.max_inflight or self.goal

    def fan_in_for(self, model: ModelSpec | None) -> int:
        """The updates per leaf for ``model``: as set, or (0) enough that a leaf folds about
        AUTO_LEAF_BYTES. A task's fixed costs (its invocation, its result's hand-off) then weigh
        little per small update, while a model of some MB keeps the paper's I = 2 (a leaf waits
        least after its first update when folding is what takes time). An update of
        LARGE_UPDATE_BYTES or more is another matter: a leaf takes enough of them that they
        outweigh REFOLD_BOUND times its partial sum, which the middle folds again (8 bf16 updates
        for a float64 partial; parallelism then comes from shards, each with its own leaves).
        Unknown model: 2. A secure round's leaves hold their sums until the unmask stage is done,
        then take their clients' masks off side by side (``lifl.secagg_round.MaskedInputs``): its
        goal is cut into SECURE_LEAVES leaves, enough to keep a node's cores expanding masks
        without holding an instance per pair of updates."""
        if self.leaf_fan_in:
            return self.leaf_fan_in
        low, high = AUTO_FAN_IN
        if self.secure_aggregation:
            return max(low, min(high, -(-self.goal // SECURE_LEAVES)))
        if model is None or not model.data_bytes:
            return low
        update = model.data_bytes
        fan_in = AUTO_LEAF_BYTES // update
        if update >= LARGE_UPDATE_BYTES:
            fan_in = -(-REFOLD_BOUND * model.partial(self.float_accumulator).data_bytes // update)
        return max(low, min(high, fan_in))

    @classmethod
    def from_request(cls, body: Any) -> JobSpec:
        if not isinstance(body, dict):
            raise BadRequest("job must be a JSON object", code="bad_job")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise BadRequest(f"unknown job field(s): {', '.join(unknown)}", code="bad_job")
        for required in ("job", "goal"):
            if required not in body:
                raise BadRequest(f"job field {required!r} is required", code="bad_job")
        name, tenant = body["job"], body.get("tenant", "default")
        if not isinstance(name, str) or not JOB_NAME.fullmatch(name):
            raise BadRequest("job name must be 1-63 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit", code="bad_job")
        if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
            raise BadRequest("tenant must be 1-31 characters of a-z, 0-9 and '-', starting with a letter or digit", code="bad_job")
        ints = {
            "goal": (1, 1_000_000),
            "leaf_fan_in": (0, 1024),
            "max_update_bytes": (64, 1 << 40),
            "max_inflight": (0, 1_000_000),
            "min_updates": (1, 1_000_000),
            "max_samples": (0, MAX_SAMPLES),
        }
        values: dict[str, Any] = {}
        for key, (low, high) in ints.items():
            if key not in body:
                continue
            v = body[key]
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                raise BadRequest(f"job field {key!r} must be an integer in [{low}, {high}]", code="bad_job")
            values[key] = v
        floats = {"round_deadline_s": (0.0, 86400.0 * 30), "lease_ttl_s": (0.5, 86400.0), "over_selection": (1.0, 10.0)}
        for key, (low, high) in floats.items():
            if key not in body:
                continue
            v = body[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
                raise BadRequest(f"job field {key!r} must be a number in [{low:g}, {high:g}]", code="bad_job")
            values[key] = float(v)
        if "retention" in body:
            values["retention"] = RetentionPolicy.from_request(body["retention"]).to_dict()
        if "architecture" in body:
            if body["architecture"] not in MODELS:
                raise BadRequest(f"job field 'architecture' must be one of {', '.join(MODELS)}", code="bad_job")
            values["architecture"] = body["architecture"]
        if values.get("min_updates", 1) > values["goal"]:
            raise BadRequest("job field 'min_updates' cannot exceed the goal", code="bad_job")
        strategy = StrategySpec.from_request(body.get("strategy"), goal=values["goal"])
        values["strategy"] = strategy.to_json()
        fixed_point = FixedPoint.from_request(body.get("fixed_point"))
        if fixed_point is not None:
            if not strategy.eager:
                hint = " (or clip on the clients of a secure job: clip_on 'client')" if strategy.name == "dp_fedavg" else ""
                raise BadRequest(f"fixed-point aggregation sums updates in the hierarchy; strategy {strategy.name!r} "
                                 f"reads every update at the top instead: choose one{hint}", code="bad_job")
            values["fixed_point"] = fixed_point.to_json()
        if "shards" in body or "shard_alignment" in body:
            shards, alignment = check_shards(body.get("shards", 1), body.get("shard_alignment", ELEMENT))
            if shards != 1 and strategy.reads_update_pairs and values["goal"] > MAX_SHARDED_GRAM_UPDATES:
                raise BadRequest(f"strategy {strategy.name!r} on tensor shards adds up the shards' distances between "
                                 f"every pair of updates, for at most {MAX_SHARDED_GRAM_UPDATES} updates a round; the goal "
                                 f"is {values['goal']}: lower it or drop 'shards'", code="bad_job")
            values["shards"], values["shard_alignment"] = shards, alignment
        if "accumulator" in body:
            accumulator = body["accumulator"]
            if accumulator not in ACCUMULATORS:
                raise BadRequest(f"job field 'accumulator' must be one of {', '.join(ACCUMULATORS)}, got "
                                 f"{reprlib.repr(accumulator)}", code="bad_job")
            if accumulator != "float64" and (fixed_point is not None or strategy.runs_step):
                raise BadRequest(f"accumulator {accumulator!r} is for fedavg in floats; "
                                 + ("fixed point sums in integers" if fixed_point is not None else
                                    f"strategy {strategy.name!r} computes in float64") + ": choose one", code="bad_job")
            values["accumulator"] = accumulator
        if body.get("secure_aggregation") is not None:  # {}: secure, with the defaults
            values["secure_aggregation"] = _secure_aggregation(body["secure_aggregation"], values, fixed_point).to_json()
        elif strategy.clips_on_client:
            raise BadRequest("dp_fedavg's clip_on 'client' is for secure jobs (their clients clip in the secure round's "
                             "collect stage): add secure_aggregation, or clip on the server", code="bad_job")
        return cls(job=name, tenant=tenant, **values)

    @property
    def secure(self) -> SecureSettings | None:
        """The secure-aggregation settings of a secure job (the server learns only each round's sum)."""
        fixed_point = self.fixed_point_spec
        if not self.secure_aggregation or fixed_point is None:
            return None
        return SecureSettings.from_request(self.secure_aggregation, width=fixed_point.width)

    @property
    def float_accumulator(self) -> DType:
        """What its partial sums of float tensors are kept in."""
        return ACCUMULATORS[self.accumulator]

    @property
    def strategy_spec(self) -> StrategySpec:
        return StrategySpec.from_json(self.strategy) if self.strategy else StrategySpec()

    @property
    def fixed_point_spec(self) -> FixedPoint | None:
        return FixedPoint.from_request(self.fixed_point)

    @property
    def retention_policy(self) -> RetentionPolicy:
        return self.retention_floor(RetentionPolicy.from_request(self.retention))

    def retention_floor(self, policy: RetentionPolicy) -> RetentionPolicy:
        """``policy``, keeping at least what the strategy reads: a strategy that is not eager reads
        every update of the round at the top, and fedbuff also the models its stale updates
        were trained from. A secure job's policy may keep no update (BadRequest)."""
        if self.secure_aggregation:
            _no_update_retention(policy)
        strategy = self.strategy_spec
        if not strategy.needs_updates:
            return policy
        return replace(policy, updates=max(policy.updates, 1), models=max(policy.models, strategy.max_staleness + 1))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls(**json.loads(text))


_INTEGER = re.compile(r"-?[0-9]{1,19}")
_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?")


def version_wait_query(query: str) -> tuple[int, float]:
    """``after`` and ``wait_s`` of a wait from a URL's query (``after=N&wait_s=S``; both optional)."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"after", "wait_s"})
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0][:64]!r}: give after=VERSION and wait_s=SECONDS",
                         code="bad_version_wait")
    if any(len(values) > 1 for values in params.values()):
        raise BadRequest("give each of after and wait_s at most once", code="bad_version_wait")
    return version_wait_params(params.get("after", [str(NO_VERSION)])[0], params.get("wait_s", ["0"])[0])


def version_wait_params(after: int | str, wait_s: float | str) -> tuple[int, float]:
    """``after`` and ``wait_s`` of a wait, checked (as a query's text or as gRPC's numbers)."""
    if isinstance(after, str) and not _INTEGER.fullmatch(after) or not isinstance(after, (int, str)) or isinstance(after, bool):
        raise BadRequest(f"after must be an integer version, got {str(after)[:32]!r}", code="bad_version_wait")
    version = int(after)
    if not NO_VERSION <= version <= MAX_VERSION:
        raise BadRequest(f"after must be an integer in [{NO_VERSION}, {MAX_VERSION}], got {version}", code="bad_version_wait")
    return version, _wait_seconds(wait_s, "bad_version_wait")


def _wait_seconds(wait_s: Any, code: str) -> float:
    if isinstance(wait_s, str) and not _SECONDS.fullmatch(wait_s) or not isinstance(wait_s, (int, float, str)) \
            or isinstance(wait_s, bool):
        raise BadRequest(f"wait_s must be a number of seconds, got {str(wait_s)[:32]!r}", code=code)
    seconds = float(wait_s)
    if not (math.isfinite(seconds) and 0 <= seconds <= MAX_VERSION_WAIT_S):
        raise BadRequest(f"wait_s must be in [0, {MAX_VERSION_WAIT_S:g}] seconds, got {seconds:g}", code=code)
    return seconds


def stage_wait_query(query: str) -> tuple[str | None, tuple[int, str] | None, float]:
    """The client, the (round, stage) seen and ``wait_s`` of a secure round's status from a URL's
    query (``client=C&round=R&after=STAGE&wait_s=S``; round and after go together; all optional)."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"client", "round", "after", "wait_s"})
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0][:64]!r}: give client, round, after and wait_s",
                         code="bad_stage_wait")
    if any(len(values) > 1 for values in params.values()):
        raise BadRequest("give each of client, round, after and wait_s at most once", code="bad_stage_wait")
    one = {k: v[0] for k, v in params.items()}
    after, seconds = stage_wait_params(one.get("round"), one.get("after"), one.get("wait_s", "0"))
    return one.get("client") or None, after, seconds  # client= (empty): the token's own, as with none


def stage_wait_params(round_id: Any, after: Any, wait_s: Any) -> tuple[tuple[int, str] | None, float]:
    """What a client saw of a secure round (its round and stage; neither: nothing to wait past)
    and how long to wait for it to move on, checked (a query's text or JSON's values)."""
    seconds = _wait_seconds(wait_s, "bad_stage_wait")
    if round_id is None and after is None:
        return None, seconds
    if round_id is None or after is None:
        raise BadRequest("give round and after together: the round and the stage seen", code="bad_stage_wait")
    if isinstance(round_id, bool) or not (isinstance(round_id, int) or isinstance(round_id, str) and _INTEGER.fullmatch(round_id)):
        raise BadRequest(f"round must be an integer, got {str(round_id)[:32]!r}", code="bad_stage_wait")
    if not 0 <= int(round_id) <= MAX_VERSION:
        raise BadRequest(f"round must be an integer in [0, {MAX_VERSION}], got {int(round_id)}", code="bad_stage_wait")
    if after not in SECURE_STAGES:
        raise BadRequest(f"after must be a stage ({', '.join(SECURE_STAGES)}), got {str(after)[:32]!r}", code="bad_stage_wait")
    return (int(round_id), after), seconds


def _secure_aggregation(obj: Any, values: dict[str, Any], fixed_point: FixedPoint | None) -> SecureSettings:
    """A secure job's settings, and what they rule out: masked inputs are fixed-point integers
    summed in the hierarchy (so fixed point, and a strategy that needs only the sum: fixed point
    already asks that), and no one update may be kept for queries."""
    if fixed_point is None:
        raise BadRequest("secure aggregation sums masked fixed-point integers: the job needs 'fixed_point' too",
                         code="bad_job")
    settings = SecureSettings.from_request(obj, width=fixed_point.width)
    if values.get("round_deadline_s"):
        raise BadRequest("a secure round ends by its stages' deadlines: set secure_aggregation's stage_timeout_s, not "
                         "round_deadline_s", code="bad_job")
    choose_params(values["goal"], settings.dropout, settings.corruption)  # the goal is the most clients a round enrols
    _no_update_retention(RetentionPolicy.from_request(values.get("retention", {})))
    if values.get("shards", 1) != 1:
        raise BadRequest("a secure round's top unmasks the whole model: a secure job is not cut into shards", code="bad_job")
    return settings


def _no_update_retention(policy: RetentionPolicy) -> None:
    if policy.update_rounds:
        raise BadRequest("a secure job keeps no client's update (its server sees only masked inputs): drop the retention "
                         "of updates ('updates', 'history', 'clients')", code="bad_job")
