"""Knative's KPA scaling decision as pure logic: the stock-serverless baseline's autoscaler.

The SL baseline (stock serverless, as on Knative) scales its aggregator function instances the
way Knative's Pod Autoscaler (KPA) does, so a comparison with lifl measures lifl's planning
against the algorithm a Knative user would actually get. The arithmetic follows
``pkg/autoscaler/scaling/autoscaler.go`` (``autoscaler.Scale``) of knative/serving, and the
window averages ``pkg/autoscaler/aggregation/bucketing.go``; the scale-to-zero gate
approximates ``handleScaleToZero`` of ``pkg/reconciler/autoscaling/kpa/scaler.go``. Nothing here
does I/O or reads a clock: the caller passes the time to ``record`` and ``decide``.

Each decision, as in Knative:

- the observed concurrency is averaged over the stable window (60 s) and the panic window
  (10 % of it, 6 s), each in time buckets of half a tick (Knative's 1 s buckets under its 2 s
  tick): the mean of the buckets' means over the buckets that hold samples, zero if none does.
  Knative's scraper writes one sample a second and counts a missed one between two written as
  zero; leaving empty buckets out instead makes the average independent of how often the
  caller samples. As in Knative, a trailing stretch with no samples is left out of the average
  and a window with none averages to zero;
- desired pods = ceil(average / (target * utilization)), for both windows, each clamped to
  [floor(ready / max_scale_down_rate), ceil(max_scale_up_rate * ready)], where ready counts as
  at least 1 (so from zero, traffic yields at least one pod: the activator case);
- panic starts when the panic window's desired count is at least ``panic_threshold`` times the
  ready pods (ready counted as at least 1, as Knative does) and lasts until a stable window has
  passed since the last decision over the threshold. In panic the larger of the two counts is
  used and the count never goes below the highest one decided during that panic;
- the result is clamped to [min_scale, max_scale] (max_scale 0: unbounded), as Knative's
  scaler does after the decider.

Scale to zero. In Knative the decider asks for zero once the stable window has seen no traffic
(and the rate limit lets the count reach zero); the reconciler then marks the revision inactive
(only after it has been active for a stable window), puts the activator in the request path,
and removes the last pod only after ``scale-to-zero-grace-period`` more. Here: zero is wanted
when the decider's count is zero and no concurrency above zero has been recorded for a stable
window (counted from the first sample when there has never been traffic, which stands for
"active for a stable window"); the grace period is timed from the first decision that wanted
zero after the last one that did not, and until it has passed the current ready count is kept.
So the last pod goes a stable window plus the grace period after the last traffic (90 s by
default), plus the ticks the rate limit takes to bring the count down to one.

Left out: activation-scale, scale-down-delay, excess burst capacity (it only decides whether
the activator stays in the path), the RPS metric, unreachable revisions, and activation
timeouts. With no sample recorded yet, the decision keeps the ready count (Knative's decider
returns no decision then, and the scale stays as it is).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KpaConfig:
    """Knative's ``config-autoscaler`` defaults, in the units of this module (seconds, fractions)."""

    target: float = 100.0  # container-concurrency-target-default
    utilization: float = 0.7  # container-concurrency-target-percentage: 70 in-flight requests per pod
    stable_window_s: float = 60.0
    panic_window_fraction: float = 0.1  # panic-window-percentage: 6 s
    panic_threshold: float = 2.0  # panic-threshold-percentage: 200 %
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    tick_s: float = 2.0  # the autoscaler's decision period
    scale_to_zero_grace_s: float = 30.0
    min_scale: int = 0
    max_scale: int = 0  # 0: unbounded

    def __post_init__(self) -> None:
        # Written as `not (x > y)` so that NaN fails too. The bounds are Knative's own checks
        # (pkg/autoscaler/config/config.go) where it has them.
        checks = [
            ("target", self.target > 0, "must be > 0"),
            ("utilization", 0 < self.utilization <= 1, "must be in (0, 1]"),
            ("stable_window_s", self.stable_window_s > 0, "must be > 0"),
            ("panic_window_fraction", 0 < self.panic_window_fraction <= 1, "must be in (0, 1]"),
            ("panic_threshold", self.panic_threshold > 1, "must be > 1"),
            ("max_scale_up_rate", self.max_scale_up_rate > 1, "must be > 1"),
            ("max_scale_down_rate", self.max_scale_down_rate > 1, "must be > 1"),
            ("tick_s", self.tick_s > 0, "must be > 0"),
            ("scale_to_zero_grace_s", self.scale_to_zero_grace_s >= 0, "must be >= 0"),
            ("min_scale", self.min_scale >= 0, "must be >= 0"),
            ("max_scale", self.max_scale >= 0, "must be >= 0 (0: unbounded)"),
        ]
        for field, ok, rule in checks:
            if not ok:
                raise ValueError(f"KpaConfig.{field} {rule}, got {getattr(self, field)!r}")
        if self.max_scale and self.min_scale > self.max_scale:
            raise ValueError(f"KpaConfig.min_scale ({self.min_scale}) must be <= max_scale ({self.max_scale})")

    @property
    def panic_window_s(self) -> float:
        return self.stable_window_s * self.panic_window_fraction

    def scaled(self, factor: float) -> KpaConfig:
        """The same algorithm on a time scale ``factor`` times Knative's (windows, tick, grace): for short runs."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor!r}")
        return dataclasses.replace(
            self,
            stable_window_s=self.stable_window_s * factor,
            tick_s=self.tick_s * factor,
            scale_to_zero_grace_s=self.scale_to_zero_grace_s * factor,
        )


class _WindowAverage:
    """The average of a sampled value over a sliding window of time buckets (after Knative's TimedFloat64Buckets)."""

    def __init__(self, window_s: float, bucket_s: float) -> None:
        self._bucket_s = bucket_s
        self._size = max(1, round(window_s / bucket_s))  # the window, in buckets
        self._buckets: dict[int, tuple[float, int]] = {}  # bucket index -> (sum, count) of its samples
        self._newest: int | None = None

    def _index(self, now: float) -> int:
        return math.floor(now / self._bucket_s)

    def record(self, now: float, value: float) -> None:
        index = self._index(now)
        if self._newest is None or index > self._newest:
            self._newest = index
            for stale in [i for i in self._buckets if i <= index - self._size]:
                del self._buckets[stale]
        elif index <= self._newest - self._size:
            return  # older than a window before the newest sample
        total, count = self._buckets.get(index, (0.0, 0))
        self._buckets[index] = (total + value, count + 1)

    def average(self, now: float) -> float:
        low = self._index(now) - self._size  # buckets above this one are in the window
        means = [total / count for i, (total, count) in self._buckets.items() if i > low]
        # Rounded as Knative does, so that float noise cannot add a pod through ceil().
        return round(sum(means) / len(means), 6) if means else 0.0


class Kpa:
    """The KPA decider for one revision: feed it concurrency samples, ask it for a pod count each tick."""

    def __init__(self, config: KpaConfig) -> None:
        self.config = config
        bucket_s = config.tick_s / 2
        self._stable = _WindowAverage(config.stable_window_s, bucket_s)
        self._panic = _WindowAverage(config.panic_window_s, bucket_s)
        self._quiet_since: float | None = None  # the last sample above zero, or the first sample if none was
        self._panic_since: float | None = None  # the last decision over the panic threshold, while panicking
        self._max_panic_pods = 0
        self._zero_since: float | None = None  # the first decision wanting zero, after the last one that did not

    @property
    def panicking(self) -> bool:
        return self._panic_since is not None

    def record(self, now: float, concurrency: float) -> None:
        """An observed concurrency sample at ``now``: in-flight requests summed over the revision's pods."""
        if not concurrency >= 0:
            raise ValueError(f"concurrency must be >= 0, got {concurrency!r}")
        self._stable.record(now, concurrency)
        self._panic.record(now, concurrency)
        if concurrency > 0 or self._quiet_since is None:
            self._quiet_since = now

    def decide(self, now: float, ready: int) -> int:
        """The desired pod count at ``now``, given ``ready`` pods serving."""
        if ready < 0:
            raise ValueError(f"ready must be >= 0, got {ready!r}")
        cfg = self.config
        if self._quiet_since is None:
            return self._clamp(ready)

        pods = max(1, ready)
        max_up = math.ceil(cfg.max_scale_up_rate * pods)
        max_down = math.floor(pods / cfg.max_scale_down_rate)
        per_pod = cfg.target * cfg.utilization
        stable_want = math.ceil(self._stable.average(now) / per_pod)
        panic_want = math.ceil(self._panic.average(now) / per_pod)
        stable_pods = min(max(stable_want, max_down), max_up)
        panic_pods = min(max(panic_want, max_down), max_up)

        if panic_want / pods >= cfg.panic_threshold:
            self._panic_since = now  # start panicking, or extend the panic
        elif self._panic_since is not None and now > self._panic_since + cfg.stable_window_s:
            self._panic_since = None  # the surge has made its way into the stable window
            self._max_panic_pods = 0

        desired = stable_pods
        if self._panic_since is not None:
            self._max_panic_pods = max(self._max_panic_pods, stable_pods, panic_pods)
            desired = self._max_panic_pods

        if desired == 0 and now - self._quiet_since >= cfg.stable_window_s:
            if self._zero_since is None:
                self._zero_since = now
            if now - self._zero_since < cfg.scale_to_zero_grace_s:
                desired = ready  # inactive, waiting out the grace period: leave the pods as they are
        else:
            self._zero_since = None
            if desired == 0:
                desired = ready  # traffic within the stable window: not a candidate for zero yet
        return self._clamp(desired)

    def _clamp(self, pods: int) -> int:
        cfg = self.config
        pods = max(pods, cfg.min_scale)
        return min(pods, cfg.max_scale) if cfg.max_scale else pods
