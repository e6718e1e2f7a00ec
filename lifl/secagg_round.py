"""A secure round's stages as the server keeps them (SecAgg+, ``lifl.secagg``): what each
client may send at each stage, what the server answers, and when the round moves on or is
abandoned. Pure: no I/O, no clock (the caller says when a stage's deadline passed).

    advertise ─▶ share ─▶ collect ─▶ unmask ─▶ done
         └────────┴─────────┴──────────┴──▶ abandoned (why)

- **advertise**: each enrolled client sends its two public keys. At the deadline (or once every
  enrolled client did) the clients that advertised are the round's; the degree, threshold and
  graph are drawn for them.
- **share**: each of them sends, sealed, its shares for exactly its neighbours. At the deadline
  (or once all did) the clients that shared are the ones masked inputs may come from.
- **collect**: each of those fetches its sealed shares and the neighbours to mask with, and
  sends its masked input (the job's ordinary fixed-point update path counts it: ``masked``).
- **unmask**: the server asks the clients whose input is in the sum for one share per
  neighbour (``lifl.secagg.ShareRequest``) and keeps what arrives until every secret it needs
  has ``threshold`` shares.

A client that skipped a stage cannot join a later one; a message sent twice is refused as a
replay; fewer clients than the threshold at any stage, or a secret short of shares at the
unmask deadline, abandons the round saying which.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lifl import secagg
from lifl.errors import BadRequest, Conflict, Unprocessable

ADVERTISE, SHARE, COLLECT, UNMASK, DONE, ABANDONED = "advertise", "share", "collect", "unmask", "done", "abandoned"
SEALED_BYTES = secagg.NONCE_BYTES + 2 * secagg.SHARE_BYTES + 16  # nonce, two shares, the AEAD tag


@dataclass(frozen=True)
class Settings:
    """A secure job's choices (``"secure_aggregation": {...}``)."""

    dropout: float = 0.1
    corruption: float = 0.1
    width: int = 64


