"""Secure aggregation, SecAgg+ (Bell et al., CCS 2020, over Bonawitz et al., CCS 2017): the
math of one round, no I/O. The server learns the sum of the surviving clients' inputs and
nothing about any one of them.

A round's clients are laid on a ring in an order drawn from the round's public seed; each is
joined to the k/2 before and after it (a Harary graph, k-regular, and random because the order
is). Each client u

- has two X25519 key pairs: one agrees pairwise *mask seeds* s_uv with its neighbours, the
  other the keys that encrypt what it sends them through the server (its shares);
- draws a *self-mask seed* b_u, and sends each neighbour, encrypted, one Shamir share of b_u
  and one of its mask private key (threshold t);
- sends y_u = x_u + PRG(b_u) + sum over neighbours v of sign(u, v) * PRG(s_uv) modulo
  2^width, where sign(u, v) is +1 if u sorts before v and -1 otherwise, so that in a sum over
  every client each pair's masks cancel;
- signs, with a third key (Ed25519), the list of survivors the server says its sum holds
  (the consistency check, Bonawitz et al.'s round 3).

The server sums the y_u of the survivors, then, from t shares each, reconstructs b_u of every
survivor and the mask private key of every client that dropped after sharing, and removes what
does not cancel: the survivors' self masks and their pair masks with dropped neighbours. An
honest client gives a neighbour's b share only if it survived and its key share only if it
dropped, never both (``ShareRequest``), and t > k/2, so the server never holds enough of both
for one client.

k and t are chosen (``choose_params``) for the population n, the fraction of clients that may
drop out (delta) and that may be corrupt (gamma): t = k/2 + 1, and k the smallest even degree
for which, over every client (a union bound) and the hypergeometric law of a client's random
neighbourhood, the chance that a survivor or a dropped client keeps fewer than t surviving
neighbours is below 2^-CORRECTNESS_BITS and the chance that t of a client's neighbours are
corrupt is below 2^-SECURITY_BITS (the statistical parameters of Bell et al., eta and sigma).
A survivor with t > k/2 surviving neighbours rules out a run of k/2 dropped clients beside it
on the ring, so the survivors' graph stays connected and no partial sum of theirs is exposed.
When no degree below n - 1 satisfies both, every client is every other's neighbour (SecAgg).

The consistency check guards against a server that tells clients different survivor lists (to
gather, with corrupt clients' help, both kinds of shares of one client): a client answers the
unmask request only after checking the signatures of ``Params.signatures`` = floor((n + n_c) / 2)
+ 1 clients of the round on the very list it signed itself (n_c = floor(corruption x n)). Two
such groups share more than n_c clients, so at least one honest one, who signs one list only:
every honest client that answers answers the same list, and a client's other kind of share
can come only from the corrupt (fewer than t). The signers' keys reach a client through the
server: against a server that also invents clients, the keys need a PKI (as the papers assume).
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lifl import format as fmt
from lifl.errors import BadRequest, Unprocessable
from lifl.fixedpoint import BOUND_TENSOR, ROUNDING_LIMIT, FixedPoint, partial_spec

SEED_BYTES = 32  # self-mask seeds, pair seeds, share keys, X25519 keys
SECURITY_BITS = 40  # sigma: the chance that corrupt clients hold t shares of one client
CORRECTNESS_BITS = 30  # eta: the chance that a round cannot unmask for want of shares
MIN_CLIENTS = 3  # with 2, each learns the other's input from the sum
FIELD_PRIME = (1 << 521) - 1  # a Mersenne prime above 2^256: one share carries a whole secret
SHARE_BYTES = 66  # a field element, big-endian
WIDTHS = {32: np.uint32, 64: np.uint64}
NONCE_BYTES = 12
SIGNATURE_BYTES = 64  # Ed25519

KIND_SELF = "self"  # a share of the client's self-mask seed: asked for survivors
KIND_KEY = "key"  # a share of the client's mask private key: asked for clients that dropped


# -- the graph ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    """A round's graph degree ``k`` (each client's neighbour count), share ``threshold``, and the
    ``signatures`` of the survivor list a client needs to see before it answers."""

    clients: int
    k: int
    threshold: int
    signatures: int


def choose_params(clients: int, dropout: float, corruption: float) -> Params:
    """The smallest even degree (and t = k/2 + 1) that keeps the round correct and secure for
    ``clients`` of which a fraction ``dropout`` may drop and ``corruption`` may be corrupt."""
    if type(clients) is not int or clients < MIN_CLIENTS:
        raise BadRequest(f"secure aggregation needs at least {MIN_CLIENTS} clients in a round, got {clients!r}",
                         code="bad_secure_aggregation")
    for name, fraction in (("dropout", dropout), ("corruption", corruption)):
        if not (isinstance(fraction, (int, float)) and 0 <= fraction < 0.5):
            raise BadRequest(f"secure aggregation's {name} must be a fraction in [0, 0.5), got {fraction!r}",
                             code="bad_secure_aggregation")
    return _choose(clients, math.floor(dropout * clients), math.floor(corruption * clients))


@lru_cache(maxsize=256)
def _choose(n: int, dropped: int, corrupt: int) -> Params:
    signatures = (n + corrupt) // 2 + 1  # two groups of signers share an honest client
    if n - dropped < signatures:
        raise Unprocessable(f"{n} clients cannot tolerate {dropped} dropping out: the consistency check needs "
                            f"{signatures} of them to sign the survivor list ({corrupt} may be corrupt)",
                            code="secure_population_too_small")
    others = n - 1
    correctness, security = 2.0 ** -CORRECTNESS_BITS / n, 2.0 ** -SECURITY_BITS / n  # union bound over clients
    for k in range(2, others, 2):
        t = k // 2 + 1
        # a client's k neighbours are a uniform k-subset of the n - 1 others (the ring's order is random)
        if (_hypergeometric_below(others, others - dropped, k, t) <= correctness
                and _hypergeometric_at_least(others, corrupt, k, t) <= security):
            return Params(n, k, t, signatures)
    # everyone is everyone's neighbour: the counts are certain (fewer than half corrupt stay below t)
    t = others // 2 + 1
    if others - dropped < t:
        raise Unprocessable(f"{n} clients cannot tolerate {dropped} dropping out: a client needs {t} surviving neighbours "
                            f"of {others}", code="secure_population_too_small")
    return Params(n, others, t, signatures)


def _hypergeometric(population: int, marked: int, draws: int, hits: int) -> float:
    return math.comb(marked, hits) * math.comb(population - marked, draws - hits) / math.comb(population, draws)


def _hypergeometric_below(population: int, marked: int, draws: int, limit: int) -> float:
    return sum(_hypergeometric(population, marked, draws, h) for h in range(max(0, limit)) if h <= marked)


def _hypergeometric_at_least(population: int, marked: int, draws: int, limit: int) -> float:
    return sum(_hypergeometric(population, marked, draws, h) for h in range(limit, min(draws, marked) + 1))


def neighbours(clients: Sequence[str], k: int, round_seed: bytes) -> dict[str, tuple[str, ...]]:
    """Each client's neighbours (sorted) in the round's graph: the ring's order is the clients
    sorted by a hash of the round's public seed and their name, so every party derives it."""
    if len(set(clients)) != len(clients):
        raise BadRequest("a round's clients must be distinct", code="bad_secure_aggregation")
    ring = sorted(clients, key=lambda c: hashlib.sha256(round_seed + c.encode()).digest())
    n = len(ring)
    if k >= n - 1:
        return {c: tuple(sorted(o for o in ring if o != c)) for c in ring}
    if k % 2:
        raise BadRequest(f"a ring graph's degree must be even, got {k}", code="bad_secure_aggregation")
    return {c: tuple(sorted(ring[(i + d) % n] for d in range(-k // 2, k // 2 + 1) if d)) for i, c in enumerate(ring)}


# -- Shamir's secret sharing over GF(FIELD_PRIME) ---------------------------------------------------
def split_secret(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
    """One share of ``secret`` for each nonzero point in ``xs``; any ``threshold`` of them
    rebuild it, fewer tell nothing."""
    if not 1 <= threshold <= len(xs):
        raise BadRequest(f"a threshold of {threshold} out of {len(xs)} shares", code="bad_secure_aggregation")
    if len(set(xs)) != len(xs) or not all(0 < x < FIELD_PRIME for x in xs):
        raise BadRequest("share points must be distinct and nonzero", code="bad_secure_aggregation")
    if len(secret) > SEED_BYTES:
        raise BadRequest(f"a secret of {len(secret)} bytes (at most {SEED_BYTES})", code="bad_secure_aggregation")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(FIELD_PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in xs}


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    acc = 0
    for c in reversed(coefficients):
        acc = (acc * x + c) % FIELD_PRIME
    return acc


def reconstruct(shares: Mapping[int, bytes], threshold: int, secret_bytes: int = SEED_BYTES) -> bytes:
    """The secret from ``threshold`` shares (point -> share); fewer are refused."""
    if len(shares) < threshold:
        raise Unprocessable(f"{len(shares)} shares, {threshold} needed to reconstruct", code="below_threshold")
    points = sorted(shares)[:threshold]
    ys = {}
    for x in points:
        y = shares[x]
        if len(y) != SHARE_BYTES or not 0 < x < FIELD_PRIME or int.from_bytes(y, "big") >= FIELD_PRIME:
            raise BadRequest(f"a malformed share at point {x!r}", code="bad_share")
        ys[x] = int.from_bytes(y, "big")
    value = 0
    for x in points:
        numerator, denominator = 1, 1
        for other in points:
            if other != x:
                numerator = numerator * other % FIELD_PRIME
                denominator = denominator * (other - x) % FIELD_PRIME
        value = (value + ys[x] * numerator * pow(denominator, -1, FIELD_PRIME)) % FIELD_PRIME
    if value >= 1 << (8 * secret_bytes):
        raise Unprocessable("the shares do not agree on a secret (one is from another secret, or forged)",
                            code="bad_share")
    return value.to_bytes(secret_bytes, "big")


# -- keys -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyPair:
    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        key = X25519PrivateKey.generate()
        return cls(key.private_bytes_raw(), key.public_key().public_bytes_raw())

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        key = _private_key(private)
        return cls(private, key.public_key().public_bytes_raw())


class PublicKeys(NamedTuple):
    """What a client advertises for a round: its mask key (pair seeds), share key (the keys that
    seal its shares) and signing key (the consistency check)."""

    mask: bytes
    share: bytes
    signing: bytes


def _private_key(private: bytes) -> X25519PrivateKey:
    if len(private) != SEED_BYTES:
        raise BadRequest(f"an X25519 private key is {SEED_BYTES} bytes, got {len(private)}", code="bad_key")
    return X25519PrivateKey.from_private_bytes(private)


def agree(private: bytes, peer_public: bytes, purpose: bytes, context: bytes) -> bytes:
    """The 32-byte secret two clients derive alike from their keys: a pair's mask seed or share
    key (``purpose``), bound to the round (``context``) so no round reuses another's."""
    if len(peer_public) != SEED_BYTES:
        raise BadRequest(f"an X25519 public key is {SEED_BYTES} bytes, got {len(peer_public)}", code="bad_key")
    try:
        shared = _private_key(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:  # a low-order point: the shared secret would be all zeros
        raise BadRequest(f"an unusable public key: {e}", code="bad_key") from None
    return HKDF(hashes.SHA256(), SEED_BYTES, salt=None, info=b"lifl secagg " + purpose + b"\0" + context).derive(shared)


# -- what a client sends a neighbour through the server -----------------------------------------------
def _associated(sender: str, receiver: str, context: bytes) -> bytes:
    return b"\0".join((b"lifl secagg shares", sender.encode(), receiver.encode(), context))


def seal_shares(key: bytes, sender: str, receiver: str, context: bytes, self_share: bytes, key_share: bytes) -> bytes:
    """``sender``'s two shares for ``receiver``, encrypted and bound to both names and the round
    (the server cannot swap, redirect or replay them into another round)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, self_share + key_share, _associated(sender, receiver, context))


def open_shares(key: bytes, sender: str, receiver: str, context: bytes, sealed: bytes) -> tuple[bytes, bytes]:
    """(self share, key share) from ``seal_shares``; anything altered, redirected or from
    another round is refused."""
    try:
        plain = ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _associated(sender, receiver, context))
    except (InvalidTag, ValueError):
        raise BadRequest(f"the shares {sender!r} sent {receiver!r} do not open (altered, misrouted or from another round)",
                         code="bad_share") from None
    if len(plain) != 2 * SHARE_BYTES:
        raise BadRequest(f"the shares {sender!r} sent {receiver!r} are {len(plain)} bytes", code="bad_share")
    return plain[:SHARE_BYTES], plain[SHARE_BYTES:]


# -- the consistency check: the survivor list, signed -------------------------------------------------
@dataclass(frozen=True)
class SigningKey:
    """A client's Ed25519 key for the consistency check (``private``: its 32-byte seed)."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> SigningKey:
        key = Ed25519PrivateKey.generate()
        return cls(key.private_bytes_raw(), key.public_key().public_bytes_raw())

    def sign(self, context: bytes, survivors: Collection[str]) -> bytes:
        return Ed25519PrivateKey.from_private_bytes(self.private).sign(survivor_list(context, survivors))


def survivor_list(context: bytes, survivors: Collection[str]) -> bytes:
    """What a client signs: the round (``context``) and the sorted survivors, each length-prefixed
    (no list of names reads as another)."""
    names = [n.encode() for n in sorted(survivors)]
    return b"lifl secagg survivors\0" + context + b"".join(struct.pack(">I", len(n)) + n for n in names)


def verify_signature(public: bytes, signature: bytes, signed_list: bytes) -> bool:
    """Whether ``signature`` is the signature, with ``public``, of ``signed_list`` (a round's
    ``survivor_list``)."""
    if len(public) != SEED_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, signed_list)
    except (InvalidSignature, ValueError):
        return False
    return True


def check_consistency(me: str, signed: frozenset[str], request: ShareRequest, context: bytes,
                      signatures: Mapping[str, tuple[bytes, bytes]], needed: int) -> None:
    """A client's check before it answers the unmask request (``signed``: the survivor list it
    signed; ``signatures``: signer -> (its signing key, its signature), as the server relays
    them): the request is of that list, and ``needed`` distinct clients of the list signed that
    very list. Refused otherwise, naming why: the client then answers nothing."""
    if request.survivors != signed:
        raise BadRequest(f"the unmask request's survivors are not the {len(signed)} {me!r} signed", code="inconsistent_request")
    strangers = sorted(set(signatures) - signed)
    if strangers:
        raise BadRequest(f"a signature of {strangers[0]!r}, who is not a survivor", code="bad_signature")
    keys = [public for public, _ in signatures.values()]
    if len(set(keys)) != len(keys):
        raise BadRequest("two signers with one key", code="bad_signature")
    signed_list = survivor_list(context, signed)
    for signer, (public, signature) in signatures.items():
        if not verify_signature(public, signature, signed_list):
            raise BadRequest(f"{signer!r}'s signature is not of the survivor list {me!r} signed", code="bad_signature")
    if len(signatures) < needed:
        raise BadRequest(f"{len(signatures)} clients signed the survivor list, {needed} needed", code="too_few_signatures")


# -- masks ------------------------------------------------------------------------------------------
def add_masks(segments: Sequence[np.ndarray], signed_seeds: Sequence[tuple[int, bytes]]) -> None:
    """Each of ``segments`` (flat vectors of unsigned integers, of 32 or 64 bits each, taken in
    order as one masked vector) plus, in place, each sign * PRG(seed): the AES-256-CTR keystream
    of the seed (a zero nonce; each seed serves one stream), read on from one segment to the
    next. A chunk at a time, every stream's keystream of a chunk added while the chunk is in
    cache: masking costs little more than the expansions themselves."""
    for segment in segments:
        if segment.dtype not in _DTYPES or segment.ndim != 1:
            raise BadRequest(f"masks apply to flat vectors of {' or '.join(np.dtype(d).name for d in WIDTHS.values())}",
                             code="bad_secure_input")
    streams = [(sign, Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()) for sign, seed in signed_seeds]
    zeros = np.zeros(MASK_CHUNK_BYTES, np.uint8)
    keystream = np.empty(MASK_CHUNK_BYTES + _CIPHER_SLACK, np.uint8)  # update_into wants this room past its input
    for segment in segments:
        step = MASK_CHUNK_BYTES // segment.itemsize
        for start in range(0, segment.size, step):
            chunk = segment[start:start + step]
            size = chunk.nbytes
            words = keystream[:size].view(segment.dtype)
            for sign, stream in streams:
                stream.update_into(zeros[:size], keystream)
                (np.add if sign > 0 else np.subtract)(chunk, words, out=chunk)


MASK_CHUNK_BYTES = 1 << 18  # a chunk of every stream stays in L2 while it is added
_CIPHER_SLACK = 15  # AES's block size less one
_DTYPES = tuple(np.dtype(d) for d in WIDTHS.values())


def expand(seed: bytes, count: int, width: int) -> np.ndarray:
    """``count`` integers modulo 2^width: PRG(seed), the mask ``add_masks`` adds for it."""
    out = np.zeros(count, WIDTHS[width])
    add_masks([out], [(1, seed)])
    return out


def pair_sign(me: str, peer: str) -> int:
    return 1 if me < peer else -1


def mask(update: np.ndarray, me: str, self_seed: bytes, pair_seeds: Mapping[str, bytes], width: int) -> np.ndarray:
    """``update`` (integers modulo 2^width) masked: plus PRG(self seed), plus or minus each
    pair's PRG(seed)."""
    if update.dtype != WIDTHS[width]:
        raise BadRequest(f"a masked input is a flat vector of {np.dtype(WIDTHS[width]).name}", code="bad_secure_input")
    masked = update.copy()
    add_masks([masked], [(1, self_seed), *((pair_sign(me, peer), seed) for peer, seed in pair_seeds.items())])
    return masked


# -- a client's input ----------------------------------------------------------------------------------
SAMPLES_SLOT = BOUND_TENSOR  # a masked input carries its sample count where a fixed-point partial sum carries its bound


def plain_input(tensors: Mapping[str, np.ndarray], samples: int, spec: fmt.ModelSpec, fixed_point: FixedPoint,
                clients: int) -> bytearray:
    """A client's input to a secure round before it is masked: a blob laid out as the job's
    fixed-point partial sums (``partial_spec``) holding what the hierarchy's fold would add for
    the update -- each tensor ``samples`` x round(w x 2^F), half to even, modulo 2^width -- and
    its sample count in the bound's slot, so that the sum of the round's inputs is a partial sum
    of the round and its sample count. Masked sums carry no overflow bound: the input is refused
    here unless ``clients`` such inputs cannot overflow."""
    if type(samples) is not int or samples < 1:
        raise BadRequest(f"a sample count is a positive integer, got {samples!r}", code="bad_secure_input")
    for t in spec.tensors:
        if t.dtype.kind != "f":
            raise BadRequest(f"secure aggregation masks float tensors; {t.name!r} is {t.dtype.name}", code="bad_secure_input")
        if t.name not in tensors or tuple(np.shape(tensors[t.name])) != t.shape:
            raise BadRequest(f"the update's {t.name!r} must be of shape {t.shape}", code="bad_secure_input")
    partial = partial_spec(spec, fixed_point)
    blob = bytearray(fmt.spec_header(partial)) + bytearray(partial.data_bytes)
    out = fmt.views(blob, fmt.parse_layout(blob, allow_partial=True))
    limit = (1 << (fixed_point.width - 1)) // clients  # the sum of `clients` inputs stays below 2^(width-1)
    scale = float(1 << fixed_point.frac_bits)
    for t in spec.tensors:
        q = np.rint(_as_float64(np.asarray(tensors[t.name]), t.dtype).ravel() * scale)
        largest = float(np.abs(q).max()) if q.size else 0.0
        if largest >= ROUNDING_LIMIT or samples * largest >= limit:
            raise Unprocessable(f"tensor {t.name!r}: |value| x 2^{fixed_point.frac_bits} x {samples} samples reaches "
                                f"{samples * largest:.3g}, beyond what {clients} inputs may sum to in {fixed_point.width} "
                                "bits: clip the update, or use fewer frac_bits", code="secure_input_overflow")
        out[t.name].reshape(-1)[:] = (q.astype(np.int64) * samples).astype(out[t.name].dtype)  # wraps modulo 2^width
    out[SAMPLES_SLOT][0] = samples
    return blob


def _as_float64(values: np.ndarray, dtype: fmt.DType) -> np.ndarray:
    if dtype is fmt.BF16:  # bfloat16 bits: the high half of a float32
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def segments(blob: Any) -> list[np.ndarray]:
    """The masked vector of an input (or of a sum of inputs): each tensor's elements, as unsigned
    integers of its width, in the spec's order (the sample count last)."""
    views = fmt.views(blob, fmt.parse_layout(blob, allow_partial=True))
    return [v.reshape(-1).view(np.uint64 if v.dtype.itemsize == 8 else np.uint32) for v in views.values()]


def unmasking_seeds(self_seeds: Mapping[str, bytes], dropped_keys: Mapping[str, bytes],
                    graph: Mapping[str, Sequence[str]], mask_publics: Mapping[str, bytes],
                    context: bytes) -> list[tuple[int, bytes]]:
    """The (sign, seed) streams whose sum ``add_masks`` adds to the sum of the survivors' masked
    inputs to leave their plain sum: minus each survivor's self mask, and minus the pair mask
    each survivor added for each neighbour that dropped after sharing (its key, rebuilt from
    shares, agrees the pair's seed with the survivor's public key)."""
    streams = [(-1, seed) for _, seed in sorted(self_seeds.items())]
    for dropped, private in sorted(dropped_keys.items()):
        for survivor in graph[dropped]:
            if survivor in self_seeds:
                streams.append((-pair_sign(survivor, dropped), agree(private, mask_publics[survivor], b"mask", context)))
    return streams


def round_context(job: str, round_id: int, round_seed: bytes) -> bytes:
    """What binds a round's secrets to it: every pair seed and share key is derived with it."""
    return job.encode() + b"\0" + struct.pack(">Q", round_id) + round_seed


# -- unmasking: what the server asks, what a client answers ---------------------------------------------
@dataclass(frozen=True)
class ShareRequest:
    """The server's ask after masked input collection: a share of the self-mask seed of every
    ``survivor`` (its masked input is in the sum) and of the mask key of every client ``dropped``
    after sharing (its pair masks must be removed)."""

    survivors: frozenset[str]
    dropped: frozenset[str]


def share_request(shared: Sequence[str], masked: Sequence[str], threshold: int) -> ShareRequest:
    """What to ask for, from the clients that shared their keys and those of them whose masked
    input arrived; fewer survivors than the threshold cannot be unmasked (the round is abandoned)."""
    survivors = frozenset(masked)
    if not survivors <= set(shared):
        raise BadRequest("a masked input from a client that did not share its keys", code="bad_secure_input")
    if len(survivors) < threshold:
        raise Unprocessable(f"{len(survivors)} clients sent masked inputs, fewer than the threshold of {threshold}",
                            code="below_threshold")
    return ShareRequest(survivors, frozenset(shared) - survivors)


def answer_request(me: str, held: Mapping[str, tuple[bytes, bytes]], request: ShareRequest) -> dict[str, tuple[str, bytes]]:
    """A client's answer: for each neighbour whose shares it holds (``held``: sender -> (self
    share, key share)), the one share the request calls for. Refused whole if the request names
    a client both survived and dropped, or names this client as dropped (it is answering)."""
    both = request.survivors & request.dropped
    if both:
        raise BadRequest(f"the request names {sorted(both)[0]!r} both survived and dropped: that would reveal its input",
                         code="both_shares_asked")
    if me in request.dropped:
        raise BadRequest(f"the request says {me!r} dropped, yet asks it for shares", code="inconsistent_request")
    answer = {}
    for sender, (self_share, key_share) in held.items():
        if sender in request.survivors:
            answer[sender] = (KIND_SELF, self_share)
        elif sender in request.dropped:
            answer[sender] = (KIND_KEY, key_share)
    return answer
