"""Secure aggregation on a real node (docs/secure-aggregation.md): clients run every stage of a
secure round with the SDK (Participant(secure=True)), their updates leave them masked, and the
model installed is bit for bit the one a plain fixed-point round of the same updates installs;
with clients dropping out after sharing, the survivors' model; what the node holds of an update
is never the update."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import RunningNode, outcomes_in_threads, wait_for
from lifl import format as fmt
from lifl import secagg
from lifl.client import Gateway, Participant
from lifl.client.secure import SecureClient, clip_change, context_of, share_with_peers
from lifl.errors import BadRequest, Conflict
from lifl.fixedpoint import FixedPoint
from lifl.kernels import validate
from lifl.protocol import GetRecent, Hello
from lifl.rpc import Client
from lifl.secure_state import SecureRounds

pytestmark = pytest.mark.slow

SHAPES = {"w": (33, 17), "b": (17,)}
FIXED_POINT = {"frac_bits": 20, "width": 64}


def updates(n: int, seed: int = 5) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    rng = np.random.default_rng(seed)
    return ([{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)],
            [int(c) for c in rng.integers(1, 200, n)])


def model_of(gw: Gateway, job: str) -> dict[str, np.ndarray]:
    blob = bytes(gw.model(job)[1])
    return {k: v.copy() for k, v in fmt.views(blob, validate(blob)).items()}


def start(gw: Gateway, job: str, goal: int, **fields: Any) -> None:
    """A fixed-point job with a zero model."""
    gw.create_job(job, goal, fixed_point=FIXED_POINT, **fields)
    gw.set_model(job, fmt.encode({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}))


def plain_model(gw: Gateway, job: str, models: list[dict[str, np.ndarray]], samples: list[int]) -> dict[str, np.ndarray]:
    start(gw, job, len(models))
    for i, (m, c) in enumerate(zip(models, samples)):
        gw.push(job, fmt.encode(m), client=f"c{i}", samples=c, base_version=0)
    wait_for(lambda: gw.model(job)[0] == 1, what=f"{job}'s round")
    return model_of(gw, job)


def secure_round(node: RunningNode, job: str, models: list[dict[str, np.ndarray]], samples: list[int],
                 protocol: str = "http") -> dict[str, str]:
    """Every client runs the round with the SDK, in its own thread; their outcomes."""

    def client(i: int) -> str:
        p = Participant(node.http if protocol == "http" else node.grpc, job, client=f"c{i}", secure=True, protocol=protocol)
        try:
            return p.run_round(lambda state, version: (models[i], samples[i])).outcome
        finally:
            p.close()

    return outcomes_in_threads([f"c{i}" for i in range(len(models))], client)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_secure_round_installs_the_plain_fixed_point_model(node: RunningNode, protocol: str) -> None:
    gw = Gateway(node.http)
    models, samples = updates(6)
    plain = plain_model(gw, "plain", models, samples)
    Gateway(node.grpc, "grpc").create_job("secure", 6, fixed_point=FIXED_POINT, secure_aggregation={"stage_timeout_s": 120})
    gw.set_model("secure", fmt.encode({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}))
    outcomes = secure_round(node, "secure", models, samples, protocol)
    assert set(outcomes.values()) == {"accepted"}, outcomes
    wait_for(lambda: gw.model("secure")[0] == 1, what="the secure round's version")
    secure = model_of(gw, "secure")
    for k in SHAPES:
        assert secure[k].tobytes() == plain[k].tobytes(), k
    last = gw.rounds("secure")[-1]
    assert last["outcome"] == "complete" and last["updates"] == 6
    assert last["secure"] == {"round": 0, "stage": "done", "advertised": 6, "shared": 6, "survivors": 6, "dropped": 0,
                              "signed": 6, "k": 2, "threshold": 2, "signatures_needed": 4}


def test_clients_dropping_after_sharing_leave_the_survivors_model(node: RunningNode) -> None:
    """Two of eight share their keys, then go: at the collect stage's deadline the round goes on
    with the six masked inputs; their pair masks come off with keys rebuilt from shares."""
    gw = Gateway(node.http)
    models, samples = updates(8, seed=6)
    plain = plain_model(gw, "plain6", models[:6], samples[:6])
    start(gw, "drops", 8, secure_aggregation={"stage_timeout_s": 20, "dropout": 0.3})
    outcomes = _with_dropouts(node, "drops", models, samples, dropped={6, 7})
    assert [outcomes[f"c{i}"] for i in range(6)] == ["accepted"] * 6, outcomes
    wait_for(lambda: gw.model("drops")[0] == 1, timeout=120, what="the round with two dropouts")
    record = gw.rounds("drops")[-1]["secure"]
    assert (record["advertised"], record["shared"], record["survivors"], record["dropped"]) == (8, 8, 6, 2), record
    got = model_of(gw, "drops")
    for k in SHAPES:
        assert got[k].tobytes() == plain[k].tobytes(), k


def test_each_leaf_takes_its_own_clients_masks_off(node: RunningNode) -> None:
    """Leaves of two: each takes off the self masks of the clients it summed up, and the pair
    masks they added for the two who dropped after sharing; the top, of leaves' results, takes
    nothing off; the model is the survivors' plain one, bit for bit."""
    gw = Gateway(node.http)
    models, samples = updates(9, seed=8)
    plain = plain_model(gw, "plain7", models[:7], samples[:7])
    start(gw, "spread", 9, leaf_fan_in=2, secure_aggregation={"stage_timeout_s": 20, "dropout": 0.3})
    outcomes = _with_dropouts(node, "spread", models, samples, dropped={7, 8})
    assert [outcomes[f"c{i}"] for i in range(7)] == ["accepted"] * 7, outcomes
    wait_for(lambda: gw.model("spread")[0] == 1, timeout=120, what="the round of leaves of two")
    got = model_of(gw, "spread")
    for k in SHAPES:
        assert got[k].tobytes() == plain[k].tobytes(), k
    rounds = SecureRounds(node.state)
    graph = rounds.graph(rounds.round("spread"))
    agent = Client.connect(str(node.node.run_dir / "agent.sock"), Hello("gateway"))
    try:
        def tasks() -> list[Any] | None:
            mine = [t for t in agent.call(GetRecent())[0].tasks if t.job == "spread" and "unmasked" in t.stats]
            return mine if len(mine) >= 5 and any(t.role == "top" for t in mine) else None  # 4 leaves of 2 and 1, a top

        reports = wait_for(tasks, what="the secure round's task reports")
    finally:
        agent.close()
    leaves = [t.stats["unmasked"] for t in reports if t.role == "leaf"]
    assert [t.stats["unmasked"] for t in reports if t.role != "leaf"] == [0] * (len(reports) - len(leaves))
    assert len(leaves) >= 4 and all(n >= 1 for n in leaves), reports
    dropped_pairs = sum(1 for d in ("c7", "c8") for peer in graph[d] if peer not in ("c7", "c8"))
    assert sum(leaves) == 7 + dropped_pairs, (leaves, graph)  # every survivor's self mask, every pair mask with a dropout


