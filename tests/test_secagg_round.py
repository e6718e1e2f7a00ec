"""A secure round's stages as the server keeps them (lifl.secagg_round), driven by clients doing
real cryptography: the unmasked sum is exactly the survivors' plaintext sum with clients dropping
out at every stage; clients that skip a stage, replay or send malformed messages are refused;
too few clients at any stage abandons the round saying why."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from lifl import secagg
from lifl.errors import BadRequest, Conflict, LiflError
from lifl.secagg import KeyPair
from lifl.secagg_round import ABANDONED, ADVERTISE, COLLECT, DONE, SEALED_BYTES, SHARE, UNMASK, SecureRound, Settings

VECTOR = 257


@dataclass
class Client:
    """One client's side of a round (what the SDK's secure participant does), in the protocol's order."""

    name: str
    update: np.ndarray
    mask_keys: KeyPair = field(default_factory=KeyPair.generate)
    share_keys: KeyPair = field(default_factory=KeyPair.generate)
    self_seed: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    peers: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict)

    def advertise(self, server: SecureRound) -> None:
        server.advertise(self.name, self.mask_keys.public, self.share_keys.public)

    def share(self, server: SecureRound) -> None:
        self.peers = server.peers(self.name)
        points = [point for point, _, _ in self.peers.values()]
        selfs = secagg.split_secret(self.self_seed, points, server.params.threshold)
        keys = secagg.split_secret(self.mask_keys.private, points, server.params.threshold)
        server.share(self.name, {
            peer: secagg.seal_shares(self._share_key(server, share_public), self.name, peer, server.context,
                                     selfs[point], keys[point])
            for peer, (point, _, share_public) in self.peers.items()})

    def _share_key(self, server: SecureRound, public: bytes) -> bytes:
        return secagg.agree(self.share_keys.private, public, b"share", server.context)

    def masked_input(self, server: SecureRound, width: int) -> np.ndarray:
        sealed, peers = server.inbox(self.name)
        self.held = {p: secagg.open_shares(self._share_key(server, self.peers[p][2]), p, self.name, server.context, blob)
                     for p, blob in sealed.items()}
        pairs = {p: secagg.agree(self.mask_keys.private, self.peers[p][1], b"mask", server.context) for p in peers}
        masked = secagg.mask(self.update, self.name, self.self_seed, pairs, width)
        server.admit_masked(self.name)
        return masked

    def unmask(self, server: SecureRound) -> None:
        server.answer(self.name, secagg.answer_request(self.name, self.held, server.request))


def unmask_on_server(server: SecureRound, total: np.ndarray, width: int) -> np.ndarray:
    """What the top does once the round is done: rebuild the secrets, take the masks off."""
    self_seeds, dropped_keys = server.secrets()
    pairs = [(secagg.pair_sign(s, d), secagg.agree(private, server.keys[s][0], b"mask", server.context))
             for d, private in dropped_keys.items() for s in server.graph[d] if s in server.request.survivors]
    return secagg.unmask(total, list(self_seeds.values()), pairs, width)


def new_round(names: list[str], settings: Settings = Settings()) -> SecureRound:
    return SecureRound("job", 3, secrets.token_bytes(16), frozenset(names), settings)


