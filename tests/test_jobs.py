"""Job specifications: field-by-field validation."""

from __future__ import annotations

import pytest

from lifl.errors import BadRequest, Unprocessable
from lifl.flstore.retention import RetentionPolicy
from lifl.format import BF16, F32, F64, DType, ModelSpec, TensorSpec
from lifl.jobs import AUTO_FAN_IN, AUTO_LEAF_BYTES, DEFAULT_MAX_UPDATE_BYTES, LARGE_UPDATE_BYTES, REFOLD_BOUND, JobSpec
from lifl.secagg_round import Settings as SecureSettings


def test_defaults_and_round_trip() -> None:
    spec = JobSpec.from_request({"job": "mnist-1", "goal": 10})
    assert (spec.tenant, spec.leaf_fan_in, spec.max_update_bytes, spec.inflight_budget) == ("default", 0, DEFAULT_MAX_UPDATE_BYTES, 10)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert JobSpec.from_request({"job": "a", "goal": 3, "max_inflight": 2}).inflight_budget == 2
    rounds = JobSpec.from_request({"job": "a", "goal": 4, "round_deadline_s": 30, "min_updates": 2, "lease_ttl_s": 5.5, "over_selection": 2})
    assert (rounds.round_deadline_s, rounds.min_updates, rounds.lease_ttl_s, rounds.over_selection) == (30.0, 2, 5.5, 2.0)