def _with_dropouts(node: RunningNode, job: str, models: list[dict[str, np.ndarray]], samples: list[int],
                   dropped: set[int]) -> dict[str, str]:
    """Clients in ``dropped`` advertise and share with the SDK's SecureClient, then send nothing."""
    gw = Gateway(node.http)
    quitters = {i: SecureClient(f"c{i}") for i in dropped}
    for i, me in quitters.items():
        gw.secure_keys(job, *me.advertisement(), client=f"c{i}")
    others = [i for i in range(len(models)) if i not in dropped]
    result: dict[str, str] = {}

    def share_then_go() -> None:
        wait_for(lambda: gw.secure(job, f"c{min(dropped)}")["stage"] != "advertise", what="the share stage")
        for i, me in quitters.items():
            share_with_peers(gw, job, me, gw.secure(job, f"c{i}"), f"c{i}")

    quitter = threading.Thread(target=share_then_go)
    quitter.start()
    result.update(secure_round(node, job, [models[i] for i in others], [samples[i] for i in others]))
    quitter.join(120)
    return {f"c{others[int(k[1:])]}": v for k, v in result.items()}


def test_the_stages_refuse_what_would_reveal_an_input_or_join_late(node: RunningNode) -> None:
    gw = Gateway(node.http)
    start(gw, "refusals", 4, secure_aggregation={"stage_timeout_s": 120})
    models, samples = updates(1, seed=8)
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    with pytest.raises(Conflict) as info:  # a masked input before the round collects
        blob = secagg.plain_input(models[0], samples[0], spec, FixedPoint(**FIXED_POINT), 4)
        gw.push("refusals", blob, client="c0", samples=1, base_version=0)
    assert info.value.code == "wrong_stage"
    with pytest.raises(Exception) as plain_info:  # a plain update of a secure job is not of its layout
        gw.push("refusals", fmt.encode(models[0]), client="c0", samples=3, base_version=0)
    assert getattr(plain_info.value, "status", 0) in (400, 422)
    for body, code in (({"mask_key": "zz", "share_key": "00" * 32, "signing_key": "22" * 32}, "bad_key"),
                       ({"mask_key": "00" * 31, "share_key": "11" * 32, "signing_key": "22" * 32}, "bad_key"),
                       ({"mask_key": "00" * 32, "share_key": "11" * 32}, "bad_key"),  # no signing key
                       ({"mask_key": "00" * 32, "share_key": "11" * 32, "signing_key": "11" * 32}, "bad_key")):
        status, _, reply = node.request("POST", "/v1/jobs/refusals/secure/keys", _json({**body, "client": "c1"}))
        assert status == 400 and code in reply.decode(), reply
    for early in (lambda: gw.secure_answer("refusals", {}, client="c1"),
                  lambda: gw.secure_signature("refusals", bytes(secagg.SIGNATURE_BYTES), client="c1")):
        with pytest.raises(Conflict) as info2:
            early()
        assert info2.value.code == "wrong_stage"
    status, _, reply = node.request("POST", "/v1/jobs/refusals/secure/signature", _json({"signature": 5, "client": "c1"}))
    assert status == 400 and b"bad_signature" in reply, reply
    status, _, reply = node.request("POST", "/v1/jobs", _json({"job": "bad", "goal": 10, "fixed_point": FIXED_POINT,
                                                                "secure_aggregation": {"dropout": 0.2},
                                                                "retention": {"updates": 2}}))
    assert status == 400 and b"keeps no client's update" in reply
    with pytest.raises(BadRequest):
        gw.create_job("nofp", 10, secure_aggregation={"dropout": 0.1})