def clients_of(names: list[str], width: int, rng: np.random.Generator) -> dict[str, Client]:
    dtype = secagg.WIDTHS[width]
    return {n: Client(n, rng.integers(0, np.iinfo(dtype).max, VECTOR, dtype=dtype, endpoint=True)) for n in names}


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("clients, drops", [
    (20, (0, 0, 0, 0)),
    (20, (2, 0, 0, 0)),  # 10 % never advertise
    (20, (0, 2, 0, 0)),  # 10 % advertise, then do not share
    (20, (0, 0, 2, 0)),  # 10 % share, then send no masked input
    (20, (0, 0, 0, 2)),  # 10 % send their masked input, then do not answer the unmask request
    (20, (0, 2, 2, 2)),  # 30 %: a tenth after each stage
    (30, (0, 0, 9, 0)),  # 30 % after sharing: their pair masks come off with their reconstructed keys
    (30, (0, 0, 0, 9)),
    (30, (0, 9, 0, 0)),
])
def test_the_unmasked_sum_is_exactly_the_survivors_plaintext_sum(clients: int, drops: tuple[int, ...], width: int) -> None:
    rng = np.random.default_rng(sum(drops) * 7 + width)
    names = [f"client-{i:03d}" for i in range(clients)]
    parties = clients_of(names, width, rng)
    order = list(names)
    rng.shuffle(order)
    cut = np.cumsum(drops)
    gone_at = {n: next((stage for stage, c in enumerate(cut) if i < c), None) for i, n in enumerate(order)}

    server = new_round(names, Settings(dropout=0.3, corruption=0.1, width=width))
    for n in names:
        if gone_at[n] is None or gone_at[n] > 0:
            parties[n].advertise(server)
    if server.stage == ADVERTISE:
        server.close_stage()  # the deadline: the silent ones are out
    assert server.stage == SHARE and len(server.keys) == clients - drops[0]
    for n in server.keys:
        if gone_at[n] is None or gone_at[n] > 1:
            parties[n].share(server)
    if server.stage == SHARE:
        server.close_stage()
    assert server.stage == COLLECT
    total = np.zeros(VECTOR, secagg.WIDTHS[width])
    survivors = []
    for n in sorted(server.shared):
        if gone_at[n] is None or gone_at[n] > 2:
            total += parties[n].masked_input(server, width)
            survivors.append(n)
    if server.stage == COLLECT:
        server.close_stage()
    assert server.stage == UNMASK and server.request.survivors == set(survivors)
    for n in survivors:
        if gone_at[n] is None and server.stage == UNMASK:  # done once every secret has its threshold of shares
            parties[n].unmask(server)
    if server.stage == UNMASK:
        server.close_stage()
    assert server.stage == DONE, server.why
    plain = sum((parties[n].update for n in survivors), np.zeros(VECTOR, secagg.WIDTHS[width]))
    np.testing.assert_array_equal(unmask_on_server(server, total, width), plain)


def run_to(stage: str, names: list[str], width: int = 64) -> tuple[SecureRound, dict[str, Client]]:
    """A round of ``names`` with everyone taking part, up to ``stage``."""
    parties = clients_of(names, width, np.random.default_rng(5))
    server = new_round(names, Settings(width=width))
    for step, action in ((SHARE, lambda c: c.advertise(server)), (COLLECT, lambda c: c.share(server)),
                         (UNMASK, lambda c: c.masked_input(server, width)), (DONE, lambda c: c.unmask(server))):
        if server.stage == stage:
            break
        current = server.stage
        for c in parties.values():
            if server.stage == current:  # the last stage ends once it has what it needs
                action(c)
        assert server.stage == step
    return server, parties


NAMES = [f"c{i}" for i in range(8)]


def _refusal(stage: str, act: Callable[[SecureRound, dict[str, Client]], object]) -> LiflError:
    server, parties = run_to(stage, NAMES)
    before = server.stage
    with pytest.raises(LiflError) as info:
        act(server, parties)
    assert server.stage == before  # a refused message changes nothing
    return info.value


@pytest.mark.parametrize("stage, act, code", [
    # replays
    (SHARE, lambda s, p: p["c0"].advertise(s), "wrong_stage"),  # its keys again, after the stage closed
    (COLLECT, lambda s, p: p["c0"].share(s), "wrong_stage"),
    (UNMASK, lambda s, p: s.admit_masked("c0"), "wrong_stage"),
    (DONE, lambda s, p: s.answer("c0", {}), "wrong_stage"),
    # a client that skips ahead, or was never enrolled
    (ADVERTISE, lambda s, p: s.share("c0", {}), "wrong_stage"),
    (ADVERTISE, lambda s, p: s.inbox("c0"), "wrong_stage"),
    (ADVERTISE, lambda s, p: s.admit_masked("c0"), "wrong_stage"),
    (ADVERTISE, lambda s, p: s.advertise("stranger", bytes(range(32)), bytes(range(1, 33))), "not_in_round"),
    # malformed keys
    (ADVERTISE, lambda s, p: s.advertise("c0", b"short", p["c0"].share_keys.public), "bad_key"),
    (ADVERTISE, lambda s, p: s.advertise("c0", p["c0"].mask_keys.public, p["c0"].mask_keys.public), "bad_key"),
    (ADVERTISE, lambda s, p: s.advertise("c0", p["c0"].mask_keys.public, "a string, not bytes"), "bad_key"),
    # malformed shares
    (SHARE, lambda s, p: s.share("c0", {}), "bad_shares"),
    (SHARE, lambda s, p: s.share("c0", {peer: b"x" * SEALED_BYTES for peer in s.graph["c0"][1:]}), "bad_shares"),
    (SHARE, lambda s, p: s.share("c0", {**{peer: b"x" * SEALED_BYTES for peer in s.graph["c0"]}, "c0": b"x" * SEALED_BYTES}),
     "bad_shares"),
    (SHARE, lambda s, p: s.share("c0", {peer: b"x" * (SEALED_BYTES - 1) for peer in s.graph["c0"]}), "bad_shares"),
    # unmask answers that would reveal or corrupt
    (UNMASK, lambda s, p: s.answer("c0", {s.graph["c0"][0]: (secagg.KIND_KEY, bytes(secagg.SHARE_BYTES))}), "bad_answer"),
    (UNMASK, lambda s, p: s.answer("c0", {"c0": (secagg.KIND_SELF, bytes(secagg.SHARE_BYTES))}), "bad_answer"),
    (UNMASK, lambda s, p: s.answer("c0", {s.graph["c0"][0]: (secagg.KIND_SELF, b"short")}), "bad_answer"),
])
def test_refused_messages(stage: str, act: Callable[[SecureRound, dict[str, Client]], object], code: str) -> None:
    assert _refusal(stage, act).code == code


