"""SecAgg+'s math (lifl.secagg), no I/O: the graph and its parameters, Shamir's sharing at and
below the threshold, key agreement, sealed shares, masks and unmasking requests. Whole rounds
are in tests/test_secagg_round.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable
import math
import secrets

import numpy as np
import pytest

from lifl import format as fmt
from lifl import secagg
from lifl.errors import BadRequest, Conflict, LiflError, Unprocessable
from lifl.fixedpoint import FixedPoint
from lifl.kernels import fold
from test_fixedpoint import Memory, memory_spec, random_update
from lifl.secagg import KIND_KEY, KIND_SELF, KeyPair, ShareRequest
from lifl.secagg_round import MaskedInputs, RoundSecrets

CONTEXT = secagg.round_context("job", 7, b"seed")


# -- parameters and graph ---------------------------------------------------------------------------
@pytest.mark.parametrize("clients, dropout, corruption, k, threshold", [
    (3, 0.0, 0.0, 2, 2),  # n - 1 = 2: everyone is everyone's neighbour
    (20, 0.0, 0.0, 2, 2),  # nobody may drop: a ring
    (20, 0.1, 0.0, 6, 4),
    (20, 0.3, 0.3, 14, 8),
    (100, 0.1, 0.1, 22, 12),
    (100, 0.3, 0.1, 62, 32),
    (500, 0.1, 0.1, 48, 25),
    (1000, 0.1, 0.1, 54, 28),  # the degree grows as the log of the population
    (10000, 0.1, 0.1, 64, 33),
    (8, 0.49, 0.0, 7, 4),  # 3 of 8 may drop: only the complete graph keeps 4 neighbours
])
def test_parameters(clients: int, dropout: float, corruption: float, k: int, threshold: int) -> None:
    params = secagg.choose_params(clients, dropout, corruption)
    assert (params.k, params.threshold) == (k, threshold)
    assert params.threshold > params.k / 2  # the server never gathers both shares of one client
    corrupt = math.floor(corruption * clients)
    # any two groups of signers share an honest client, and the survivors of the dropout it tolerates are enough
    assert 2 * params.signatures - clients > corrupt and clients - math.floor(dropout * clients) >= params.signatures
    assert 2 * (params.signatures - 1) - clients <= corrupt  # and no fewer would do


@pytest.mark.parametrize("clients, dropout, corruption", [(20, 0.1, 0.1), (100, 0.3, 0.1), (500, 0.1, 0.0)])
def test_the_degree_is_the_smallest_that_meets_both_bounds(clients: int, dropout: float, corruption: float) -> None:
    params = secagg.choose_params(clients, dropout, corruption)
    others, dropped, corrupt = clients - 1, math.floor(dropout * clients), math.floor(corruption * clients)

    def holds(k: int) -> bool:
        t = k // 2 + 1
        return (secagg._hypergeometric_below(others, others - dropped, k, t) <= 2.0 ** -secagg.CORRECTNESS_BITS / clients
                and secagg._hypergeometric_at_least(others, corrupt, k, t) <= 2.0 ** -secagg.SECURITY_BITS / clients)

    assert holds(params.k) and not holds(params.k - 2)


@pytest.mark.parametrize("clients, dropout, corruption, code", [
    (2, 0.0, 0.0, "bad_secure_aggregation"),
    (True, 0.0, 0.0, "bad_secure_aggregation"),
    (10, 0.5, 0.0, "bad_secure_aggregation"),
    (10, -0.1, 0.0, "bad_secure_aggregation"),
    (10, 0.0, "0.1", "bad_secure_aggregation"),
    (3, 0.45, 0.0, "secure_population_too_small"),  # 1 of 3 drops: the other 2 would need 2 surviving neighbours
    (7, 0.49, 0.0, "secure_population_too_small"),  # 3 of 7 drop: 3 of 6 neighbours left, 4 needed
    (100, 0.45, 0.1, "secure_population_too_small"),  # 55 survivors, 56 signatures needed: 10 may be corrupt
])
def test_parameters_refused(clients: object, dropout: object, corruption: object, code: str) -> None:
    with pytest.raises((BadRequest, Unprocessable)) as info:
        secagg.choose_params(clients, dropout, corruption)  # type: ignore[arg-type]
    assert info.value.code == code


@pytest.mark.parametrize("clients, k", [(10, 2), (10, 4), (11, 6), (30, 8), (7, 6), (7, 10)])
def test_the_graph_is_k_regular_symmetric_and_the_same_for_everyone(clients: int, k: int) -> None:
    names = [f"c{i}" for i in range(clients)]
    graph = secagg.neighbours(names, k, b"round seed")
    degree = min(k, clients - 1)
    assert set(graph) == set(names)
    for c, peers in graph.items():
        assert len(peers) == degree and c not in peers and list(peers) == sorted(peers)
        assert all(c in graph[p] for p in peers)
    assert secagg.neighbours(list(reversed(names)), k, b"round seed") == graph  # the order given does not matter
    if degree < clients - 1:
        assert secagg.neighbours(names, k, b"another round") != graph  # the ring is drawn anew each round


def test_graph_refusals() -> None:
    with pytest.raises(BadRequest):
        secagg.neighbours(["a", "b", "a", "c"], 2, b"s")
    with pytest.raises(BadRequest):
        secagg.neighbours([f"c{i}" for i in range(10)], 3, b"s")


# -- Shamir ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shares, threshold", [(1, 1), (3, 2), (5, 3), (6, 4), (12, 7)])
def test_any_threshold_shares_rebuild_the_secret_and_fewer_do_not(shares: int, threshold: int) -> None:
    secret = secrets.token_bytes(secagg.SEED_BYTES)
    xs = [3 * i + 1 for i in range(shares)]
    split = secagg.split_secret(secret, xs, threshold)
    assert set(split) == set(xs) and all(len(y) == secagg.SHARE_BYTES for y in split.values())
    for subset in itertools.islice(itertools.combinations(xs, threshold), 20):
        assert secagg.reconstruct({x: split[x] for x in subset}, threshold) == secret
    below = {x: split[x] for x in xs[: threshold - 1]}
    with pytest.raises(Unprocessable) as info:
        secagg.reconstruct(below, threshold)
    assert info.value.code == "below_threshold"
    if threshold > 1:  # interpolated as if t - 1 sufficed, they land on a random field element, not the secret
        with pytest.raises(Unprocessable) as info:
            secagg.reconstruct(below, threshold - 1)
        assert info.value.code == "bad_share"


def test_a_share_of_another_secret_is_detected() -> None:
    """Shares travel sealed (no one alters them on the way); one from another secret -- or random --
    moves the interpolated value to a random field element, above every 32-byte secret."""
    secret = secrets.token_bytes(secagg.SEED_BYTES)
    split = secagg.split_secret(secret, [1, 2, 3], 3)
    split[2] = secagg.split_secret(secrets.token_bytes(secagg.SEED_BYTES), [1, 2, 3], 3)[2]
    with pytest.raises(Unprocessable) as info:
        secagg.reconstruct(split, 3)
    assert info.value.code == "bad_share"
    with pytest.raises(BadRequest) as info2:
        secagg.reconstruct({1: b"short", 2: split[2], 3: split[3]}, 3)
    assert info2.value.code == "bad_share"
    with pytest.raises(BadRequest) as info2:
        secagg.reconstruct({1: b"\xff" * secagg.SHARE_BYTES, 2: split[2], 3: split[3]}, 3)  # not a field element
    assert info2.value.code == "bad_share"


@pytest.mark.parametrize("xs, threshold, secret", [
    ([1, 2], 3, bytes(32)),  # more needed than given
    ([1, 1, 2], 2, bytes(32)),  # a point twice
    ([0, 1, 2], 2, bytes(32)),  # the secret's own point
    ([1, 2, 3], 0, bytes(32)),
    ([1, 2, 3], 2, bytes(33)),  # longer than a seed
])
def test_splitting_refusals(xs: list[int], threshold: int, secret: bytes) -> None:
    with pytest.raises(BadRequest):
        secagg.split_secret(secret, xs, threshold)


# -- keys and sealed shares ---------------------------------------------------------------------------
def test_both_ends_agree_on_each_purpose_and_round_and_nothing_else() -> None:
    a, b, c = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    ab = secagg.agree(a.private, b.public, b"mask", CONTEXT)
    assert ab == secagg.agree(b.private, a.public, b"mask", CONTEXT)
    assert ab != secagg.agree(a.private, c.public, b"mask", CONTEXT)
    assert ab != secagg.agree(a.private, b.public, b"share", CONTEXT)
    assert ab != secagg.agree(a.private, b.public, b"mask", secagg.round_context("job", 8, b"seed"))
    assert KeyPair.from_private(a.private) == a
    for private, public in ((a.private[:31], b.public), (a.private, b.public + b"x"), (a.private, bytes(32))):
        with pytest.raises(BadRequest) as info:
            secagg.agree(private, public, b"mask", CONTEXT)  # bytes(32): a low-order point
        assert info.value.code == "bad_key"


def test_sealed_shares_open_only_for_their_pair_and_round() -> None:
    key = secrets.token_bytes(32)
    one, two = secrets.token_bytes(secagg.SHARE_BYTES), secrets.token_bytes(secagg.SHARE_BYTES)
    sealed = secagg.seal_shares(key, "u", "v", CONTEXT, one, two)
    assert secagg.open_shares(key, "u", "v", CONTEXT, sealed) == (one, two)
    flipped = bytes([sealed[0]]) + bytes([sealed[1] ^ 1]) + sealed[2:]
    for args in ((key, "v", "u", CONTEXT, sealed),  # redirected
                 (key, "u", "w", CONTEXT, sealed),
                 (key, "u", "v", secagg.round_context("job", 8, b"seed"), sealed),  # replayed into another round
                 (key, "u", "v", CONTEXT, flipped),
                 (key, "u", "v", CONTEXT, sealed[:-1]),
                 (key, "u", "v", CONTEXT, b""),
                 (secrets.token_bytes(32), "u", "v", CONTEXT, sealed)):
        with pytest.raises(BadRequest) as info:
            secagg.open_shares(*args)
        assert info.value.code == "bad_share"


# -- masks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width", [32, 64])
def test_expansion_is_deterministic_per_seed_and_exactly_long(width: int) -> None:
    seed = secrets.token_bytes(32)
    for count in (0, 1, 3, 1000, 4097):
        out = secagg.expand(seed, count, width)
        assert out.dtype == secagg.WIDTHS[width] and out.shape == (count,)
        np.testing.assert_array_equal(out, secagg.expand(seed, count, width))
    assert not np.array_equal(secagg.expand(seed, 64, width), secagg.expand(secrets.token_bytes(32), 64, width))
    np.testing.assert_array_equal(secagg.expand(seed, 1000, width)[:10], secagg.expand(seed, 10, width))  # one stream


def test_a_masked_input_looks_uniform() -> None:
    """A chi-square test of a masked update's bytes (each of 256 values, 2^20 draws) against the
    uniform law, whatever the update: here all zeros, then a constant."""
    seeds = {"b": secrets.token_bytes(32), "c": secrets.token_bytes(32)}
    for update in (np.zeros(1 << 18, np.uint32), np.full(1 << 18, 12345, np.uint32)):
        masked = secagg.mask(update, "a", secrets.token_bytes(32), seeds, 32)
        counts = np.bincount(masked.view(np.uint8), minlength=256)
        expected = masked.nbytes / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 340  # 255 degrees of freedom: p < 1e-4 beyond 340


def test_masks_run_on_across_segments_of_either_width_and_cancel_in_pairs() -> None:
    """A masked input of several tensors (model tensors in the job's width, a 64-bit sample count):
    one stream per seed reads on from segment to segment, so a pair's opposite masks cancel in
    the sum, and the keystream a segment gets is where the segments before it left off."""
    rng = np.random.default_rng(3)
    seed = secrets.token_bytes(32)

    def segments() -> list[np.ndarray]:
        return [rng.integers(0, 1 << 32, 5, dtype=np.uint32), rng.integers(0, 1 << 63, 3, dtype=np.uint64),
                rng.integers(0, 1 << 32, 70000, dtype=np.uint32)]  # longer than a chunk

    a, b = segments(), segments()
    plain = [x + y for x, y in zip(a, b)]
    secagg.add_masks(a, [(1, seed)])
    secagg.add_masks(b, [(-1, seed)])
    for x, y, z in zip(a, b, plain):
        np.testing.assert_array_equal(x + y, z)
    zeros = [np.zeros(5, np.uint32), np.zeros(3, np.uint64)]
    secagg.add_masks(zeros, [(1, seed)])
    stream = secagg.expand(seed, 8, 32).view(np.uint8)  # 32 bytes: 20 for the first segment, 24 for the second
    assert zeros[0].tobytes() == stream[:20].tobytes() and zeros[1].tobytes()[:12] == stream[20:].tobytes()


def test_mask_refuses_what_is_not_a_flat_vector_of_its_width() -> None:
    for update in (np.zeros(4, np.int32), np.zeros((2, 2), np.uint32), np.zeros(4, np.uint64)):
        with pytest.raises(BadRequest):
            secagg.mask(update, "a", bytes(32), {}, 32)


# -- unmasking requests ----------------------------------------------------------------------------
def test_too_few_masked_inputs_cannot_be_unmasked() -> None:
    with pytest.raises(Unprocessable) as info:
        secagg.share_request(["a", "b", "c", "d"], ["a"], 2)
    assert info.value.code == "below_threshold"
    with pytest.raises(BadRequest):
        secagg.share_request(["a", "b"], ["a", "z"], 1)  # z never shared its keys


def test_a_client_never_gives_both_shares_of_one_neighbour() -> None:
    held = {"b": (b"S" * 66, b"K" * 66), "c": (b"s" * 66, b"k" * 66)}
    assert secagg.answer_request("a", held, ShareRequest(frozenset({"b"}), frozenset({"c"}))) == {
        "b": (KIND_SELF, b"S" * 66), "c": (KIND_KEY, b"k" * 66)}
    for request, code in ((ShareRequest(frozenset({"b", "c"}), frozenset({"c"})), "both_shares_asked"),
                          (ShareRequest(frozenset({"b"}), frozenset({"a"})), "inconsistent_request")):
        with pytest.raises(BadRequest) as info:
            secagg.answer_request("a", held, request)
        assert info.value.code == code


# -- a client's input ------------------------------------------------------------------------------------
def consistency_case(signers: int, context: bytes = b"round") -> tuple[frozenset[str], dict[str, tuple[bytes, bytes]]]:
    survivors = frozenset(f"c{i}" for i in range(6))
    keys = {c: secagg.SigningKey.generate() for c in sorted(survivors)}
    return survivors, {c: (k.public, k.sign(context, survivors)) for c, k in list(keys.items())[:signers]}


def _forged(signatures: dict[str, tuple[bytes, bytes]]) -> dict[str, tuple[bytes, bytes]]:
    (first, (key, signature)), *rest = signatures.items()
    return {first: (key, bytes([signature[0] ^ 1]) + signature[1:]), **dict(rest)}


@pytest.mark.parametrize("change, code", [
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), sigs), None),
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), dict(list(sigs.items())[:3])), "too_few_signatures"),
    (lambda survivors, sigs: (ShareRequest(survivors - {"c5"}, frozenset({"c5"})), sigs), "inconsistent_request"),
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), _forged(sigs)), "bad_signature"),
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), {**sigs, "x": sigs["c0"]}), "bad_signature"),  # not a survivor
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), {**sigs, "c5": sigs["c0"]}), "bad_signature"),  # one key twice
    (lambda survivors, sigs: (ShareRequest(survivors, frozenset()), {"c0": (sigs["c0"][0], b"short"), **dict(
        list(sigs.items())[1:])}), "bad_signature"),
])
def test_a_client_answers_only_a_list_enough_survivors_signed(change: Callable[..., tuple[ShareRequest, dict]],
                                                              code: str | None) -> None:
    """The consistency check: the request is of the list this client signed, and 4 distinct
    survivors signed that very list with valid signatures."""
    survivors, signatures = consistency_case(4)
    request, shown = change(survivors, signatures)
    if code is None:
        secagg.check_consistency("c0", survivors, request, b"round", shown, 4)
        return
    with pytest.raises(BadRequest) as info:
        secagg.check_consistency("c0", survivors, request, b"round", shown, 4)
    assert info.value.code == code


def test_a_signature_covers_its_round_and_the_whole_list() -> None:
    key = secagg.SigningKey.generate()
    survivors = frozenset({"a", "bc"})
    signature = key.sign(b"round 1", survivors)
    signed_list = secagg.survivor_list(b"round 1", survivors)
    assert secagg.verify_signature(key.public, signature, secagg.survivor_list(b"round 1", {"bc", "a"}))
    for context, names in ((b"round 2", survivors), (b"round 1", {"a"}), (b"round 1", {"ab", "c"}), (b"round 1", {"abc"})):
        assert not secagg.verify_signature(key.public, signature, secagg.survivor_list(context, names))
    assert not secagg.verify_signature(secagg.SigningKey.generate().public, signature, signed_list)
    assert not secagg.verify_signature(b"short", signature, signed_list)
    assert not secagg.verify_signature(key.public, signature[:-1], signed_list)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
@pytest.mark.parametrize("fp", [FixedPoint(24, 64), FixedPoint(12, 32)])
def test_the_sum_of_plain_inputs_is_the_hierarchys_fixed_point_sum(dtype: str, fp: FixedPoint) -> None:
    """What clients mask adds up, bit for bit, to what the node's kernel folds from the same
    float updates and sample counts; the bound's slot sums the sample counts."""
    rng = np.random.default_rng(7)
    updates = [random_update(rng, dtype, 301) for _ in range(3)]
    floats = [{k: v for k, v in tensors.items() if k != "k"} for tensors, _ in updates]  # float tensors only
    weights = [3, 11, 40]
    memory = Memory(memory_spec(floats[0]), fp)
    acc, folded = memory.accumulator()
    fold(acc, [(memory.update(t, w).tensors, w) for t, w in zip(floats, weights)], init=True, frac_bits=fp.frac_bits)

    total = [np.zeros_like(s) for s in secagg.segments(folded)]
    for tensors, w in zip(floats, weights):
        for acc_segment, segment in zip(total, secagg.segments(secagg.plain_input(tensors, w, memory.spec, fp, 3))):
            acc_segment += segment
    expected = secagg.segments(folded)
    for got, want in zip(total[:-1], expected[:-1]):
        np.testing.assert_array_equal(got, want)
    assert int(total[-1][0]) == sum(weights)


def test_plain_inputs_refuse_what_could_overflow_or_is_not_float() -> None:
    spec = fmt.ModelSpec((fmt.TensorSpec("w", fmt.F32, (2,)),))
    fp = FixedPoint(24, 32)
    secagg.plain_input({"w": np.array([1.0, -1.0], np.float32)}, 10, spec, fp, 10)  # 10 x 2^24 x 10 < 2^31
    for tensors, samples, clients, code in (({"w": np.array([1.0, -1.0], np.float32)}, 10, 13, "secure_input_overflow"),
                                            ({"w": np.array([1e9, 0.0], np.float32)}, 1, 2, "secure_input_overflow"),
                                            ({"w": np.zeros(3, np.float32)}, 1, 2, "bad_secure_input"),
                                            ({}, 1, 2, "bad_secure_input"),
                                            ({"w": np.zeros(2, np.float32)}, 0, 2, "bad_secure_input")):
        with pytest.raises(LiflError) as info:
            secagg.plain_input(tensors, samples, spec, fp, clients)
        assert info.value.code == code
    with pytest.raises(BadRequest):
        secagg.plain_input({"k": np.zeros(2, np.int32)}, 1, fmt.ModelSpec((fmt.TensorSpec("k", fmt.I32, (2,)),)), fp, 2)


@pytest.mark.parametrize("change, norm, expected_scale", [
    ([3.0, 4.0, 0.0], 1.0, 0.2),  # |change| 5: clipped to 1
    ([3.0, 4.0, 0.0], 5.0, 1.0),  # at the norm: unchanged
    ([0.3, 0.4, 0.0], 1.0, 1.0),  # within it
    ([0.0, 0.0, 0.0], 1.0, 1.0),  # no change stays none
])
def test_a_client_clips_its_change_over_all_its_float_tensors(change: list[float], norm: float, expected_scale: float) -> None:
    from lifl.client.secure import clip_change

    base = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([-1.0], np.float64)}
    update = {"a": (base["a"] + np.array(change[:2])).astype(np.float32), "b": base["b"] + change[2:]}
    got = clip_change(update, base, norm)
    for k in base:
        assert got[k].dtype == update[k].dtype
        np.testing.assert_allclose(got[k], base[k] + expected_scale * (update[k].astype(np.float64) - base[k]), rtol=1e-6)
    with pytest.raises(BadRequest, match="no tensor 'a'"):
        clip_change(update, {"b": base["b"]}, norm)


