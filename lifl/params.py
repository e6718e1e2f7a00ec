"""Checks of named JSON parameters: each returns the value or raises the caller's BadRequest naming the
parameter and what it must be.

A caller describes what it takes as a table, name -> ``Param(default, check)``, and ``Checks.fill``
checks a request's parameters against it. The same checks serve different callers, which differ
only in their error code and in how a message names a parameter: a job's strategy says
"strategy parameter eta must ...", a query just "eta must ...".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lifl.errors import BadRequest

Check = Callable[[str, Any], Any]  # (name, value) -> the value, checked (and converted)

REQUIRED = object()  # a default that makes the parameter mandatory


def show(value: Any) -> str:
    """A short rendering of a rejected value: a parameter may be a large list."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


@dataclass(frozen=True)
class Param:
    default: Any  # REQUIRED: the request must give it; None: resolved later by the caller (from the data, ...)
    check: Check


def optional(check: Check) -> Check:
    """``check``, letting null through (as None)."""
    def checked(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return checked


@dataclass(frozen=True)
class Checks:
    code: str  # the BadRequest's code
    noun: str = ""  # what a message calls a parameter before its name: "strategy parameter" or nothing

    def bad(self, message: str) -> BadRequest:
        return BadRequest(message, code=self.code)

    def _named(self, name: str) -> str:
        return f"{self.noun} {name}" if self.noun else name

    def integer(self, low: int, high: int | None = None) -> Check:
        """An integer in low..high (no upper bound if ``high`` is None); a bool is not one."""
        def check(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.bad(f"{self._named(name)} must be an integer, got {show(value)}")
            if value < low or (high is not None and value > high):
                bounds = f"in {low}..{high}" if high is not None else f">= {low}"
                raise self.bad(f"{self._named(name)} must be {bounds}, got {value}")
            return value

        return check

    def number(self, low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> Check:
        """A finite number in the interval from ``low`` to ``high``, each end closed unless said open."""
        def check(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self.bad(f"{self._named(name)} must be a finite number, got {show(value)}")
            if value < low or value > high or (low_open and value == low) or (high_open and value == high):
                bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"
                raise self.bad(f"{self._named(name)} must be in {bounds}, got {value}")
            return float(value)

        return check

    def choice(self, *options: str) -> Check:
        def check(name: str, value: Any) -> str:
            if value not in options:
                raise self.bad(f"{self._named(name)} must be one of {', '.join(map(repr, options))}, got {show(value)}")
            return str(value)

        return check

    def boolean(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.bad(f"{self._named(name)} must be true or false, got {show(value)}")
        return value

    def text(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.bad(f"{self._named(name)} must be a non-empty string, got {show(value)}")
        return value

    def fill(self, owner: str, table: Mapping[str, Param], given: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter of ``table`` (``owner``'s, e.g. a strategy's or a workload's name): the
        given ones checked, the others their defaults; an unknown or a missing required one raises."""
        unknown = sorted(str(key) for key in given if key not in table)
        if unknown:
            takes = f"it takes {', '.join(table)}" if table else "it takes no parameters"
            raise self.bad(f"unknown {self.noun or 'parameter'}(s) {', '.join(unknown)} for {owner}; {takes}")
        filled: dict[str, Any] = {}
        for key, param in table.items():
            if key in given:
                filled[key] = param.check(key, given[key])
            elif param.default is REQUIRED:
                raise self.bad(f"{owner} needs the parameter {key}")
            else:
                filled[key] = param.default
        return filled
