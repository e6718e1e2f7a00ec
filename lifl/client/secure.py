"""A client's side of a secure round (SecAgg+, ``lifl.secagg``): ``SecureClient`` holds its keys
and secrets and computes what it sends at each stage (no I/O; a new one per round: nothing of it
may serve two rounds); ``run_secure_round`` takes it through the stages with a gateway.

Needs the ``secure`` extra of the lifl-client wheel (the ``cryptography`` package).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl import secagg
from lifl.errors import BadRequest, Conflict
from lifl.fixedpoint import FixedPoint


class SecureClient:
    def __init__(self, name: str) -> None:
        self.name = name
        self.mask_keys = secagg.KeyPair.generate()
        self.share_keys = secagg.KeyPair.generate()
        self.signing_key = secagg.SigningKey.generate()
        self.self_seed = secrets.token_bytes(secagg.SEED_BYTES)
        self.peers: dict[str, tuple[int, bytes, bytes]] = {}  # neighbour -> (Shamir point, mask public, share public)
        self.held: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> the (self, key) shares it sent this client
        self.signed: frozenset[str] | None = None  # the survivor list it signed: the only one it answers

    def advertisement(self) -> secagg.PublicKeys:
        """Its public keys: the advertise stage."""
        return secagg.PublicKeys(self.mask_keys.public, self.share_keys.public, self.signing_key.public)

    def shares(self, context: bytes, threshold: int, peers: Mapping[str, tuple[int, bytes, bytes]]) -> dict[str, bytes]:
        """The share stage: for each neighbour (its point and public keys, as the gateway lists
        them), one share of this client's self-mask seed and one of its mask key, sealed to it."""
        self.peers = dict(peers)
        points = [point for point, _, _ in self.peers.values()]
        selfs = secagg.split_secret(self.self_seed, points, threshold)
        keys = secagg.split_secret(self.mask_keys.private, points, threshold)
        return {peer: secagg.seal_shares(self._share_key(context, share_public), self.name, peer, context,
                                         selfs[point], keys[point])
                for peer, (point, _, share_public) in self.peers.items()}

    def masked_input(self, context: bytes, inbox: Mapping[str, bytes], update: Mapping[str, np.ndarray], samples: int,
                     spec: fmt.ModelSpec, fixed_point: FixedPoint, clients: int) -> bytearray:
        """The collect stage: open the shares the neighbours that shared sent (``inbox``), and
        mask the update (with its sample count) with them: the blob to push as this round's update."""
        unknown = sorted(set(inbox) - set(self.peers))
        if unknown:
            raise BadRequest(f"shares from {unknown[0]!r}, not a neighbour of {self.name!r}", code="bad_shares")
        self.held = {p: secagg.open_shares(self._share_key(context, self.peers[p][2]), p, self.name, context, blob)
                     for p, blob in inbox.items()}
        blob = secagg.plain_input(update, samples, spec, fixed_point, clients)
        pairs = [(secagg.pair_sign(self.name, p), secagg.agree(self.mask_keys.private, self.peers[p][1], b"mask", context))
                 for p in sorted(inbox)]
        secagg.add_masks(secagg.segments(blob), [(1, self.self_seed), *pairs])
        return blob

    def signature(self, context: bytes, survivors: frozenset[str]) -> bytes:
        """The consistency stage: its signature of the survivor list (one list per round: a
        second one, different, is refused)."""
        if self.name not in survivors:
            raise BadRequest(f"a survivor list without {self.name!r}, who sent its masked input", code="inconsistent_request")
        if self.signed is not None and self.signed != survivors:
            raise BadRequest(f"{self.name!r} signed another survivor list this round", code="inconsistent_request")
        self.signed = survivors
        return self.signing_key.sign(context, survivors)

    def answer(self, context: bytes, request: secagg.ShareRequest, signatures: Mapping[str, tuple[bytes, bytes]],
               needed: int) -> dict[str, tuple[str, bytes]]:
        """The unmask stage: one share per neighbour, the one the request may have; only if the
        request is of the survivor list it signed, and ``needed`` survivors signed that list too
        (``signatures``: signer -> (signing key, signature), ``lifl.secagg.check_consistency``)."""
        if self.signed is None:
            raise BadRequest(f"{self.name!r} signed no survivor list: it answers no unmask request", code="inconsistent_request")
        secagg.check_consistency(self.name, self.signed, request, context, signatures, needed)
        return secagg.answer_request(self.name, self.held, request)

    def _share_key(self, context: bytes, public: bytes) -> bytes:
        return secagg.agree(self.share_keys.private, public, b"share", context)


STAGES = ("advertise", "share", "collect", "consistency", "unmask", "done")
STAGE_GRACE_S = 30.0  # past a stage's timeout, how long a client still waits for the duties to end it
STAGE_WAIT_S = 60.0  # a stage's message waits this long (at most) for the stage to move on; _await goes on after


