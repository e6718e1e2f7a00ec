"""Tenant quotas: what one tenant may hold, set by the operator (``PUT /v1/tenants/{t}/quota``,
``lifl quota set``, or an FLJob namespace's ``lifl.dev/quota-*`` annotations).

- ``jobs``: jobs of the tenant (a job lives until deleted: refused at creation);
- ``tokens``: live tenant and client tokens (refused at issue);
- ``rounds``: jobs with a round in progress at once, counted from a round's first admitted
  update to its end (an update that would open one more is refused, to retry later);
- ``shm_bytes``: shared memory on any one node: the tenant's models, its rounds' objects and
  reservations (an update past it is refused, to retry later; models past it spill to the
  checkpoint store);
- ``retained_bytes``: updates kept for queries on any one node (the oldest go first past it).

A tenant without a quota of its own has ``Quota()``: the defaults below. ``None`` is no limit
of its own (the node's capacity and the fair shares still apply). Refusals name the quota:
``QuotaExceeded`` (HTTP 403) for what only freeing or a higher quota changes, ``QuotaBusy``
(HTTP 429 with Retry-After) for what ends by itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from lifl.errors import BadRequest

DEFAULT_JOBS = 1000
DEFAULT_TOKENS = 10_000
DEFAULT_ROUNDS = 100
MAX_COUNT = 1_000_000  # the largest jobs, tokens or rounds quota
MAX_BYTES = 1 << 50  # the largest bytes quota (1 PiB)
ANNOTATION_PREFIX = "lifl.dev/quota-"  # lifl.dev/quota-jobs: "20", lifl.dev/quota-shm-bytes: "256Mi"
COUNTS = ("jobs", "tokens", "rounds")
BYTES = ("shm_bytes", "retained_bytes")
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


@dataclass(frozen=True)
class Quota:
    jobs: int | None = DEFAULT_JOBS
    tokens: int | None = DEFAULT_TOKENS
    rounds: int | None = DEFAULT_ROUNDS
    shm_bytes: int | None = None
    retained_bytes: int | None = None

    def limit(self, name: str) -> int | None:
        return getattr(self, name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Quota:
        return cls.from_request(json.loads(text))

    @classmethod
    def from_request(cls, body: Any) -> Quota:
        """A quota from a JSON object: each field a whole number in range or null (no limit of
        its own); a field left out takes its default."""
        if not isinstance(body, dict):
            raise BadRequest("a quota must be a JSON object", code="bad_quota")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise BadRequest(f"unknown quota field(s): {', '.join(unknown)}; known: {', '.join(known)}",
                             code="bad_quota")
        return replace(cls(), **{name: _checked(name, value) for name, value in body.items()})

    @classmethod
    def from_annotations(cls, annotations: dict[str, str]) -> Quota | None:
        """The quota a namespace's ``lifl.dev/quota-<field>`` annotations set (``-`` for ``_``;
        bytes may carry a Kubernetes suffix: 512Mi, 2G; ``none``: no limit), or None if it sets
        none."""
        given: dict[str, Any] = {}
        for key, text in annotations.items():
            if key.startswith(ANNOTATION_PREFIX):
                name = key[len(ANNOTATION_PREFIX):].replace("-", "_")
                given[name] = parse_limit(name, text, f"annotation {key}")
        return cls.from_request(given) if given else None


def _checked(name: str, value: Any) -> int | None:
    if value is None:
        return None
    high = MAX_BYTES if name in BYTES else MAX_COUNT
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise BadRequest(f"quota {name!r} must be a whole number from 0 to {high}, or null for no limit; got {value!r}",
                         code="bad_quota")
    return value


def parse_limit(name: str, text: str, where: str) -> int | None:
    """A limit written by an operator (an annotation, a command-line flag): a whole number, bytes
    with an optional suffix, or ``none``."""
    text = text.strip()
    if text == "none":
        return None
    number = text.rstrip("kKMGTi")
    unit = text[len(number):]
    if not number.isdecimal() or unit not in _UNITS or (unit and name not in BYTES):
        raise BadRequest(f"{where}: {text!r} is not a whole number"
                         f"{' (with an optional suffix: k, M, G, T, Ki, Mi, Gi, Ti)' if name in BYTES else ''} or 'none'",
                         code="bad_quota")
    return int(number) * _UNITS[unit]