def _json(obj: Any) -> bytes:
    import json

    return json.dumps(obj).encode()


def test_a_server_optimiser_steps_on_the_unmasked_sum(node: RunningNode) -> None:
    """FedAdam needs only the round's sum: a secure job's version is the plain fixed-point job's."""
    gw = Gateway(node.http)
    models, samples = updates(4, seed=11)
    strategy = {"name": "fedadam", "eta": 0.05}
    start(gw, "adam-plain", 4, strategy=strategy)
    for i, (m, c) in enumerate(zip(models, samples)):
        gw.push("adam-plain", fmt.encode(m), client=f"c{i}", samples=c, base_version=0)
    wait_for(lambda: gw.model("adam-plain")[0] == 1, what="the plain FedAdam round")
    start(gw, "adam-secure", 4, strategy=strategy, secure_aggregation={"stage_timeout_s": 120})
    outcomes = secure_round(node, "adam-secure", models, samples)
    assert set(outcomes.values()) == {"accepted"}, outcomes
    wait_for(lambda: gw.model("adam-secure")[0] == 1, what="the secure FedAdam round")
    plain, secure = model_of(gw, "adam-plain"), model_of(gw, "adam-secure")
    for k in SHAPES:
        assert secure[k].tobytes() == plain[k].tobytes(), k


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_between_stages_is_answered_when_the_stage_moves(node: RunningNode, protocol: str) -> None:
    """A status call that saw the advertise stage is held (wait_s 60) and answered when the last
    client advertises, with the share stage's view; one whose stage is still current is answered,
    as it is, when its wait ends; a malformed wait is refused naming the problem."""
    address, job = node.http if protocol == "http" else node.grpc, f"waits-{protocol}"
    gw, waiting = Gateway(address, protocol), Gateway(address, protocol)
    start(Gateway(node.http), job, 3, secure_aggregation={"stage_timeout_s": 120})
    clients = [SecureClient(f"c{i}") for i in range(3)]
    seen = (gw.secure_keys(job, *clients[0].advertisement(), client="c0")["round"], "advertise")
    assert gw.secure(job, "c0", after=seen, wait_s=0.2)["stage"] == "advertise"
    answered: dict[str, Any] = {}
    held = threading.Thread(target=lambda: answered.update(waiting.secure(job, "c0", after=seen, wait_s=60)))
    held.start()
    for i in (1, 2):
        gw.secure_keys(job, *clients[i].advertisement(), client=f"c{i}")
    held.join(30)  # answered by the stage's move, long before its 60 s
    assert not held.is_alive() and answered["stage"] == "share" and set(answered["peers"]) == {"c1", "c2"}, answered
    assert gw.secure(job, "c0", after=seen, wait_s=60)["stage"] == "share"  # past already: at once
    with pytest.raises(BadRequest) as e:
        gw.secure(job, "c0", after=(seen[0], "sharing"), wait_s=1)
    assert e.value.code == "bad_stage_wait" and "after must be a stage" in str(e.value)
    status, _, reply = node.request("GET", f"/v1/jobs/{job}/secure?client=c0&round=0")
    assert status == 400 and b"bad_stage_wait" in reply and b"together" in reply


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_stage_message_is_answered_when_its_stage_moves(node: RunningNode, protocol: str) -> None:
    """A client's keys sent with wait_s are taken at once and answered when the last client
    advertises, with the share stage's view (one call for the message and the wait); a malformed
    wait_s is refused before the message is taken."""
    address, job = node.http if protocol == "http" else node.grpc, f"message-waits-{protocol}"
    gw, waiting = Gateway(address, protocol), Gateway(address, protocol)
    start(Gateway(node.http), job, 3, secure_aggregation={"stage_timeout_s": 120})
    clients = [SecureClient(f"c{i}") for i in range(4)]
    for bad in (-1, 61, "soon", True):
        with pytest.raises(BadRequest) as e:
            gw._secure_call(job, "keys", "c3", {**dict(zip(("mask_key", "share_key", "signing_key"),
                                                           (k.hex() for k in clients[3].advertisement()))), "wait_s": bad})
        assert e.value.code == "bad_stage_wait", bad
    answered: dict[str, Any] = {}
    held = threading.Thread(target=lambda: answered.update(
        waiting.secure_keys(job, *clients[0].advertisement(), client="c0", wait_s=60)))
    held.start()
    wait_for(lambda: "c0" in SecureRounds(node.state).keys(job), what="c0's keys, taken before its wait")
    assert gw.secure_keys(job, *clients[1].advertisement(), client="c1")["stage"] == "advertise"  # no wait: at once
    gw.secure_keys(job, *clients[2].advertisement(), client="c2", wait_s=60)  # the last: the stage moved already
    held.join(30)  # answered by the stage's move, long before its 60 s
    assert not held.is_alive() and answered["stage"] == "share" and set(answered["peers"]) == {"c1", "c2"}, answered
    assert sorted(SecureRounds(node.state).keys(job)) == ["c0", "c1", "c2"]  # c3's refused message took nothing
    if protocol == "grpc":
        with pytest.raises(BadRequest) as e:
            gw._secure_rpc(job, "unmask", "c0", {})
        assert e.value.code == "bad_secure_call" and "keys, shares, signature, answer" in str(e.value)
    else:
        assert node.request("POST", f"/v1/jobs/{job}/secure/unmask", b"{}")[0] == 404


