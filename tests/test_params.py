"""lifl.params: the named-parameter checks that strategies and queries share."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lifl.errors import BadRequest
from lifl.params import REQUIRED, Checks, Param, optional, show

STRATEGY = Checks("bad_strategy", "strategy parameter")
QUERY = Checks("bad_query")


@pytest.mark.parametrize("check, value, expected", [
    (QUERY.integer(1, 3), 1, 1),
    (QUERY.integer(1, 3), 3, 3),
    (QUERY.integer(0), 10 ** 12, 10 ** 12),
    (QUERY.number(0.0, 1.0), 0, 0.0),
    (QUERY.number(0.0, 1.0), 1.0, 1.0),
    (QUERY.number(0.0, low_open=True), 1e-300, 1e-300),
    (QUERY.choice("a", "b"), "b", "b"),
    (QUERY.boolean, False, False),
    (QUERY.text, "x", "x"),
    (optional(QUERY.integer(1)), None, None),
])
def test_accepts_at_the_limits(check: Any, value: Any, expected: Any) -> None:
    assert check("p", value) == expected


@pytest.mark.parametrize("checks, check, value, message", [
    (QUERY, QUERY.integer(1, 3), 0, "p must be in 1..3, got 0"),
    (QUERY, QUERY.integer(1, 3), 4, "p must be in 1..3, got 4"),
    (QUERY, QUERY.integer(1), 0, "p must be >= 1, got 0"),
    (QUERY, QUERY.integer(1), True, "p must be an integer, got True"),
    (QUERY, QUERY.integer(1), 2.0, "p must be an integer, got 2.0"),
    (STRATEGY, STRATEGY.number(0.0, 1.0, high_open=True), 1.0, "strategy parameter p must be in [0, 1), got 1.0"),
    (STRATEGY, STRATEGY.number(0.0, low_open=True), 0, "strategy parameter p must be in (0, inf), got 0"),
    (STRATEGY, STRATEGY.number(0.0), math.nan, "must be a finite number, got nan"),
    (STRATEGY, STRATEGY.number(0.0), "1", "must be a finite number, got '1'"),
    (STRATEGY, STRATEGY.number(0.0), False, "must be a finite number, got False"),
    (QUERY, QUERY.choice("a", "b"), "c", "p must be one of 'a', 'b', got 'c'"),
    (QUERY, QUERY.boolean, 1, "p must be true or false, got 1"),
    (QUERY, QUERY.text, "", "p must be a non-empty string"),
    (QUERY, optional(QUERY.integer(1)), 0, "p must be >= 1"),
])
def test_refuses_past_the_limits_naming_the_parameter(checks: Checks, check: Any, value: Any, message: str) -> None:
    with pytest.raises(BadRequest) as e:
        check("p", value)
    assert message in e.value.message and e.value.code == checks.code


def test_fill_checks_defaults_unknown_and_required() -> None:
    table = {"a": Param(1, QUERY.integer(0)), "b": Param(REQUIRED, QUERY.boolean), "c": Param(None, QUERY.text)}
    assert QUERY.fill("w", table, {"b": True}) == {"a": 1, "b": True, "c": None}
    assert QUERY.fill("w", table, {"a": 5, "b": False, "c": "x"}) == {"a": 5, "b": False, "c": "x"}
    for given, message in (({"a": 1}, "w needs the parameter b"), ({"b": True, "z": 1, "y": 2}, "unknown parameter(s) y, z for w"),
                           ({"b": True, "a": -1}, "a must be >= 0")):
        with pytest.raises(BadRequest) as e:
            QUERY.fill("w", table, given)
        assert message in e.value.message, e.value.message
    with pytest.raises(BadRequest) as e:
        STRATEGY.fill("median", {}, {"x": 1})
    assert "unknown strategy parameter(s) x for median; it takes no parameters" in e.value.message


def test_show_shortens_long_values() -> None:
    assert show("x" * 100).endswith("...") and len(show("x" * 100)) == 60 and show(5) == "5"
