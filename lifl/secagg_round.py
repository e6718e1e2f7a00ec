"""A secure round's stages (SecAgg+, ``lifl.secagg``): what each client may send at each
stage, and when the round moves on or is abandoned; ``lifl.secure_state`` keeps them in Redis.

    advertise ─▶ share ─▶ collect ─▶ consistency ─▶ unmask ─▶ done
         └────────┴─────────┴────────────┴────────────┴──▶ abandoned (why)

- **advertise**: clients send their three public keys, up to the job's goal of them. At the
  deadline (or once the goal did) the clients that advertised are the round's; the degree,
  threshold, signature count and graph are drawn for them.
- **share**: each of them sends, sealed, its shares for exactly its neighbours. At the deadline
  (or once all did) the clients that shared are the ones masked inputs may come from.
- **collect**: each of those fetches its sealed shares and the neighbours to mask with, and
  sends its masked input (the job's ordinary update path, in the layout of a fixed-point partial
  sum, ``lifl.secagg.plain_input``).
- **consistency**: the clients whose input is in the sum (the survivors) sign the list of
  them; the server checks each signature. At the deadline (or once all did) the signers are
  the clients that may answer, if there are at least as many as the check needs.
- **unmask**: the server asks the signers, with the signatures they need to see
  (``lifl.secagg.check_consistency``), for one share per neighbour (``lifl.secagg.ShareRequest``) and keeps what arrives until every secret it needs
  has ``threshold`` shares; then each task that summed up masked inputs takes its own clients'
  masks off its sum (``MaskedInputs``, ``RoundSecrets``).

A client that skipped a stage cannot join a later one; a message sent twice is refused as a
replay; fewer clients than the threshold at any stage, or a secret short of shares at the
unmask deadline, abandons the round saying which.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lifl import secagg
from lifl.errors import BadRequest, Conflict

ADVERTISE, SHARE, COLLECT, CONSISTENCY, UNMASK = "advertise", "share", "collect", "consistency", "unmask"
DONE, ABANDONED = "done", "abandoned"
STAGES = (ADVERTISE, SHARE, COLLECT, CONSISTENCY, UNMASK, DONE, ABANDONED)
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


class MaskedInputs:
    """A node's record of one secure round's masked inputs: whose each object is (told as the
    node accepts it) and whose inputs each task summed up (told as it folds them). Every task
    takes off the masks of exactly the clients whose inputs it folded (``streams_of``), so each
    survivor's streams are taken off once however the round's hierarchy is cut, and the PRG
    expansions are spread over the round's leaves, on whichever nodes they run."""

    def __init__(self) -> None:
        self._owners: dict[bytes, str] = {}  # a masked input not folded yet -> its client
        self._folded: dict[int, set[str]] = {}  # task -> the clients whose inputs it summed up

    def submitted(self, key: bytes, client: str) -> None:
        if not client:
            raise BadRequest("a masked input names its client", code="bad_secure_input")
        self._owners[key] = client

    def folded(self, task: int, keys: Iterable[bytes]) -> None:
        """``task`` summed up ``keys`` (partial sums, of no client, among them)."""
        for key in keys:
            client = self._owners.pop(key, None)
            if client is not None:
                self._folded.setdefault(task, set()).add(client)

    def clients(self, task: int, held: Iterable[bytes] = ()) -> frozenset[str]:
        """The clients whose inputs ``task`` summed up, and those of ``held`` (the masked inputs
        it holds unfolded: a lone input, passed on whole)."""
        lone = set()
        for key in held:
            if key not in self._owners:
                raise BadRequest(f"object {key.hex()} is not a masked input of the round", code="bad_secure_input")
            lone.add(self._owners[key])
        return frozenset(self._folded.get(task, set()) | lone)


@dataclass(frozen=True)
class RoundSecrets:
    """A done round's secrets, rebuilt from the survivors' answers: each survivor's self-mask
    seed, each dropped client's mask private key, and what pairs them (the graph, the clients'
    mask public keys, the round's context)."""

    round: int
    self_seeds: Mapping[str, bytes]
    dropped_keys: Mapping[str, bytes]
    graph: Mapping[str, Sequence[str]]
    mask_publics: Mapping[str, bytes]
    context: bytes

    def streams_of(self, clients: frozenset[str]) -> list[tuple[int, bytes]]:
        """What takes the masks of ``clients``' inputs off a sum of them (``lifl.secagg.unmasking_seeds``
        for those survivors alone). A client whose input the round does not unmask is refused:
        the sum would stay masked."""
        strangers = sorted(clients - set(self.self_seeds))
        if strangers:
            raise Conflict(f"{strangers[0]!r}'s input was summed up, but it is not one of the round's survivors",
                           code="not_a_survivor")
        mine = {c: seed for c, seed in self.self_seeds.items() if c in clients}
        return secagg.unmasking_seeds(mine, self.dropped_keys, self.graph, self.mask_publics, self.context)
