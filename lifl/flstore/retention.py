"""Retention policies: which of a job's models and client updates stay where its queries run.

FLStore's finding is that non-training workloads (filtering, similarity, clustering,
provenance, inference) are bound by moving updates to compute; lifl already has every update
of a round in shared memory, so a policy keeps them there after the round instead of recycling
them. A policy is chosen at job creation (``"retention"``) and changed at run time
(``PUT /v1/jobs/{job}/retention``):

- ``models``: the global models of the last K versions stay in memory (inference, provenance);
- ``updates``: every client update of the last K rounds stays in memory (filter, cosine,
  cluster, reputation);
- ``clients`` + ``client_rounds``: the updates of these clients over their last K rounds
  (debugging one client, its reputation);
- ``history``: rounds whose updates (and the models around them) stay *queryable* at all.
  Everything retained is written behind to the job's checkpoint store; what the memory policy
  or the tenant's byte budget drops from memory is fetched back on a miss (slower, never an
  error). An update older than ``max(history, updates, client_rounds)`` rounds is gone: queries
  for it are refused with ``not_retained``.

Pure: no I/O. The node's side (``lifl.node.retention``) applies these decisions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from lifl.errors import BadRequest

MAX_KEEP = 1000  # rounds or versions any one field may ask for
MAX_SELECTED_CLIENTS = 1024
MAX_CLIENT_ID = 256


@dataclass(frozen=True)
class RetentionPolicy:
    models: int = 0
    updates: int = 0
    clients: tuple[str, ...] = ()
    client_rounds: int = 0
    history: int = 0

    @property
    def update_rounds(self) -> int:
        """Rounds whose updates a query may read (from memory or the store); models alone keep none."""
        return max(self.history, self.updates, self.client_rounds if self.clients else 0)

    @property
    def version_window(self) -> int:
        """How many versions back a query may read a model: the bases and results of the
        queryable rounds, and the last ``models`` versions (age 0 is the current one)."""
        return max(self.update_rounds, self.models - 1)

    @property
    def active(self) -> bool:
        return self.update_rounds > 0 or self.models > 0

    def keeps_update(self, client: str) -> bool:
        """Whether a client's accepted update is retained (and written behind) at all."""
        return bool(self.history or self.updates) or client in self.clients

    @classmethod
    def from_request(cls, body: Any) -> RetentionPolicy:
        if body is None:
            return cls()
        if not isinstance(body, dict):
            raise BadRequest("retention must be a JSON object", code="bad_retention")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise BadRequest(f"unknown retention field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                             code="bad_retention")
        values: dict[str, Any] = {}
        for name in ("models", "updates", "client_rounds", "history"):
            if name in body:
                v = body[name]
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_KEEP:
                    raise BadRequest(f"retention field {name!r} must be an integer in [0, {MAX_KEEP}]", code="bad_retention")
                values[name] = v
        if "clients" in body:
            clients = body["clients"]
            if not isinstance(clients, list) or len(clients) > MAX_SELECTED_CLIENTS:
                raise BadRequest(f"retention field 'clients' must be a list of at most {MAX_SELECTED_CLIENTS} client ids",
                                 code="bad_retention")
            for c in clients:
                if not isinstance(c, str) or not 0 < len(c) <= MAX_CLIENT_ID or not c.isprintable() or " " in c:
                    raise BadRequest(f"retention client {c!r} is not a client id (1-{MAX_CLIENT_ID} printable "
                                     "characters, no spaces)", code="bad_retention")
            values["clients"] = tuple(dict.fromkeys(clients))
        policy = cls(**values)
        if policy.clients and not policy.client_rounds:
            raise BadRequest("retention field 'clients' needs 'client_rounds' (how many of their rounds to keep)",
                             code="bad_retention")
        return policy

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["clients"] = list(self.clients)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RetentionPolicy:
        return cls.from_request(json.loads(text))


MODEL, UPDATE = "model", "update"


@dataclass(frozen=True)
class Held:
    """Something a node retains, as the policy sees it."""

    kind: str  # MODEL or UPDATE
    index: int  # a model's version; an update's round
    client: str = ""  # an update's client


def in_memory(policy: RetentionPolicy, held: Held, newest_round: int, newest_version: int) -> bool:
    """Whether the policy keeps it in shared memory (``newest_round``: the job's latest round
    with retained updates; ``newest_version``: its current model)."""
    if held.kind == MODEL:
        return newest_version - held.index < policy.models
    age = newest_round - held.index
    return age < policy.updates or (held.client in policy.clients and age < policy.client_rounds)


def round_queryable(policy: RetentionPolicy, round_id: int, newest_round: int) -> bool:
    """Whether the updates of ``round_id`` may be used at all (from memory or the store)."""
    return round_id > newest_round or newest_round - round_id < policy.update_rounds


def version_queryable(policy: RetentionPolicy, version: int, newest_version: int) -> bool:
    """Whether model ``version`` may be used: the models of queryable rounds (their bases and
    results) and the last ``models`` versions."""
    return 0 <= newest_version - version <= policy.version_window


def checkpoints_kept(policy: RetentionPolicy, default: int) -> int:
    """Model versions the checkpoint store keeps for a job: those a query may use."""
    return max(default, policy.version_window + 1)


def lru_victims(sizes_by_age: list[tuple[float, int, Any]], budget: int) -> list[Any]:
    """What to drop so the rest fits ``budget`` bytes: least recently used first.
    ``sizes_by_age``: (last use, size, item) of everything held."""
    total = sum(size for _, size, _ in sizes_by_age)
    victims: list[Any] = []
    for _, size, item in sorted(sizes_by_age, key=lambda t: t[0]):
        if total <= budget:
            break
        victims.append(item)
        total -= size
    return victims
