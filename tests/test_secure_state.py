"""A secure job's round stages in Redis (lifl.secure_state), against a real redis-server, driven
by clients doing real cryptography: the unmasked sum is exactly the survivors' plaintext sum with
clients dropping out after every stage; clients that skip a stage, replay or send malformed
messages are refused and change nothing; too few clients at any stage's deadline abandons the
round saying why; a new round of the job starts afresh."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from lifl import format as fmt
from lifl import secagg
from lifl.errors import BadRequest, Conflict, LiflError
from lifl.jobs import JobSpec
from lifl.client.secure import SecureClient
from lifl.fixedpoint import FixedPoint
from lifl.secagg_round import ABANDONED, ADVERTISE, COLLECT, CONSISTENCY, DONE, SEALED_BYTES, SHARE, UNMASK, Settings
from lifl.secure_state import SecureRounds
from lifl.state import (ACCEPT_CLOSED_ROUND, ACCEPT_COUNTED, ACCEPT_ROUND_CLOSED, CLOSE_FINAL, RESERVE_OK, ClusterState,
                        refusal)

VECTOR = 257
JOB = "j"
MODEL = fmt.ModelSpec((fmt.TensorSpec("w", fmt.F32, (257,)), fmt.TensorSpec("b", fmt.F32, (3,))))


class Client(SecureClient):
    """One client driving its side of a round against the stages in Redis, in the protocol's order."""

    def __init__(self, name: str, update: dict[str, np.ndarray], samples: int) -> None:
        super().__init__(name)
        self.update, self.samples = update, samples

    def advertise(self, server: Server) -> None:
        server.rounds.advertise(JOB, server.settings, server.goal, self.name, self.advertisement())

    def share(self, server: Server) -> None:
        r, peers = server.rounds.peers(JOB, self.name)
        server.rounds.share(JOB, server.settings, self.name, self.shares(r.context, r.threshold, peers))

    def send_input(self, server: Server) -> list[np.ndarray]:
        """Its masked input (as the segments the server sums), admitted and acknowledged by the
        job's round scripts as a node's would be."""
        r, inbox = server.rounds.inbox(JOB, self.name)
        blob = self.masked_input(r.context, inbox, self.update, self.samples, MODEL, server.fixed_point, server.goal)
        server.send_update(self.name)
        return secagg.segments(blob)

    def plain(self, server: Server) -> list[np.ndarray]:
        return secagg.segments(secagg.plain_input(self.update, self.samples, MODEL, server.fixed_point, server.goal))

    def sign(self, server: Server) -> None:
        r, request = server.rounds.request(JOB)
        server.rounds.sign(JOB, server.settings, self.name, self.signature(r.context, request.survivors))

    def send_answer(self, server: Server) -> None:
        r, request = server.rounds.request(JOB)
        server.rounds.answer(JOB, self.name, self.answer(r.context, request, server.rounds.signatures(r), r.signatures))


@dataclass
class Server:
    state: ClusterState
    rounds: SecureRounds
    settings: Settings
    goal: int

    @property
    def fixed_point(self) -> FixedPoint:
        return FixedPoint(16, self.settings.width)

    def send_update(self, client: str) -> None:
        """An update of ``client`` through the job's admission and acceptance scripts (as a node's)."""
        job = self.state.job(JOB)
        status, version, round_id = self.state.reserve(JOB, job.version, "a", client=client)
        if status != RESERVE_OK:
            raise refusal(status, JOB, version, round_id, self.goal)
        accepted, _ = self.state.accept(JOB, round_id, "a", client=client)
        assert accepted in (ACCEPT_COUNTED, ACCEPT_CLOSED_ROUND), accepted

    def stage(self) -> str:
        r = self.rounds.round(JOB)
        return r.stage if r else ADVERTISE

    def expire(self) -> str:
        """The stage's deadline passes (the duties run after it: the collect stage's closes the round)."""
        self.rounds.redis.hset(f"lifl:job:{JOB}:sa", "deadline", 0)
        r = self.rounds.close_due(JOB, self.settings)
        assert r is not None
        if r.stage == CONSISTENCY and not self.state.job(JOB).closed:
            assert self.state.close_round(JOB, r.round, r.threshold) == CLOSE_FINAL
        return r.stage

    def unmask(self, total: list[np.ndarray]) -> None:
        """What the top does once the round is done: rebuild the secrets, take the masks off."""
        r, self_seeds, dropped_keys = self.rounds.unmask_secrets(JOB)
        publics = {c: keys.mask for c, keys in self.rounds.keys(JOB).items()}
        secagg.add_masks(total, secagg.unmasking_seeds(self_seeds, dropped_keys, self.rounds.graph(r), publics, r.context))