def test_a_survivor_whose_answer_comes_after_the_sum_was_unmasked_is_accepted(node: RunningNode) -> None:
    """Three survivors' answers unmask the sum of four (a complete graph, threshold 2) before the
    fourth answers: its answer is refused, the round being done, and the SDK reports its input
    accepted, as it is."""
    gw = Gateway(node.http)
    models, samples = updates(4, seed=14)
    start(gw, "late", 4, secure_aggregation={"stage_timeout_s": 120, "dropout": 0.3})

    class LateAnswer(Gateway):
        def secure_answer(self, job: str, shares: dict[str, tuple[str, bytes]], client: str | None = None) -> Any:
            wait_for(lambda: gw.secure(job, client)["stage"] == "done", what="the others' answers unmasking the sum")
            return super().secure_answer(job, shares, client=client)

    class LateParticipant(Participant):
        def connect(self, address: str, retry: Any) -> Gateway:
            return LateAnswer(address, self.protocol, retry=retry, token=self.token, tls=self.tls)

    def client(i: int) -> str:
        p = (LateParticipant if i == 3 else Participant)(node.http, "late", client=f"c{i}", secure=True)
        try:
            return p.run_round(lambda state, version: (models[i], samples[i])).outcome
        finally:
            p.close()

    outcomes = outcomes_in_threads([f"c{i}" for i in range(4)], client)
    assert outcomes == {f"c{i}": "accepted" for i in range(4)}, outcomes
    wait_for(lambda: gw.model("late")[0] == 1, what="the round's version")
    assert gw.rounds("late")[-1]["secure"]["survivors"] == 4


