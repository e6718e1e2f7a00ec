"""Knative's KPA decision (the SL baseline's autoscaler), as tables: time is passed in, no processes."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from lifl.baselines.kpa import Kpa, KpaConfig

DEFAULT = KpaConfig()
EPS = 1e-9


def run(kpa: Kpa, load: Callable[[float], float], ticks: int, ready: int,
        start_tick: int = 0) -> list[tuple[float, int]]:
    """Each tick: record the load, decide, and let the ready pods follow the decision at once."""
    decisions = []
    for n in range(start_tick, start_tick + ticks):
        now = n * kpa.config.tick_s
        kpa.record(now, load(now))
        ready = kpa.decide(now, ready)
        decisions.append((now, ready))
    return decisions


@pytest.mark.parametrize("concurrency, ready, pods", [
    (1, 1, 1),
    (70, 1, 1),
    (71, 1, 2),
    (140, 2, 2),
    (350, 1, 5),
    (700, 10, 10),
    (7000, 1, 100),
    (6999, 300, 100),  # halving each tick, down to the need
])
def test_steady_load_gives_ceil_of_load_over_70(concurrency: float, ready: int, pods: int) -> None:
    kpa = Kpa(DEFAULT)
    decisions = run(kpa, lambda _: concurrency, ticks=120, ready=ready)  # 4 minutes
    assert decisions[-1][1] == pods == math.ceil(concurrency / 70)


@pytest.mark.parametrize("base, burst, pods", [(70, 700, 10), (70, 1400, 20), (140, 7000, 100)])
def test_burst_panics_and_scales_up_within_the_panic_window(base: float, burst: float, pods: int) -> None:
    kpa = Kpa(DEFAULT)
    ready = run(kpa, lambda _: base, ticks=60, ready=1)[-1][1]
    assert not kpa.panicking and ready == math.ceil(base / 70)
    onset = 60 * DEFAULT.tick_s
    decisions = run(kpa, lambda _: burst, ticks=4, ready=ready, start_tick=60)  # onset .. onset + 6 s
    assert kpa.panicking
    assert decisions[0][1] > ready  # the first tick of the burst already scales up
    assert decisions[-1] == (onset + DEFAULT.panic_window_s, pods)
    # The stable window alone would still ask for far fewer.
    assert math.ceil((54 * base + 6 * burst) / 60 / 70) < pods


@pytest.mark.parametrize("after", [0.0, 70.0, 350.0])
def test_panic_never_scales_down_until_a_stable_window_after_the_last_trigger(after: float) -> None:
    kpa = Kpa(DEFAULT)
    run(kpa, lambda _: 70, ticks=60, ready=1)
    for now in (120.0, 122.0, 124.0, 126.0, 128.0):  # the pods do not come up: every tick is over the threshold
        kpa.record(now, 1400)
        peak = kpa.decide(now, 1)
    assert kpa.panicking and peak == 20
    last_trigger = 128.0
    calm = run(kpa, lambda _: after, ticks=60, ready=peak, start_tick=65)
    held = [pods for now, pods in calm if now <= last_trigger + DEFAULT.stable_window_s]
    assert len(held) == 30 and all(pods == peak for pods in held)
    released = [pods for now, pods in calm if now > last_trigger + DEFAULT.stable_window_s]
    assert not kpa.panicking and released[0] == max(peak // 2, math.ceil(after / 70))


@pytest.mark.parametrize("ready, concurrency, pods", [
    (16, 70, 8),
    (16, 0, 8),
    (5, 70, 2),
    (3, 0, 1),
    (2, 70, 1),
    (16, 700, 10),  # the need, not the limit
])
def test_scale_down_is_limited_to_halving_per_decision(ready: int, concurrency: float, pods: int) -> None:
    kpa = Kpa(DEFAULT)
    kpa.record(0.0, concurrency)
    assert kpa.decide(0.0, ready) == pods
    assert not kpa.panicking


def test_scale_down_halves_each_tick() -> None:
    kpa = Kpa(DEFAULT)
    decisions = run(kpa, lambda _: 1, ticks=6, ready=32)
    assert [pods for _, pods in decisions] == [16, 8, 4, 2, 1, 1]


@pytest.mark.parametrize("config", [
    DEFAULT,
    DEFAULT.scaled(0.1),
    KpaConfig(scale_to_zero_grace_s=0.0),
    KpaConfig(stable_window_s=20.0, scale_to_zero_grace_s=10.0),
])
def test_scale_to_zero_only_after_the_stable_window_plus_grace(config: KpaConfig) -> None:
    kpa = Kpa(config)
    stop = 50 * config.tick_s  # the last sample with traffic
    decisions = run(kpa, lambda now: 70.0 if now <= stop + EPS else 0.0, ticks=200, ready=1)
    zero_at = next(now for now, pods in decisions if pods == 0)
    due = stop + config.stable_window_s + config.scale_to_zero_grace_s
    assert due - EPS <= zero_at < due + config.tick_s
    assert all(pods == 1 for now, pods in decisions if now < zero_at)
    assert all(pods == 0 for now, pods in decisions if now >= zero_at)


def test_traffic_during_the_grace_period_cancels_scale_to_zero() -> None:
    kpa = Kpa(DEFAULT)
    run(kpa, lambda now: 70.0 if now == 0 else 0.0, ticks=40, ready=1)  # quiet from 0 s to 78 s: grace began at 60 s
    kpa.record(80.0, 1.0)
    assert kpa.decide(80.0, 1) == 1
    decisions = run(kpa, lambda _: 0.0, ticks=60, ready=1, start_tick=41)
    zero_at = next(now for now, pods in decisions if pods == 0)
    assert zero_at == 80.0 + DEFAULT.stable_window_s + DEFAULT.scale_to_zero_grace_s


def test_no_traffic_ever_scales_to_zero_a_stable_window_plus_grace_after_the_first_sample() -> None:
    decisions = run(Kpa(DEFAULT), lambda _: 0.0, ticks=60, ready=1)
    assert next(now for now, pods in decisions if pods == 0) == 90.0


@pytest.mark.parametrize("concurrency, pods", [(1, 1), (50, 1), (70, 1), (71, 2), (700, 10)])
def test_from_zero_a_request_gives_pods(concurrency: float, pods: int) -> None:
    kpa = Kpa(DEFAULT)
    assert kpa.decide(0.0, 0) == 0  # no data yet: stay at zero
    kpa.record(1.0, concurrency)
    assert kpa.decide(1.0, 0) == pods


def test_from_zero_after_a_long_quiet_spell() -> None:
    kpa = Kpa(DEFAULT)
    decisions = run(kpa, lambda _: 0.0, ticks=100, ready=1)
    assert decisions[-1][1] == 0
    kpa.record(200.0, 1.0)
    assert kpa.decide(200.0, 0) == 1


@pytest.mark.parametrize("config, ready, pods", [
    (DEFAULT, 0, 0),
    (DEFAULT, 4, 4),
    (KpaConfig(min_scale=2), 0, 2),
    (KpaConfig(max_scale=3), 5, 3),
])
def test_no_data_keeps_the_ready_count(config: KpaConfig, ready: int, pods: int) -> None:
    assert Kpa(config).decide(10.0, ready) == pods


@pytest.mark.parametrize("rate, ready, concurrency, pods", [
    (2.0, 3, 7000, 6),
    (1.5, 1, 7000, 2),
    (1.1, 3, 700, 4),  # ceil(1.1 * 3): at least one more pod
    (1000.0, 1, 7000, 100),
    (2.0, 0, 7000, 2),  # from zero, ready counts as one
])
def test_scale_up_is_rate_limited(rate: float, ready: int, concurrency: float, pods: int) -> None:
    kpa = Kpa(KpaConfig(max_scale_up_rate=rate))
    kpa.record(0.0, concurrency)
    assert kpa.decide(0.0, ready) == pods


@pytest.mark.parametrize("min_scale, max_scale, concurrency, ready, pods", [
    (0, 5, 7000, 5, 5),
    (0, 5, 7000, 1, 5),
    (3, 0, 70, 3, 3),
    (3, 0, 0, 1, 3),
    (2, 4, 210, 3, 3),
    (1, 1, 7000, 1, 1),
])
def test_min_and_max_scale_clamp(min_scale: int, max_scale: int, concurrency: float, ready: int, pods: int) -> None:
    kpa = Kpa(KpaConfig(min_scale=min_scale, max_scale=max_scale))
    kpa.record(0.0, concurrency)
    assert kpa.decide(0.0, ready) == pods


def test_min_scale_never_goes_to_zero() -> None:
    decisions = run(Kpa(KpaConfig(min_scale=1)), lambda _: 0.0, ticks=200, ready=1)
    assert all(pods == 1 for _, pods in decisions)


def test_scaled_shrinks_windows_tick_and_grace() -> None:
    small = DEFAULT.scaled(0.1)
    windows = (small.stable_window_s, small.panic_window_s, small.tick_s, small.scale_to_zero_grace_s)
    assert windows == pytest.approx((6.0, 0.6, 0.2, 3.0))
    assert (small.target, small.utilization, small.panic_threshold, small.max_scale_up_rate, small.max_scale_down_rate,
            small.min_scale, small.max_scale) == (100.0, 0.7, 2.0, 1000.0, 2.0, 0, 0)
    # The same burst reaches its count ten times sooner.
    kpa = Kpa(small)
    run(kpa, lambda _: 70, ticks=60, ready=1)
    decisions = run(kpa, lambda _: 700, ticks=4, ready=1, start_tick=60)
    assert kpa.panicking and decisions[-1][1] == 10
    assert decisions[-1][0] - 60 * small.tick_s == pytest.approx(0.6)


@pytest.mark.parametrize("factor", [0.0, -1.0, math.nan])
def test_scaled_rejects_non_positive_factors(factor: float) -> None:
    with pytest.raises(ValueError, match="factor"):
        DEFAULT.scaled(factor)


@pytest.mark.parametrize("kwargs, field", [
    ({"target": 0.0}, "target"),
    ({"target": -1.0}, "target"),
    ({"target": math.nan}, "target"),
    ({"utilization": 0.0}, "utilization"),
    ({"utilization": 1.5}, "utilization"),
    ({"stable_window_s": 0.0}, "stable_window_s"),
    ({"panic_window_fraction": 0.0}, "panic_window_fraction"),
    ({"panic_window_fraction": 1.1}, "panic_window_fraction"),
    ({"panic_threshold": 1.0}, "panic_threshold"),
    ({"max_scale_up_rate": 1.0}, "max_scale_up_rate"),
    ({"max_scale_down_rate": 0.5}, "max_scale_down_rate"),
    ({"tick_s": 0.0}, "tick_s"),
    ({"scale_to_zero_grace_s": -1.0}, "scale_to_zero_grace_s"),
    ({"min_scale": -1}, "min_scale"),
    ({"max_scale": -1}, "max_scale"),
    ({"min_scale": 5, "max_scale": 2}, "min_scale"),
])
def test_invalid_config_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=rf"KpaConfig\.{field}\b"):
        KpaConfig(**kwargs)


def test_utilization_of_one_is_valid() -> None:
    kpa = Kpa(KpaConfig(utilization=1.0))
    kpa.record(0.0, 100.0)
    assert kpa.decide(0.0, 1) == 1


@pytest.mark.parametrize("call", [
    lambda kpa: kpa.record(0.0, -1.0),
    lambda kpa: kpa.record(0.0, math.nan),
    lambda kpa: kpa.decide(0.0, -1),
])
def test_invalid_samples_and_ready_counts(call: Callable[[Kpa], object]) -> None:
    with pytest.raises(ValueError):
        call(Kpa(DEFAULT))