def test_replays_within_a_stage_are_refused() -> None:
    server, parties = run_to(ADVERTISE, NAMES)
    parties["c0"].advertise(server)
    with pytest.raises(Conflict) as info:
        parties["c0"].advertise(server)
    assert info.value.code == "replayed"
    for c in list(parties.values())[1:]:
        c.advertise(server)
    parties["c0"].share(server)
    with pytest.raises(Conflict) as info:
        parties["c0"].share(server)
    assert info.value.code == "replayed"


def test_a_client_that_skipped_a_stage_cannot_join_a_later_one() -> None:
    parties = clients_of(NAMES, 64, np.random.default_rng(1))
    server = new_round(NAMES)
    for c in list(parties.values())[1:]:
        c.advertise(server)  # c0 never advertises
    server.close_stage()
    for name, act in (("c0", lambda: server.share("c0", {})), ("c0", lambda: server.peers("c0"))):
        with pytest.raises(Conflict) as info:
            act()
        assert info.value.code == "not_in_round"
    for c in list(parties.values())[2:]:
        c.share(server)  # c1 advertised but never shares
    server.close_stage()
    for act in (lambda: server.inbox("c1"), lambda: server.admit_masked("c1"), lambda: server.inbox("c0")):
        with pytest.raises(Conflict) as info:
            act()
        assert info.value.code == "not_in_round"
    for c in list(parties.values())[2:]:
        c.masked_input(server, 64)
    assert server.stage == UNMASK and server.request.dropped == frozenset()
    with pytest.raises(Conflict):
        server.answer("c1", {})


def test_an_advertised_key_cannot_be_another_clients() -> None:
    server, parties = run_to(ADVERTISE, NAMES)
    parties["c0"].advertise(server)
    with pytest.raises(BadRequest) as info:
        server.advertise("c1", parties["c0"].mask_keys.public, parties["c1"].share_keys.public)
    assert info.value.code == "bad_key"


@pytest.mark.parametrize("stage, keep, why", [
    (ADVERTISE, 2, "2 clients advertised their keys, fewer than the 3 needed"),
    (SHARE, 1, "1 clients shared their keys, fewer than the"),
    (COLLECT, 1, "1 clients sent masked inputs, fewer than the threshold"),
    (UNMASK, 1, "have fewer than"),
])
def test_too_few_clients_at_a_stage_abandons_the_round(stage: str, keep: int, why: str) -> None:
    """Only ``keep`` clients act at ``stage``; its deadline abandons the round, nothing to unmask."""
    names = NAMES
    server, parties = run_to(stage, names)
    acts = {ADVERTISE: lambda c: c.advertise(server), SHARE: lambda c: c.share(server),
            COLLECT: lambda c: c.masked_input(server, 64), UNMASK: lambda c: c.unmask(server)}
    for c in list(parties.values())[:keep]:
        acts[stage](c)
    server.close_stage()
    assert server.stage == ABANDONED and why in server.why
    with pytest.raises(Conflict):
        server.secrets()


def test_population_too_small_for_its_dropout_abandons_at_advertise() -> None:
    names = NAMES[:7]
    server = new_round(names, Settings(dropout=0.49, corruption=0.0))
    for c in clients_of(names, 64, np.random.default_rng(2)).values():
        c.advertise(server)
    assert server.stage == ABANDONED and "cannot tolerate 3 dropping out" in server.why