def test_a_client_answers_no_survivor_list_too_few_signed(node: RunningNode) -> None:
    """The view one client is shown at the unmask stage lacks a signature it needs (what a server
    that told clients different survivor lists would have to show): it gives no share, saying
    why; the other three's answers unmask the sum (a complete graph of four, threshold 2)."""
    gw = Gateway(node.http)
    models, samples = updates(4, seed=16)
    start(gw, "lying", 4, secure_aggregation={"stage_timeout_s": 120, "dropout": 0.3})

    shown = threading.Event()  # the others answer once c3 saw the unmask stage (their answers could end it first)

    class Lying(Gateway):
        def secure(self, job: str, client: str | None = None, after: tuple[int, str] | None = None,
                   wait_s: float = 0.0) -> dict[str, Any]:
            return self.lie(super().secure(job, client, after, wait_s))

        def secure_signature(self, job: str, signature: bytes, client: str | None = None, wait_s: float = 0.0) -> Any:
            return self.lie(super().secure_signature(job, signature, client, wait_s))

        @staticmethod
        def lie(view: dict[str, Any]) -> dict[str, Any]:
            if view["stage"] == "unmask":
                view["signatures"] = dict(list(view["signatures"].items())[:view["signatures_needed"] - 1])
                shown.set()
            return view

    class AfterIt(Gateway):
        def secure_answer(self, job: str, shares: dict[str, tuple[str, bytes]], client: str | None = None) -> Any:
            assert shown.wait(120)
            return super().secure_answer(job, shares, client=client)

    class Connected(Participant):
        def connect(self, address: str, retry: Any) -> Gateway:
            kind = Lying if self.client == "c3" else AfterIt
            return kind(address, self.protocol, retry=retry, token=self.token, tls=self.tls)

    def client(i: int) -> str:
        p = Connected(node.http, "lying", client=f"c{i}", secure=True)
        try:
            return p.run_round(lambda state, version: (models[i], samples[i])).outcome
        finally:
            p.close()

    outcomes = outcomes_in_threads([f"c{i}" for i in range(4)], client)
    assert outcomes == {"c0": "accepted", "c1": "accepted", "c2": "accepted", "c3": "inconsistent"}, outcomes
    wait_for(lambda: gw.model("lying")[0] == 1, what="the round's version")
    record = gw.rounds("lying")[-1]["secure"]
    assert (record["survivors"], record["signed"], record["signatures_needed"]) == (4, 4, 3), record
    assert node.state.redis.scard("lifl:job:lying:sa:answered") == 3