def new_server(state: ClusterState, goal: int, settings: Settings = Settings()) -> Server:
    state.create_job(JobSpec(JOB, goal=goal, fixed_point={"frac_bits": 16, "width": settings.width},
                             secure_aggregation=settings.to_json()))
    state.next_round(JOB, -1, 0, key="00", node="a", spec=MODEL)
    return Server(state, SecureRounds(state), settings, goal)


def clients_of(names: list[str], rng: np.random.Generator) -> dict[str, Client]:
    return {n: Client(n, {"w": rng.standard_normal(VECTOR).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)},
                      int(rng.integers(1, 100))) for n in names}


def add(total: list[np.ndarray], segments: list[np.ndarray]) -> None:
    for t, s in zip(total, segments):
        t += s


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("clients, drops", [
    (20, (0, 0, 0, 0, 0)),
    (20, (2, 0, 0, 0, 0)),  # 10 % never advertise
    (20, (0, 2, 0, 0, 0)),  # 10 % advertise, then do not share
    (20, (0, 0, 2, 0, 0)),  # 10 % share, then send no masked input
    (20, (0, 0, 0, 2, 0)),  # 10 % send their masked input, then do not sign the survivor list
    (20, (0, 0, 0, 0, 2)),  # 10 % sign, then do not answer the unmask request
    (20, (0, 2, 2, 2, 0)),  # 30 %: a tenth after each stage
    (30, (0, 0, 9, 0, 0)),  # 30 % after sharing: their pair masks come off with their reconstructed keys
    (30, (0, 0, 0, 9, 0)),
    (30, (0, 0, 0, 0, 9)),
    (30, (0, 9, 0, 0, 0)),
])
def test_the_unmasked_sum_is_exactly_the_survivors_plaintext_sum(state: ClusterState, clients: int, drops: tuple[int, ...],
                                                                 width: int) -> None:
    rng = np.random.default_rng(sum(drops) * 7 + width)
    names = [f"client-{i:03d}" for i in range(clients)]
    parties = clients_of(names, rng)
    order = list(names)
    rng.shuffle(order)
    cut = np.cumsum(drops)
    gone_at = {n: next((stage for stage, c in enumerate(cut) if i < c), None) for i, n in enumerate(order)}
    server = new_server(state, clients, Settings(dropout=0.3, corruption=0.1, width=width))

    def stays(name: str, stage: int) -> bool:
        return gone_at[name] is None or gone_at[name] > stage

    for n in names:
        if stays(n, 0):
            parties[n].advertise(server)
    if server.stage() == ADVERTISE:
        assert server.expire() == SHARE  # the deadline: the silent ones are out
    assert len(server.rounds.keys(JOB)) == clients - drops[0]
    for n in server.rounds.keys(JOB):
        if stays(n, 1):
            parties[n].share(server)
    if server.stage() == SHARE:
        assert server.expire() == COLLECT
    total: list[np.ndarray] = []
    survivors = []
    for n in sorted(server.rounds.keys(JOB)):
        if stays(n, 1) and stays(n, 2):
            masked = parties[n].send_input(server)
            total = total or [np.zeros_like(x) for x in masked]
            add(total, masked)
            survivors.append(n)
    if server.stage() == COLLECT:
        assert server.expire() == CONSISTENCY
    assert server.rounds.request(JOB)[1].survivors == set(survivors)
    for n in survivors:
        if stays(n, 3):
            parties[n].sign(server)
    if server.stage() == CONSISTENCY:
        assert server.expire() == UNMASK
    for n in survivors:
        if gone_at[n] is None and server.stage() == UNMASK:  # done once every secret has its threshold of shares
            parties[n].send_answer(server)
    if server.stage() == UNMASK:
        server.expire()
    assert server.stage() == DONE, server.rounds.round(JOB).why
    plain = [np.zeros_like(x) for x in total]
    for n in survivors:
        add(plain, parties[n].plain(server))
    server.unmask(total)
    for got, want in zip(total, plain):
        np.testing.assert_array_equal(got, want)
    assert int(total[-1][0]) == sum(parties[n].samples for n in survivors)  # the round's sample count, unmasked