# -- where the masks come off: each task, its own clients' ---------------------------------------
@pytest.mark.parametrize("groups", [
    [["a", "b", "c", "d", "e", "f"]],  # one task sums everyone (a lone top)
    [["a", "b"], ["c", "d"], ["e", "f"]],  # leaves of two
    [["a"], ["b", "c", "d", "e"], ["f"]],  # uneven, lone inputs among them
    [["f"], ["e"], ["d"], ["c"], ["b"], ["a"]],
])
def test_each_task_taking_off_its_own_clients_masks_leaves_the_survivors_plain_sum(groups: list[list[str]]) -> None:
    """Eight clients on a 4-regular graph, g and h dropped after sharing: however the survivors'
    masked inputs are cut into tasks, each task's sum with its clients' streams taken off adds up
    to the survivors' plain sum; no task's sum alone is its clients' plain sum while a survivor
    outside it shares a pair mask with them."""
    clients = ["a", "b", "c", "d", "e", "f", "g", "h"]
    survivors = [c for g in groups for c in g]
    context = secagg.round_context("job", 3, b"seed")
    graph = secagg.neighbours(clients, 4, b"seed")
    keys = {c: KeyPair.generate() for c in clients}
    self_seeds = {c: secrets.token_bytes(32) for c in clients}
    rng = np.random.default_rng(4)
    plain = {c: rng.integers(0, 1 << 32, 1000, dtype=np.uint32) for c in clients}
    masked = {c: secagg.mask(plain[c], c, self_seeds[c],
                             {p: secagg.agree(keys[c].private, keys[p].public, b"mask", context) for p in graph[c]}, 32)
              for c in survivors}
    rebuilt = RoundSecrets(3, {c: self_seeds[c] for c in survivors}, {d: keys[d].private for d in ("g", "h")}, graph,
                           {c: k.public for c, k in keys.items()}, context)
    total = np.zeros(1000, np.uint32)
    for group in groups:
        task_sum = sum((masked[c] for c in group), np.zeros(1000, np.uint32))
        secagg.add_masks([task_sum], rebuilt.streams_of(frozenset(group)))
        crossing = any(p in survivors and p not in group for c in group for p in graph[c])
        assert crossing != np.array_equal(task_sum, sum((plain[c] for c in group), np.zeros(1000, np.uint32)))
        total += task_sum
    np.testing.assert_array_equal(total, sum((plain[c] for c in survivors), np.zeros(1000, np.uint32)))
    with pytest.raises(Conflict) as info:
        rebuilt.streams_of(frozenset({"a", "g"}))  # g's input is in no sum
    assert info.value.code == "not_a_survivor" and "'g'" in info.value.message


def test_a_node_knows_whose_inputs_each_task_summed_up() -> None:
    inputs = MaskedInputs()
    for key, client in ((b"k1", "a"), (b"k2", "b"), (b"k3", "c"), (b"k4", "d")):
        inputs.submitted(key, client)
    inputs.folded(7, [b"k1", b"k2", b"partial"])  # a partial sum is of no client
    inputs.folded(7, [b"k3"])
    assert inputs.clients(7) == {"a", "b", "c"}
    assert inputs.clients(8, [b"k4"]) == {"d"}  # a lone input, held unfolded
    assert inputs.clients(9) == frozenset()  # a middle: partial sums only
    for bad in ([b"k1"], [b"nothing"]):  # folded already by another task; never a masked input
        with pytest.raises(BadRequest) as info:
            inputs.clients(8, bad)
        assert info.value.code == "bad_secure_input"
    with pytest.raises(BadRequest):
        inputs.submitted(b"k5", "")