def test_dp_fedavg_clips_on_the_clients_and_adds_noise_to_the_unmasked_mean(node: RunningNode) -> None:
    """A secure dp_fedavg job (clip_on "client"): each client clips its change to norm 1 before
    masking it, and the top adds N(0, (zC/n)^2) to the unmasked mean; the round spends privacy."""
    gw = Gateway(node.http)
    models, samples = updates(4, seed=21)  # changes of norm about 24 from the zero model
    strategy = {"name": "dp_fedavg", "clipping_norm": 1.0, "noise_multiplier": 0.5, "population": 100, "clip_on": "client"}
    start(gw, "private", 4, strategy=strategy, secure_aggregation={"stage_timeout_s": 120})
    outcomes = secure_round(node, "private", models, samples)
    assert outcomes == {f"c{i}": "accepted" for i in range(4)}, outcomes
    wait_for(lambda: gw.model("private")[0] == 1, what="the private round's version")
    got = model_of(gw, "private")
    zeros = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    clipped = [clip_change(m, zeros, 1.0) for m in models]
    def off_by(inputs: list[dict[str, np.ndarray]]) -> np.ndarray:  # every coordinate: the model less the mean
        return np.concatenate([(got[k].astype(np.float64) - np.mean([x[k] for x in inputs], axis=0, dtype=np.float64)).ravel()
                               for k in SHAPES])

    residual = off_by(clipped)  # uniform (not weighted): each input counts one sample; what is left is noise, std 0.125
    assert 0.11 < np.std(residual) < 0.14 and abs(np.mean(residual)) < 0.03, np.std(residual)
    assert np.std(off_by(models)) > 0.4  # the unclipped mean is far off
    report = gw.rounds("private")[-1]["strategy"]
    assert report["clipped_on"] == "client" and report["noise_std"] == pytest.approx(0.125) and report["epsilon"] > 0, report


def test_no_object_of_the_node_holds_a_clients_update(node: RunningNode) -> None:
    """Clients driven stage by stage: once every masked input is in the node's shared memory (and
    before the unmask stage), no object there holds any client's update or its plain fixed-point
    input, and Redis holds neither; the round then completes."""
    gw = Gateway(node.http)
    models, samples = updates(4, seed=12)
    spec = fmt.parse_layout(fmt.encode(models[0])).spec()
    start(gw, "watched", 4, secure_aggregation={"stage_timeout_s": 120})
    clients = {f"c{i}": SecureClient(f"c{i}") for i in range(4)}
    for name, me in clients.items():
        view = gw.secure_keys("watched", *me.advertisement(), client=name)
    context = context_of("watched", view)
    for name, me in clients.items():
        share_with_peers(gw, "watched", me, gw.secure("watched", name), name)
    secrets_of = []
    for i, (name, me) in enumerate(clients.items()):
        inbox = {p: bytes.fromhex(b) for p, b in gw.secure("watched", name)["inbox"].items()}
        plain = secagg.plain_input(models[i], samples[i], spec, FixedPoint(**FIXED_POINT), 4)
        data = fmt.parse_layout(plain, allow_partial=True).data_start
        secrets_of += [bytes(plain[data:data + 64]), models[i]["w"].tobytes()[:64]]
        gw.push("watched", me.masked_input(context, inbox, models[i], samples[i], spec, FixedPoint(**FIXED_POINT), 4),
                samples=1, base_version=0, client=name)
    assert gw.secure("watched", "c0")["stage"] == "consistency"
    held = [p.read_bytes() for p in Path("/dev/shm").glob(f"lifl-{node.node.config.node}-*")]
    assert held and not any(secret in blob for secret in secrets_of for blob in held)
    redis_values = b"".join(str(v).encode() for key in node.state.redis.keys("lifl:job:watched*")
                            for v in _values(node.state.redis, key))
    assert not any(secret.hex().encode() in redis_values or secret in redis_values for secret in secrets_of)
    for name, me in clients.items():
        gw.secure_signature("watched", me.signature(context, frozenset(clients)), client=name)
    request = secagg.ShareRequest(frozenset(clients), frozenset())
    for name, me in clients.items():
        view = gw.secure("watched", name)
        if view["stage"] == "unmask":
            signatures = {c: (bytes.fromhex(v["key"]), bytes.fromhex(v["signature"])) for c, v in view["signatures"].items()}
            gw.secure_answer("watched", me.answer(context, request, signatures, view["signatures_needed"]), client=name)
    wait_for(lambda: gw.model("watched")[0] == 1, what="the watched round")


def _values(r: Any, key: str) -> list[Any]:
    kind = r.type(key)
    return {"string": lambda: [r.get(key)], "hash": lambda: list(r.hgetall(key).items()), "set": lambda: list(r.smembers(key)),
            "zset": lambda: r.zrange(key, 0, -1), "list": lambda: r.lrange(key, 0, -1)}.get(kind, lambda: [])()