NAMES = [f"c{i}" for i in range(8)]
ACTS: dict[str, Callable[[Client, Server], object]] = {
    ADVERTISE: lambda c, s: c.advertise(s), SHARE: lambda c, s: c.share(s), COLLECT: lambda c, s: c.send_input(s),
    CONSISTENCY: lambda c, s: c.sign(s), UNMASK: lambda c, s: c.send_answer(s)}
FOLLOWING = {ADVERTISE: SHARE, SHARE: COLLECT, COLLECT: CONSISTENCY, CONSISTENCY: UNMASK, UNMASK: DONE}


def run_to(state: ClusterState, stage: str, names: list[str] = NAMES) -> tuple[Server, dict[str, Client]]:
    """A round of ``names`` with everyone taking part, up to ``stage``."""
    parties = clients_of(names, np.random.default_rng(5))
    server = new_server(state, len(names))
    current = ADVERTISE
    while current != stage:
        for c in parties.values():
            if server.stage() == current:  # the last stage ends once it has what it needs
                ACTS[current](c, server)
        current = FOLLOWING[current]
        assert server.stage() == current
    return server, parties


@pytest.mark.parametrize("stage, act, code", [
    # replays, once the stage moved on
    (SHARE, lambda s, p: p["c0"].advertise(s), "wrong_stage"),
    (COLLECT, lambda s, p: p["c0"].share(s), "wrong_stage"),
    (UNMASK, lambda s, p: s.send_update("c0"), "already_acknowledged"),  # its masked input is in the sum
    (DONE, lambda s, p: s.rounds.answer(JOB, "c0", {}), "wrong_stage"),
    # a client that skips ahead
    (ADVERTISE, lambda s, p: s.rounds.share(JOB, s.settings, "c0", {}), "wrong_stage"),
    (ADVERTISE, lambda s, p: s.rounds.inbox(JOB, "c0"), "wrong_stage"),
    (ADVERTISE, lambda s, p: s.send_update("c0"), "wrong_stage"),
    (SHARE, lambda s, p: s.send_update("c0"), "wrong_stage"),
    # a stranger
    (SHARE, lambda s, p: s.rounds.peers(JOB, "stranger"), "not_in_round"),
    (COLLECT, lambda s, p: s.rounds.inbox(JOB, "stranger"), "not_in_round"),
    (COLLECT, lambda s, p: s.send_update("stranger"), "not_in_round"),
    (COLLECT, lambda s, p: s.send_update(""), "client_required"),
    # malformed keys
    (ADVERTISE, lambda s, p: s.rounds.advertise(JOB, s.settings, 8, "c0", p["c0"].advertisement()._replace(mask=b"short")),
     "bad_key"),
    (ADVERTISE, lambda s, p: s.rounds.advertise(JOB, s.settings, 8, "c0", p["c0"].advertisement()._replace(
        share=p["c0"].mask_keys.public)), "bad_key"),
    (ADVERTISE, lambda s, p: s.rounds.advertise(JOB, s.settings, 8, "c0", p["c0"].advertisement()._replace(
        signing=p["c0"].share_keys.public)), "bad_key"),
    (ADVERTISE, lambda s, p: s.rounds.advertise(JOB, s.settings, 8, "c0", p["c0"].advertisement()._replace(
        signing="not bytes")), "bad_key"),
    # signatures of the survivor list: a stranger's, forged, of another list, another's, early
    (CONSISTENCY, lambda s, p: s.rounds.sign(JOB, s.settings, "stranger", bytes(secagg.SIGNATURE_BYTES)), "not_in_round"),
    (CONSISTENCY, lambda s, p: s.rounds.sign(JOB, s.settings, "c0", bytes(secagg.SIGNATURE_BYTES)), "bad_signature"),
    (CONSISTENCY, lambda s, p: s.rounds.sign(JOB, s.settings, "c0", b"short"), "bad_signature"),
    (CONSISTENCY, lambda s, p: s.rounds.sign(JOB, s.settings, "c0", p["c0"].signing_key.sign(
        s.rounds.round(JOB).context, frozenset(NAMES[1:]))), "bad_signature"),
    (CONSISTENCY, lambda s, p: s.rounds.sign(JOB, s.settings, "c0", p["c1"].signing_key.sign(
        s.rounds.round(JOB).context, frozenset(NAMES))), "bad_signature"),
    (COLLECT, lambda s, p: s.rounds.sign(JOB, s.settings, "c0", bytes(secagg.SIGNATURE_BYTES)), "wrong_stage"),
    (UNMASK, lambda s, p: p["c0"].sign(s), "wrong_stage"),
    # malformed shares
    (SHARE, lambda s, p: s.rounds.share(JOB, s.settings, "c0", {}), "bad_shares"),
    (SHARE, lambda s, p: s.rounds.share(JOB, s.settings, "c0", {q: b"x" * SEALED_BYTES for q in graph_of(s, "c0")[1:]}),
     "bad_shares"),
    (SHARE, lambda s, p: s.rounds.share(JOB, s.settings, "c0", {**{q: b"x" * SEALED_BYTES for q in graph_of(s, "c0")},
                                                                 "c0": b"x" * SEALED_BYTES}), "bad_shares"),
    (SHARE, lambda s, p: s.rounds.share(JOB, s.settings, "c0", {q: b"x" * (SEALED_BYTES - 1) for q in graph_of(s, "c0")}),
     "bad_shares"),
    # unmask answers that would reveal or corrupt
    (UNMASK, lambda s, p: s.rounds.answer(JOB, "c0", {graph_of(s, "c0")[0]: (secagg.KIND_KEY, bytes(secagg.SHARE_BYTES))}),
     "bad_answer"),
    (UNMASK, lambda s, p: s.rounds.answer(JOB, "c0", {"c0": (secagg.KIND_SELF, bytes(secagg.SHARE_BYTES))}), "bad_answer"),
    (UNMASK, lambda s, p: s.rounds.answer(JOB, "c0", {graph_of(s, "c0")[0]: (secagg.KIND_SELF, b"short")}), "bad_answer"),
])
def test_refused_messages_change_nothing(state: ClusterState, stage: str, act: Callable[[Server, dict[str, Client]], object],
                                        code: str) -> None:
    server, parties = run_to(state, stage)
    before = server.rounds.round(JOB)
    with pytest.raises(LiflError) as info:
        act(server, parties)
    assert info.value.code == code
    assert server.rounds.round(JOB) == before