@dataclass
class SecureRound:
    job: str
    round_id: int
    seed: bytes  # the round's public randomness: the ring's order, and part of every derived secret
    enrolled: frozenset[str]
    settings: Settings = Settings()
    stage: str = ADVERTISE
    why: str = ""  # an abandoned round's reason
    keys: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # client -> (mask public, share public)
    params: secagg.Params | None = None
    graph: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)  # receiver -> sender -> sealed shares
    sharing: set[str] = field(default_factory=set)  # the clients whose shares arrived (share stage)
    shared: frozenset[str] = frozenset()  # those, once the share stage closed
    masked: set[str] = field(default_factory=set)
    request: secagg.ShareRequest | None = None
    shares: dict[str, dict[str, bytes]] = field(default_factory=dict)  # whose secret -> holder -> share
    answered: set[str] = field(default_factory=set)

    @property
    def context(self) -> bytes:
        return secagg.round_context(self.job, self.round_id, self.seed)

    # -- advertise ------------------------------------------------------------------------------------
    def advertise(self, client: str, mask_public: bytes, share_public: bytes) -> None:
        self._expect(ADVERTISE, client, self.enrolled, "enrolled in")
        if client in self.keys:
            raise Conflict(f"{client!r} advertised its keys already", code="replayed")
        for name, key in (("mask", mask_public), ("share", share_public)):
            if not isinstance(key, bytes) or len(key) != secagg.SEED_BYTES:
                raise BadRequest(f"{client!r}'s {name} public key must be {secagg.SEED_BYTES} bytes", code="bad_key")
        if mask_public == share_public:
            raise BadRequest(f"{client!r}'s two public keys must differ", code="bad_key")
        if any(mask_public in pair or share_public in pair for pair in self.keys.values()):
            raise BadRequest(f"{client!r} advertised another client's key", code="bad_key")
        self.keys[client] = (mask_public, share_public)
        if len(self.keys) == len(self.enrolled):
            self.close_stage()

    # -- share --------------------------------------------------------------------------------------------
    def share(self, client: str, sealed: Mapping[str, bytes]) -> None:
        """``client``'s sealed shares, one for each of its neighbours, no more, no fewer."""
        self._expect(SHARE, client, self.keys, "advertised in")
        if client in self.sharing:
            raise Conflict(f"{client!r} sent its shares already", code="replayed")
        wanted = set(self.graph[client])
        if set(sealed) != wanted:
            missing, extra = sorted(wanted - set(sealed)), sorted(set(sealed) - wanted)
            raise BadRequest(f"{client!r}'s shares must go to exactly its {len(wanted)} neighbours"
                             + (f"; missing {missing[:3]}" if missing else "") + (f"; not neighbours {extra[:3]}" if extra else ""),
                             code="bad_shares")
        for receiver, blob in sealed.items():
            if not isinstance(blob, bytes) or len(blob) != SEALED_BYTES:
                raise BadRequest(f"{client!r}'s sealed shares for {receiver!r} must be {SEALED_BYTES} bytes",
                                 code="bad_shares")
        for receiver, blob in sealed.items():
            self.sealed.setdefault(receiver, {})[client] = blob
        self.sharing.add(client)
        if self.sharing == set(self.keys):
            self.close_stage()

    def peers(self, client: str) -> dict[str, tuple[int, bytes, bytes]]:
        """What ``client`` needs to share its secrets: each neighbour's Shamir point and public
        keys (mask, share)."""
        self._expect(SHARE, client, self.keys, "advertised in")
        point = self.points()
        return {p: (point[p], *self.keys[p]) for p in self.graph[client]}

    # -- collect --------------------------------------------------------------------------------------------
    def inbox(self, client: str) -> tuple[dict[str, bytes], tuple[str, ...]]:
        """What ``client`` needs to mask its input: the sealed shares its neighbours sent it, and
        the neighbours to mask with (those that shared)."""
        self._expect(COLLECT, client, self.shared, "among the clients that shared in")
        peers = tuple(p for p in self.graph[client] if p in self.shared)
        return {p: self.sealed.get(client, {})[p] for p in peers}, peers

    def admit_masked(self, client: str) -> None:
        """A masked input from ``client`` may enter the sum (the caller then counts it once)."""
        self._expect(COLLECT, client, self.shared, "among the clients that shared in")
        if client in self.masked:
            raise Conflict(f"{client!r} sent its masked input already", code="replayed")
        self.masked.add(client)
        if self.masked == set(self.shared):
            self.close_stage()

    # -- unmask ------------------------------------------------------------------------------------------
    def answer(self, client: str, answer: Mapping[str, tuple[str, bytes]]) -> None:
        """``client``'s shares for the request: one per neighbour named in it, of the kind asked."""
        self._expect(UNMASK, client, self.masked, "a survivor of")
        if client in self.answered:
            raise Conflict(f"{client!r} answered already", code="replayed")
        assert self.request is not None
        wanted = {p for p in self.graph[client] if p in self.shared}
        for target, (kind, share) in answer.items():
            if target not in wanted:
                raise BadRequest(f"{client!r} holds no share of {target!r}", code="bad_answer")
            expected = secagg.KIND_SELF if target in self.request.survivors else secagg.KIND_KEY
            if kind != expected:
                raise BadRequest(f"{target!r} {'survived' if expected == secagg.KIND_SELF else 'dropped'}: its {expected} "
                                 f"share is asked, not its {kind!r} share", code="bad_answer")
            if not isinstance(share, bytes) or len(share) != secagg.SHARE_BYTES:
                raise BadRequest(f"{client!r}'s share of {target!r} must be {secagg.SHARE_BYTES} bytes", code="bad_answer")
        self.answered.add(client)
        for target, (_, share) in answer.items():
            self.shares.setdefault(target, {})[client] = share
        if not self.short_of_shares():
            self.stage = DONE

    def short_of_shares(self) -> list[str]:
        """The clients whose secret does not yet have ``threshold`` shares."""
        assert self.request is not None and self.params is not None
        needed = sorted(self.request.survivors | self.request.dropped)
        return [c for c in needed if len(self.shares.get(c, {})) < self.params.threshold]

    def secrets(self) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """(each survivor's self-mask seed, each dropped client's mask private key), rebuilt."""
        if self.stage != DONE:
            raise Conflict(f"the round is at {self.stage}, not done", code="wrong_stage")
        assert self.request is not None and self.params is not None
        point = self.points()

        def rebuild(client: str) -> bytes:
            return secagg.reconstruct({point[h]: s for h, s in self.shares[client].items()}, self.params.threshold)

        return ({c: rebuild(c) for c in sorted(self.request.survivors)},
                {c: rebuild(c) for c in sorted(self.request.dropped)})

    def points(self) -> dict[str, int]:
        """Each client's Shamir point: its place among the advertised clients, by name, from 1."""
        return {c: i + 1 for i, c in enumerate(sorted(self.keys))}

    # -- stages -------------------------------------------------------------------------------------------
    def close_stage(self) -> None:
        """The stage's deadline passed, or everyone it waits for answered: move on, or abandon."""
        if self.stage == ADVERTISE:
            self._enough(len(self.keys), secagg.MIN_CLIENTS, "advertised their keys")
            if self.stage == ABANDONED:
                return
            try:
                self.params = secagg.choose_params(len(self.keys), self.settings.dropout, self.settings.corruption)
            except Unprocessable as e:
                self._abandon(e.message)
                return
            self.graph = secagg.neighbours(sorted(self.keys), self.params.k, self.seed)
            self.stage = SHARE
        elif self.stage == SHARE:
            assert self.params is not None
            self.shared = frozenset(self.sharing)
            self._enough(len(self.shared), self.params.threshold, "shared their keys")
            if self.stage != ABANDONED:
                self.stage = COLLECT
        elif self.stage == COLLECT:
            assert self.params is not None
            try:
                self.request = secagg.share_request(sorted(self.shared), sorted(self.masked), self.params.threshold)
            except Unprocessable as e:
                self._abandon(e.message)
                return
            self.stage = UNMASK
        elif self.stage == UNMASK:
            short = self.short_of_shares()
            if short:
                self._abandon(f"{len(short)} secrets have fewer than {self.params.threshold} shares "  # type: ignore[union-attr]
                              f"(first {short[0]!r}): the sum cannot be unmasked")
            else:
                self.stage = DONE

    def _enough(self, count: int, needed: int, what: str) -> None:
        if count < needed:
            self._abandon(f"{count} clients {what}, fewer than the {needed} needed")

    def _abandon(self, why: str) -> None:
        self.stage, self.why = ABANDONED, why

    def _expect(self, stage: str, client: str, members: Iterable[str], what: str) -> None:
        if self.stage != stage:
            raise Conflict(f"the secure round is at its {self.stage} stage; {client!r} sent a {stage} message",
                           code="wrong_stage")
        if client not in members:
            raise Conflict(f"{client!r} is not {what} this round (a stage it skipped cannot be joined later)",
                           code="not_in_round")