@pytest.mark.parametrize("body,needle", [
    (None, "JSON object"),
    ([], "JSON object"),
    ({"goal": 1}, "'job' is required"),
    ({"job": "a"}, "'goal' is required"),
    ({"job": "", "goal": 1}, "job name"),
    ({"job": "-a", "goal": 1}, "job name"),
    ({"job": "a" * 64, "goal": 1}, "job name"),
    ({"job": "a/b", "goal": 1}, "job name"),
    ({"job": "a\n", "goal": 1}, "job name"),  # "$" would match before the newline
    ({"job": "\na", "goal": 1}, "job name"),
    ({"job": "a\u0663", "goal": 1}, "job name"),  # a non-ASCII digit
    ({"job": "a", "goal": 1, "tenant": "t\n"}, "tenant"),
    ({"job": 5, "goal": 1}, "job name"),
    ({"job": "a", "goal": 0}, "'goal'"),
    ({"job": "a", "goal": True}, "'goal'"),
    ({"job": "a", "goal": 1.0}, "'goal'"),
    ({"job": "a", "goal": 10**7}, "'goal'"),
    ({"job": "a", "goal": 1, "leaf_fan_in": -1}, "'leaf_fan_in'"),
    ({"job": "a", "goal": 1, "leaf_fan_in": 1025}, "'leaf_fan_in'"),
    ({"job": "a", "goal": 1, "max_update_bytes": 1}, "'max_update_bytes'"),
    ({"job": "a", "goal": 1, "max_inflight": -1}, "'max_inflight'"),
    ({"job": "a", "goal": 1, "tenant": "Acme"}, "tenant"),
    ({"job": "a", "goal": 1, "tenant": "a" * 32}, "tenant"),
    ({"job": "a", "goal": 1, "priority": 3}, "unknown job field(s): priority"),
    ({"job": "a", "goal": 1, "round_deadline_s": -1}, "'round_deadline_s'"),
    ({"job": "a", "goal": 1, "round_deadline_s": "10"}, "'round_deadline_s'"),
    ({"job": "a", "goal": 1, "lease_ttl_s": 0}, "'lease_ttl_s'"),
    ({"job": "a", "goal": 1, "lease_ttl_s": True}, "'lease_ttl_s'"),
    ({"job": "a", "goal": 4, "over_selection": 0.9}, "'over_selection'"),
    ({"job": "a", "goal": 4, "min_updates": 0}, "'min_updates'"),
    ({"job": "a", "goal": 4, "min_updates": 5}, "cannot exceed the goal"),
])
def test_invalid_jobs_name_the_field(body: object, needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        JobSpec.from_request(body)
    assert needle in info.value.message and info.value.code == "bad_job"


def flat(dtype: DType, nbytes: int) -> ModelSpec:
    return ModelSpec((TensorSpec("w", dtype, (nbytes // dtype.itemsize,)),))


@pytest.mark.parametrize("leaf_fan_in, model, accumulator, expected", [
    (0, None, "float64", AUTO_FAN_IN[0]),  # no model yet
    (0, flat(F32, 4 << 10), "float64", AUTO_FAN_IN[1]),  # small updates: as many as a leaf may take
    (0, flat(F32, 40 << 10), "float64", AUTO_LEAF_BYTES // (40 << 10)),
    (0, flat(F32, 400 << 10), "float64", AUTO_LEAF_BYTES // (400 << 10)),
    (0, flat(F32, AUTO_LEAF_BYTES // 2), "float64", 2),
    (0, flat(F32, 44_700_000), "float64", 2),  # a ResNet-18: the paper's I
    (0, flat(F32, LARGE_UPDATE_BYTES - 4), "float64", 2),  # below large updates
    (0, flat(F32, LARGE_UPDATE_BYTES), "float64", 2 * REFOLD_BOUND),  # large: float64 partials are twice an update
    (0, flat(BF16, 500_000_000), "float64", 4 * REFOLD_BOUND),  # bf16: four times
    (0, flat(BF16, 500_000_000), "float32", 2 * REFOLD_BOUND),
    (0, flat(F64, 1 << 30), "float64", REFOLD_BOUND),
    (0, flat(F32, 4), "float64", AUTO_FAN_IN[1]),
    (7, flat(F32, 4 << 10), "float64", 7),  # as set, whatever the model
    (1, flat(BF16, 500_000_000), "float64", 1),
])
def test_the_leaf_fan_in_in_use(leaf_fan_in: int, model: ModelSpec | None, accumulator: str, expected: int) -> None:
    assert JobSpec("a", goal=10, leaf_fan_in=leaf_fan_in, accumulator=accumulator).fan_in_for(model) == expected


SECURE_BASE = {"job": "s", "goal": 20, "fixed_point": {"frac_bits": 20, "width": 32}}
DP = {"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 0.5}


def test_a_secure_job_fills_in_its_settings_and_round_trips() -> None:
    spec = JobSpec.from_request({**SECURE_BASE, "secure_aggregation": {}})  # {}: secure, with the defaults
    assert spec.secure == SecureSettings(0.1, 0.1, 60.0, 32)
    assert JobSpec.from_json(spec.to_json()).secure == spec.secure
    tuned = JobSpec.from_request({**SECURE_BASE, "secure_aggregation": {"dropout": 0.3, "corruption": 0, "stage_timeout_s": 5}})
    assert tuned.secure == SecureSettings(0.3, 0.0, 5.0, 32)
    assert JobSpec.from_request({**SECURE_BASE}).secure is None
    assert JobSpec.from_request({**SECURE_BASE, "secure_aggregation": None}).secure is None
    assert JobSpec.from_request({**SECURE_BASE, "secure_aggregation": {}, "retention": {"models": 3}}).secure is not None
    private = JobSpec.from_request({**SECURE_BASE, "secure_aggregation": {}, "strategy": {**DP, "clip_on": "client"}})
    assert private.strategy_spec.clips_on_client and private.strategy_spec.eager and private.secure is not None


@pytest.mark.parametrize("extra, code, needle", [
    ({"secure_aggregation": {}, "fixed_point": None}, "bad_job", "needs 'fixed_point'"),
    ({"secure_aggregation": []}, "bad_secure_aggregation", "must be an object"),
    ({"secure_aggregation": {"dropout": 0.5}}, "bad_secure_aggregation", "dropout must be a number in [0, 0.5)"),
    ({"secure_aggregation": {"corruption": -0.1}}, "bad_secure_aggregation", "corruption"),
    ({"secure_aggregation": {"dropout": True}}, "bad_secure_aggregation", "dropout"),
    ({"secure_aggregation": {"dropout": float("nan")}}, "bad_secure_aggregation", "dropout"),
    ({"secure_aggregation": {"stage_timeout_s": 0}}, "bad_secure_aggregation", "stage_timeout_s must be a number in (0, 3600]"),
    ({"secure_aggregation": {"stage_timeout_s": 3601}}, "bad_secure_aggregation", "stage_timeout_s"),
    ({"secure_aggregation": {"width": 64}}, "bad_secure_aggregation", "unknown secure_aggregation field(s): width"),
    ({"secure_aggregation": {}, "goal": 2}, "bad_secure_aggregation", "at least 3 clients"),
    ({"secure_aggregation": {}, "retention": {"updates": 1}}, "bad_job", "keeps no client's update"),
    ({"secure_aggregation": {}, "retention": {"clients": ["c1"], "client_rounds": 2}}, "bad_job", "keeps no client's update"),
    ({"secure_aggregation": {}, "shards": 2}, "bad_job", "not cut into shards"),
    ({"secure_aggregation": {}, "round_deadline_s": 30}, "bad_job", "stage_timeout_s, not round_deadline_s"),
    ({"secure_aggregation": {}, "strategy": {"name": "median"}}, "bad_job", "fixed-point aggregation"),
    ({"secure_aggregation": {}, "strategy": DP}, "bad_job", "clip on the clients of a secure job: clip_on 'client'"),
    ({"strategy": {**DP, "clip_on": "client"}}, "bad_job", "clip_on 'client' is for secure jobs"),
    ({"fixed_point": None, "strategy": {**DP, "clip_on": "client"}}, "bad_job", "clip_on 'client' is for secure jobs"),
    ({"secure_aggregation": {}, "strategy": {**DP, "clip_on": "clients"}}, "bad_strategy", "clip_on must be one of"),
])
def test_invalid_secure_jobs_say_why(extra: dict, code: str, needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        JobSpec.from_request({key: value for key, value in {**SECURE_BASE, **extra}.items() if value is not None})
    assert info.value.code == code and needle in info.value.message, info.value.message


def test_a_goal_too_small_for_its_dropout_is_refused() -> None:
    with pytest.raises(Unprocessable) as info:
        JobSpec.from_request({**SECURE_BASE, "goal": 7, "secure_aggregation": {"dropout": 0.49}})
    assert info.value.code == "secure_population_too_small"


def test_a_secure_jobs_retention_may_not_keep_updates_later_either() -> None:
    spec = JobSpec.from_request({**SECURE_BASE, "secure_aggregation": {}})
    with pytest.raises(BadRequest) as info:
        spec.retention_floor(RetentionPolicy(history=2))
    assert info.value.code == "bad_job"
    assert spec.retention_floor(RetentionPolicy(models=2)) == RetentionPolicy(models=2)