def graph_of(server: Server, client: str) -> tuple[str, ...]:
    return server.rounds.graph(server.rounds.round(JOB))[client]


def test_replays_within_a_stage_are_refused(state: ClusterState) -> None:
    """Each stage's message sent again by a client, while the stage still waits for the others."""
    server, parties = run_to(state, ADVERTISE)
    for stage, again, code in ((ADVERTISE, lambda: parties["c0"].advertise(server), "replayed"),
                               (SHARE, lambda: parties["c0"].share(server), "replayed"),
                               (COLLECT, lambda: server.send_update("c0"), "already_acknowledged"),
                               (CONSISTENCY, lambda: parties["c0"].sign(server), "replayed")):
        ACTS[stage](parties["c0"], server)
        with pytest.raises(Conflict) as info:
            again()
        assert info.value.code == code
        for c in list(parties.values())[1:]:
            ACTS[stage](c, server)


def test_a_client_that_skipped_a_stage_cannot_join_a_later_one(state: ClusterState) -> None:
    parties = clients_of(NAMES, np.random.default_rng(1))
    server = new_server(state, len(NAMES))
    for c in list(parties.values())[1:]:
        c.advertise(server)  # c0 never advertises
    assert server.expire() == SHARE
    for act in (lambda: server.rounds.share(JOB, server.settings, "c0", {}), lambda: server.rounds.peers(JOB, "c0")):
        with pytest.raises(Conflict) as info:
            act()
        assert info.value.code == "not_in_round"
    for c in list(parties.values())[2:]:
        c.share(server)  # c1 advertised but never shares
    assert server.expire() == COLLECT
    for act in (lambda: server.rounds.inbox(JOB, "c1"), lambda: server.send_update("c1"), lambda: server.rounds.inbox(JOB, "c0")):
        with pytest.raises(Conflict) as info:
            act()
        assert info.value.code == "not_in_round"
    for c in list(parties.values())[2:]:
        c.send_input(server)
    assert server.stage() == CONSISTENCY and server.rounds.request(JOB)[1].dropped == frozenset()
    r, request = server.rounds.request(JOB)
    with pytest.raises(Conflict) as info:
        server.rounds.sign(JOB, server.settings, "c1", parties["c1"].signing_key.sign(r.context, request.survivors))
    assert info.value.code == "not_in_round"
    for c in list(parties.values())[3:]:
        c.sign(server)  # c2 sent its input but never signs
    assert server.expire() == UNMASK
    for name in ("c1", "c2"):
        with pytest.raises(Conflict) as info:
            server.rounds.answer(JOB, name, {})
        assert info.value.code == "not_in_round"