class RoundOver(Exception):
    """The secure round ended for this client before it could finish (abandoned, moved on, or it
    was left out at a stage): ``outcome`` says which."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


def clip_change(update: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], norm: float) -> dict[str, np.ndarray]:
    """``update`` with its change from ``base`` clipped to L2 norm ``norm`` over all its float
    tensors together (DP-FedAvg's clipping, here on the client): base + min(1, norm/|w - base|) (w - base)."""
    floats = [k for k, v in update.items() if np.asarray(v).dtype.kind == "f"]
    for k in floats:
        if k not in base or np.shape(base[k]) != np.shape(update[k]):
            raise BadRequest(f"the base model has no tensor {k!r} of the update's shape", code="bad_secure_input")
    changes = {k: np.asarray(update[k], np.float64) - np.asarray(base[k], np.float64) for k in floats}
    length = float(np.sqrt(sum(float(np.vdot(c, c)) for c in changes.values())))
    scale = min(1.0, norm / length) if length > 0 else 1.0
    return {k: (np.asarray(base[k], np.float64) + scale * changes[k]).astype(np.asarray(v).dtype) if k in changes
            else np.asarray(v) for k, v in update.items()}


def run_secure_round(gateway: Any, job: str, client: str | None, update: Mapping[str, np.ndarray], samples: int,
                     spec: fmt.ModelSpec, base_version: int, base: Mapping[str, np.ndarray] | None = None) -> None:
    """Take part in the job's current secure round with ``update`` (trained from ``base_version``,
    of ``samples`` samples): every stage by itself, through ``gateway`` (a ``lifl.client.Gateway``).
    A job whose strategy clips on the clients (dp_fedavg, ``clip_on`` "client") needs ``base``,
    the model the update was trained from: the change is clipped before it is masked. Raises
    RoundOver if the round ends without this client's input in it."""
    me = SecureClient(client or "")
    view = gateway.secure_keys(job, *me.advertisement(), client=client, wait_s=STAGE_WAIT_S)
    me.name, round_id = view["client"], view["round"]
    context = context_of(job, view)
    view = _await(gateway, job, client, round_id, "share", view)
    if "peers" not in view:
        raise RoundOver("left_out", "the advertise stage closed without this client's keys")
    view = share_with_peers(gateway, job, me, view, client, wait_s=STAGE_WAIT_S)
    view = _await(gateway, job, client, round_id, "collect", view)
    if "inbox" not in view:
        raise RoundOver("left_out", "the share stage closed without this client's shares")
    fixed_point = FixedPoint.from_request(view["fixed_point"])
    assert fixed_point is not None
    if clip := view.get("clip"):
        if base is None:
            raise BadRequest(f"job {job!r} clips each change on its client: give the model the update was trained "
                             "from (base)", code="bad_secure_input")
        update, samples = clip_change(update, base, clip["norm"]), samples if clip["weighted"] else 1
    masked = me.masked_input(context, {p: bytes.fromhex(b) for p, b in view["inbox"].items()}, update, samples, spec,
                             fixed_point, view["clients"])
    gateway.push(job, masked, samples=1, base_version=base_version, client=client)  # its sample count is masked inside
    view = _await(gateway, job, client, round_id, "consistency", view)
    if view["stage"] == "consistency":
        survivors = frozenset(view["survivors"])
        if me.name not in survivors:
            raise RoundOver("left_out", "the collect stage closed without this client's masked input")
        view = gateway.secure_signature(job, me.signature(context, survivors), client=client, wait_s=STAGE_WAIT_S)
    view = _await(gateway, job, client, round_id, "unmask", view)
    if view["stage"] == "unmask":
        if me.signed is None:
            raise RoundOver("left_out", "the consistency stage closed without this client's signature")
        request = secagg.ShareRequest(frozenset(view["request"]["survivors"]), frozenset(view["request"]["dropped"]))
        try:
            signatures = {c: (bytes.fromhex(s["key"]), bytes.fromhex(s["signature"])) for c, s in view["signatures"].items()}
            answer = me.answer(context, request, signatures, view["signatures_needed"])
        except (BadRequest, ValueError, KeyError) as e:  # the server showed clients different lists, or forged signatures
            raise RoundOver("inconsistent", f"the unmask request failed the consistency check, no share given: {e}") from None
        try:
            gateway.secure_answer(job, answer, client=client)
        except Conflict:  # the other survivors' answers may have unmasked the sum first: this input is in it
            view = gateway.secure(job, client)
            if view["round"] != round_id or view["stage"] != "done":
                raise


def context_of(job: str, view: dict[str, Any]) -> bytes:
    """What binds the secrets of the round a gateway's view is of (``lifl.secagg.round_context``)."""
    return secagg.round_context(job, view["round"], bytes.fromhex(view["seed"]))


def share_with_peers(gateway: Any, job: str, me: SecureClient, view: dict[str, Any], client: str | None,
                     wait_s: float = 0.0) -> dict[str, Any]:
    """The share stage: ``me``'s shares for the neighbours the round's view lists (its ``peers``);
    the view the gateway answers with (``wait_s``: once the stage moved on)."""
    peers = {p: (v["point"], bytes.fromhex(v["mask_key"]), bytes.fromhex(v["share_key"])) for p, v in view["peers"].items()}
    return gateway.secure_shares(job, me.shares(context_of(job, view), view["threshold"], peers), client=client, wait_s=wait_s)


def _await(gateway: Any, job: str, client: str | None, round_id: int, stage: str, view: dict[str, Any]) -> dict[str, Any]:
    """The round's view once its stage is ``stage`` or later (the gateway holds each call until
    the stage moves: one call per stage); RoundOver if it was abandoned or another round began."""
    deadline = time.monotonic() + view["stage_timeout_s"] + STAGE_GRACE_S
    while True:
        if view["round"] != round_id:
            raise RoundOver("moved_on", f"secure round {round_id} ended; the job is at round {view['round']}")
        if view["stage"] == "abandoned":
            raise RoundOver("abandoned", view.get("why", ""))
        if view["stage"] in STAGES and STAGES.index(view["stage"]) >= STAGES.index(stage):
            return view
        left = deadline - time.monotonic()
        if left <= 0:
            raise RoundOver("timeout", f"secure round {round_id} stayed at its {view['stage']} stage past its deadline")
        view = gateway.secure(job, client, after=(round_id, view["stage"]), wait_s=left)
