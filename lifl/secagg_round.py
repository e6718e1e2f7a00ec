"""A secure round's stages (SecAgg+, ``lifl.secagg``): what each client may send at each
stage, and when the round moves on or is abandoned; ``lifl.secure_state`` keeps them in Redis.

    advertise ─▶ share ─▶ collect ─▶ unmask ─▶ done
         └────────┴─────────┴──────────┴──▶ abandoned (why)

- **advertise**: clients send their two public keys, up to the job's goal of them. At the
  deadline (or once the goal did) the clients that advertised are the round's; the degree,
  threshold and graph are drawn for them.
- **share**: each of them sends, sealed, its shares for exactly its neighbours. At the deadline
  (or once all did) the clients that shared are the ones masked inputs may come from.
- **collect**: each of those fetches its sealed shares and the neighbours to mask with, and
  sends its masked input (the job's ordinary update path, in the layout of a fixed-point partial
  sum, ``lifl.secagg.plain_input``).
- **unmask**: the server asks the clients whose input is in the sum for one share per
  neighbour (``lifl.secagg.ShareRequest``) and keeps what arrives until every secret it needs
  has ``threshold`` shares.

A client that skipped a stage cannot join a later one; a message sent twice is refused as a
replay; fewer clients than the threshold at any stage, or a secret short of shares at the
unmask deadline, abandons the round saying which.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lifl import secagg
from lifl.errors import BadRequest

ADVERTISE, SHARE, COLLECT, UNMASK, DONE, ABANDONED = "advertise", "share", "collect", "unmask", "done", "abandoned"
STAGES = (ADVERTISE, SHARE, COLLECT, UNMASK, DONE, ABANDONED)
SEALED_BYTES = secagg.NONCE_BYTES + 2 * secagg.SHARE_BYTES + 16  # nonce, two shares, the AEAD tag


MAX_STAGE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Settings:
    """A secure job's choices (the job field ``"secure_aggregation": {...}``): the fractions of
    a round's clients that may drop out and that may be corrupt (they size the graph and the
    threshold, ``lifl.secagg.choose_params``), and how long each stage waits for its clients.
    ``width`` is the job's fixed-point width (masks are integers modulo 2^width)."""

    dropout: float = 0.1
    corruption: float = 0.1
    stage_timeout_s: float = 60.0
    width: int = 64

    @classmethod
    def from_request(cls, obj: Any, *, width: int) -> Settings:
        if not isinstance(obj, Mapping):
            raise BadRequest(f"secure_aggregation must be an object, got {reprlib.repr(obj)}", code="bad_secure_aggregation")
        unknown = sorted(set(obj) - {"dropout", "corruption", "stage_timeout_s"})
        if unknown:
            raise BadRequest(f"unknown secure_aggregation field(s): {', '.join(map(str, unknown))}", code="bad_secure_aggregation")
        values: dict[str, float] = {}
        for name, low, high, high_open in (("dropout", 0.0, 0.5, True), ("corruption", 0.0, 0.5, True),
                                           ("stage_timeout_s", 0.0, MAX_STAGE_TIMEOUT_S, False)):
            if name not in obj:
                continue
            value = obj[name]
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not (low <= value < high if high_open else low < value <= high)):
                span = f"[{low:g}, {high:g})" if high_open else f"({low:g}, {high:g}]"
                raise BadRequest(f"secure_aggregation's {name} must be a number in {span}, got {reprlib.repr(value)}",
                                 code="bad_secure_aggregation")
            values[name] = float(value)
        return cls(width=width, **values)

    def to_json(self) -> dict[str, float]:
        return {"dropout": self.dropout, "corruption": self.corruption, "stage_timeout_s": self.stage_timeout_s}