def test_a_round_enrols_at_most_its_goal_and_no_key_twice(state: ClusterState) -> None:
    server = new_server(state, 4)
    parties = clients_of([f"c{i}" for i in range(5)], np.random.default_rng(3))
    parties["c0"].advertise(server)
    with pytest.raises(BadRequest) as info:
        server.rounds.advertise(JOB, server.settings, 4, "c1", parties["c1"].advertisement()._replace(
            signing=parties["c0"].signing_key.public))
    assert info.value.code == "key_taken"
    for name in ("c1", "c2", "c3"):
        parties[name].advertise(server)
    assert server.stage() == SHARE
    with pytest.raises(Conflict) as info:
        parties["c4"].advertise(server)
    assert info.value.code == "wrong_stage"


@pytest.mark.parametrize("stage, keep, why", [
    (ADVERTISE, 2, "at least 3 clients"),
    (SHARE, 1, "1 clients shared their keys, fewer than the threshold"),
    (COLLECT, 1, "1 clients sent masked inputs, fewer than the threshold"),
    (COLLECT, 4, "4 clients sent masked inputs, fewer than the 5 signatures the consistency check needs"),
    (CONSISTENCY, 4, "4 survivors signed the survivor list, fewer than the 5 the consistency check needs"),
    (UNMASK, 1, "have fewer than"),
])
def test_too_few_clients_at_a_stage_abandons_the_round(state: ClusterState, stage: str, keep: int, why: str) -> None:
    """Only ``keep`` clients act at ``stage``; its deadline abandons the round, nothing to unmask."""
    server, parties = run_to(state, stage)
    for c in list(parties.values())[:keep]:
        ACTS[stage](c, server)
    assert server.expire() == ABANDONED
    assert why in server.rounds.round(JOB).why
    with pytest.raises(Conflict):
        server.rounds.unmask_secrets(JOB)


def test_the_next_round_of_the_job_starts_afresh(state: ClusterState) -> None:
    server, parties = run_to(state, DONE)
    first = server.rounds.round(JOB)
    state.next_round(JOB, 0, 1)
    parties["c0"].advertise(server)
    second = server.rounds.round(JOB)
    assert (second.round, second.stage, len(server.rounds.keys(JOB))) == (1, ADVERTISE, 1) and second.seed != first.seed


def test_an_input_acknowledged_after_the_collect_deadline_stays_out_of_the_sum(state: ClusterState) -> None:
    """Admitted while the round collected, but its upload ended after the deadline moved the stage
    on: the acceptance refuses it, so the sum holds exactly the inputs the unmask request names."""
    server, parties = run_to(state, COLLECT)
    names = sorted(parties)
    for name in names[:-1]:
        parties[name].send_input(server)
    late = names[-1]
    status, _, round_id = state.reserve(JOB, state.job(JOB).version, "a", client=late)
    assert status == RESERVE_OK
    assert server.expire() == CONSISTENCY
    assert state.accept(JOB, round_id, "a", client=late)[0] == ACCEPT_ROUND_CLOSED
    assert server.rounds.request(JOB)[1].survivors == set(names[:-1]) and state.job(JOB).accepted == len(names) - 1
