"""The back-off for failed authentication (gateway/auth_backoff.py) on its own: failures per
address in fixed windows, and its bounded memory. Through a real gateway: tests/test_security.py."""

from __future__ import annotations

import pytest

from lifl.gateway.auth_backoff import (
    AUTH_FAILURE_WINDOW_S, MAX_AUTH_FAILURES, MAX_TRACKED_ADDRESSES, AuthBackoff, TooManyAuthFailures,
)


def outcomes(backoff: AuthBackoff, failures: list[tuple[str, float]]) -> list[float | None]:
    """For each (address, time) failure in turn: None (answered 401) or its Retry-After."""
    refusals = [backoff.failed(address, now) for address, now in failures]
    return [None if r is None else r.retry_after for r in refusals]


# (failures in turn, what each one is answered), with at most 2 failures per 10 s window
CASES = {
    "within-the-limit": ([("a", 0.0), ("a", 1.0)], [None, None]),
    "past-the-limit-until-the-window-ends": ([("a", 0.0), ("a", 1.0), ("a", 2.0), ("a", 9.5)], [None, None, 8.0, 0.5]),
    "a-new-window-at-its-end": ([("a", 0.0), ("a", 1.0), ("a", 2.0), ("a", 10.0), ("a", 11.0), ("a", 12.0)],
                                [None, None, 8.0, None, None, 8.0]),
    "addresses-apart": ([("a", 0.0), ("a", 1.0), ("b", 2.0), ("a", 3.0), ("b", 4.0), ("b", 5.0)],
                        [None, None, None, 7.0, None, 7.0]),
    "windows-start-at-a-first-failure": ([("a", 5.0), ("a", 14.0), ("a", 15.0)], [None, None, None]),
}


@pytest.mark.parametrize("failures,expected", CASES.values(), ids=CASES.keys())
def test_failures_per_address_and_window(failures: list[tuple[str, float]], expected: list[float | None]) -> None:
    assert outcomes(AuthBackoff(max_failures=2, window_s=10.0), failures) == expected


def test_the_defaults_at_and_past_the_limit() -> None:
    backoff = AuthBackoff()
    assert all(backoff.failed("10.0.0.1", i * 0.001) is None for i in range(MAX_AUTH_FAILURES))
    refusal = backoff.failed("10.0.0.1", 1.0)
    assert isinstance(refusal, TooManyAuthFailures)
    assert (refusal.status, refusal.grpc_status, refusal.code) == (429, "RESOURCE_EXHAUSTED", "too_many_auth_failures")
    assert refusal.retry_after == pytest.approx(AUTH_FAILURE_WINDOW_S - 1.0)
    assert f"more than {MAX_AUTH_FAILURES} failed authentications" in refusal.message
    assert backoff.failed("10.0.0.1", AUTH_FAILURE_WINDOW_S) is None  # the next window


def test_tracked_addresses_are_bounded_and_the_oldest_window_is_forgotten() -> None:
    backoff = AuthBackoff(max_failures=1, window_s=100.0, max_addresses=3)
    for now, address in enumerate("abc"):
        backoff.failed(address, float(now))
    assert backoff.failed("b", 3.0) is not None  # b backs off
    backoff.failed("d", 4.0)  # makes room: a's window started first
    assert len(backoff) == 3
    assert backoff.failed("a", 5.0) is None  # forgotten: a fresh window
    assert backoff.failed("b", 6.0) is None  # ...which pushed b out in turn
    assert backoff.failed("d", 7.0) is not None


def test_a_renewed_window_counts_as_the_newest() -> None:
    backoff = AuthBackoff(max_failures=1, window_s=10.0, max_addresses=2)
    backoff.failed("a", 0.0)
    backoff.failed("b", 5.0)
    backoff.failed("a", 11.0)  # a's new window is younger than b's
    backoff.failed("c", 12.0)  # so b goes
    assert backoff.failed("a", 13.0) is not None and backoff.failed("b", 13.0) is None


def test_the_default_bound() -> None:
    backoff = AuthBackoff()
    for i in range(MAX_TRACKED_ADDRESSES + 10):
        backoff.failed(f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", 0.0)
    assert len(backoff) == MAX_TRACKED_ADDRESSES


@pytest.mark.parametrize("kwargs", [{"max_failures": 0}, {"window_s": 0.0}, {"max_addresses": 0}])
def test_limits_must_be_positive(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        AuthBackoff(**kwargs)  # type: ignore[arg-type]
