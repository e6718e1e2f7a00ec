"""FLStore's workloads against naive float64 references: every model flattened, every delta an
explicit array. Models hold float32 and float16 tensors (float64 too in the "mixed" spec), a
transposed (non-contiguous) client tensor, and an int64 counter that every workload ignores;
all arrays are read-only, as the shared-memory views are."""

from __future__ import annotations

import json
import math
import tracemalloc
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from lifl.errors import BadRequest
from lifl.flstore import workloads as wl
from lifl.flstore.workloads import ClientUpdate, RoundData, Tensors

Spec = dict[str, tuple[tuple[int, ...], type]]
SPECS: dict[str, Spec] = {
    "narrow": {"conv.weight": ((4, 3, 3), np.float32), "fc.weight": ((5, 7), np.float16), "fc.bias": ((5,), np.float32)},
    "mixed": {"conv.weight": ((4, 3, 3), np.float32), "fc.weight": ((5, 7), np.float16), "fc.bias": ((5,), np.float32),
              "head.weight": ((3, 4), np.float64)},
}
COUNTER = "bn.num_batches_tracked"
TRANSPOSED = "fc.weight"  # stored transposed in every client: a non-contiguous view


# -- building rounds -------------------------------------------------------------------------------


def frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def store(name: str, value: np.ndarray, dtype: type, transposed: bool) -> np.ndarray:
    if transposed and name == TRANSPOSED:
        return frozen(np.ascontiguousarray(value.T.astype(dtype)).T)
    return frozen(value.astype(dtype))


def random_delta(rng: np.random.Generator, spec: Spec, scale: float = 0.1) -> dict[str, np.ndarray]:
    return {name: scale * rng.standard_normal(shape) for name, (shape, _) in spec.items()}


def make_round(rng: np.random.Generator, deltas: Sequence[dict[str, np.ndarray]], *, spec: Spec = SPECS["narrow"],
               aggregate: str = "fedavg", round_id: int = 1, clients: Sequence[str] | None = None,
               samples: Sequence[int] | None = None) -> RoundData:
    """aggregate: "fedavg" (FedAvg of the stored models, in their dtypes), "exact" (kept in
    float64) or "none"."""
    clients = list(clients or [f"c{i}" for i in range(len(deltas))])
    samples = list(samples or rng.integers(10, 100, len(deltas)).tolist())
    base_values = {name: rng.standard_normal(shape) for name, (shape, _) in spec.items()}
    base = {name: store(name, base_values[name], dtype, False) for name, (_, dtype) in spec.items()}
    base[COUNTER] = frozen(np.array(7, np.int64))
    updates = []
    for client, count, delta in zip(clients, samples, deltas):
        tensors = {name: store(name, base_values[name] + delta[name], dtype, True) for name, (_, dtype) in spec.items()}
        tensors[COUNTER] = frozen(np.array(int(rng.integers(1000)), np.int64))
        updates.append(ClientUpdate(client, count, tensors))
    result = None
    if aggregate != "none":
        weights = np.array(samples, np.float64) / sum(samples)
        result = {}
        for name, (_, dtype) in spec.items():
            mean = sum(w * np.asarray(u.tensors[name], np.float64) for w, u in zip(weights, updates))
            result[name] = frozen(mean if aggregate == "exact" else mean.astype(dtype))
        result[COUNTER] = frozen(np.array(8, np.int64))
    return RoundData(round=round_id, version=round_id + 40, base=base, aggregate=result, updates=updates)


def attack_round(rng: np.random.Generator, honest: int, attacks: Sequence[str], **kwargs: Any) -> RoundData:
    """Honest clients follow a common direction; "scaled" sends 10x an honest update, "flipped"
    the opposite of one."""
    common = random_delta(rng, SPECS["narrow"])
    deltas = [{k: v + 0.3 * noise for (k, v), noise in zip(common.items(), random_delta(rng, SPECS["narrow"]).values())}
              for _ in range(honest + len(attacks))]
    for i, attack in enumerate(attacks, start=honest):
        factor = 10.0 if attack == "scaled" else -1.0
        deltas[i] = {k: factor * v for k, v in deltas[i].items()}
    return make_round(rng, deltas, **kwargs)


# -- naive references ------------------------------------------------------------------------------


def float_names(tensors: Tensors) -> list[str]:
    return [name for name, array in tensors.items() if array.dtype.kind == "f"]


def flatten(tensors: Tensors, names: Sequence[str]) -> np.ndarray:
    return np.concatenate([np.asarray(tensors[name], np.float64).ravel() for name in names])


def ref_deltas(rnd: RoundData, names: Sequence[str] | None = None) -> tuple[list[np.ndarray], np.ndarray | None]:
    names = names or float_names(rnd.base)
    base = flatten(rnd.base, names)
    deltas = [flatten(u.tensors, names) - base for u in rnd.updates]
    change = flatten(rnd.aggregate, names) - base if rnd.aggregate is not None else None
    return deltas, change


def ref_cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def ref_robust_z(values: Sequence[float]) -> np.ndarray:
    x = np.array(values, np.float64)
    median = np.median(x)
    mad = np.median(np.abs(x - median))
    if mad > 0:
        return (x - median) / (1.4826 * mad)
    mean_ad = np.mean(np.abs(x - median))
    return (x - median) / (1.253314 * mean_ad) if mean_ad > 0 else np.zeros_like(x)


def ref_krum(deltas: list[np.ndarray], f: int) -> list[float]:
    n = len(deltas)
    scores = []
    for i in range(n):
        distances = sorted(float(np.sum((deltas[i] - deltas[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(distances[: n - f - 2]))
    return scores


def assert_plain(value: Any) -> None:
    """JSON-able with plain Python types only (no numpy scalars), and no NaN."""
    json.dumps(value, allow_nan=False)

    def walk(item: Any) -> None:
        assert type(item) in (dict, list, str, int, float, bool, type(None)), type(item)
        if isinstance(item, dict):
            assert all(type(key) is str for key in item)
            for child in item.values():
                walk(child)
        elif isinstance(item, list):
            for child in item:
                walk(child)

    walk(value)


def raises_code(code: str, call: Any, *args: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        call(*args)
    assert info.value.code == code, info.value.message
    return info.value


# -- gram ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["narrow", "mixed"])
@pytest.mark.parametrize("block", [1, 5, 64, 1 << 16])
@pytest.mark.parametrize("relative", [False, True])
def test_gram_matches_naive(spec: str, block: int, relative: bool) -> None:
    rng = np.random.default_rng(1)
    rnd = make_round(rng, [random_delta(rng, SPECS[spec]) for _ in range(5)], spec=SPECS[spec])
    vectors = [u.tensors for u in rnd.updates] + [rnd.aggregate]
    names = float_names(rnd.base)
    origin = flatten(rnd.base, names) if relative else 0.0
    flat = [flatten(v, names) - origin for v in vectors]
    reference = np.array([[a @ b for b in flat] for a in flat])
    got = wl.gram(vectors, names, block=block, origin=rnd.base if relative else None)
    scale = np.outer(np.sqrt(np.diag(reference)), np.sqrt(np.diag(reference)))
    assert got.dtype == np.float64 and got.shape == (6, 6)
    assert np.all(np.abs(got - reference) <= 1e-6 * scale)


def test_gram_per_tensor_and_edge_cases() -> None:
    rng = np.random.default_rng(2)
    rnd = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)])
    vectors = [u.tensors for u in rnd.updates]
    flat = [flatten(v, ["fc.weight"]) - flatten(rnd.base, ["fc.weight"]) for v in vectors]
    got = wl.gram(vectors, ["fc.weight"], origin=rnd.base)
    assert np.allclose(got, [[a @ b for b in flat] for a in flat], rtol=1e-6)
    assert wl.gram([], ["fc.weight"]).shape == (0, 0)
    assert np.array_equal(wl.gram(vectors, []), np.zeros((3, 3)))
    with pytest.raises(ValueError):
        wl.gram(vectors, ["fc.weight"], block=0)


@pytest.mark.parametrize("order", ["C", "F"])
def test_gram_copies_no_update(order: str) -> None:
    """Peak allocation stays at the scratch's size, far below one update's (4 MB), whether
    the views flatten (C order) or are read through flat iterators (F order)."""
    rng = np.random.default_rng(3)
    vectors = [{"w": frozen(np.asarray(rng.standard_normal((1000, 1000), np.float32), order=order))} for _ in range(7)]
    tracemalloc.start()
    try:
        wl.gram(vectors[:6], ["w"], block=1 << 14, origin=vectors[6])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


# -- cosine ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["narrow", "mixed"])
@pytest.mark.parametrize("against", ["aggregate", "clients"])
def test_cosine_matches_naive(spec: str, against: str) -> None:
    rng = np.random.default_rng(4)
    deltas = [random_delta(rng, SPECS[spec]) for _ in range(6)]
    deltas[2] = {k: np.zeros_like(v) for k, v in deltas[2].items()}  # a client that did not move
    rnd = make_round(rng, deltas, spec=SPECS[spec])
    result = wl.cosine(rnd, {"against": against})
    assert_plain(result)
    d, change = ref_deltas(rnd)
    assert result["clients"] == [u.client for u in rnd.updates]
    assert np.allclose(result["norms"], [np.linalg.norm(x) for x in d], rtol=1e-6)
    assert result["norms"][2] == 0.0
    if against == "aggregate":
        assert change is not None
        assert np.allclose(result["cosine"], [ref_cos(x, change) for x in d], atol=1e-6)
        assert result["cosine"][2] == 0.0
    else:
        assert np.allclose(result["matrix"], [[ref_cos(a, b) for b in d] for a in d], atol=1e-6)
        assert result["matrix"][2] == [0.0] * 6


def test_cosine_needs_the_aggregate_only_against_it() -> None:
    rng = np.random.default_rng(5)
    rnd = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)], aggregate="none")
    raises_code("no_aggregate", wl.cosine, rnd, {})
    assert len(wl.cosine(rnd, {"against": "clients"})["matrix"]) == 3


# -- filter ----------------------------------------------------------------------------------------


def ref_filter(rnd: RoundData, f: int | None, norm_z: float = 3.0, krum_z: float = 3.0, min_cosine: float = 0.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    d, change = ref_deltas(rnd)
    n = len(d)
    norms = [float(np.linalg.norm(x)) for x in d]
    cosines = [ref_cos(x, change) for x in d] if change is not None else None
    krum = ref_krum(d, f) if f is not None else None
    rules: list[list[str]] = [[] for _ in range(n)]
    for i, z in enumerate(ref_robust_z(norms)):
        if abs(z) > norm_z:
            rules[i].append("norm")
    if krum is not None:
        for i, z in enumerate(ref_robust_z(krum)):
            if z > krum_z:
                rules[i].append("krum")
    if cosines is not None:
        for i, c in enumerate(cosines):
            if c < min_cosine:
                rules[i].append("cosine")
    clients = [{"client": u.client, "norm": norms[i], "cosine": cosines[i] if cosines else None,
                "krum": krum[i] if krum else None} for i, u in enumerate(rnd.updates)]
    return clients, [{"client": u.client, "rules": r} for u, r in zip(rnd.updates, rules) if r]


def assert_scores(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [c["client"] for c in got] == [c["client"] for c in want]
    for g, w in zip(got, want):
        assert math.isclose(g["norm"], w["norm"], rel_tol=1e-6)
        for key, tolerance in (("cosine", 1e-6), ("krum", 1e-5)):
            assert (g[key] is None) == (w[key] is None)
            if w[key] is not None:
                assert math.isclose(g[key], w[key], rel_tol=tolerance, abs_tol=tolerance)


@pytest.mark.parametrize("honest, attacks, aggregate, params, f, expected", [
    # default f for 10 clients: (10 - 3) // 2 = 3
    # the flipped update is as long as an honest one, but far from all of them (Krum) and against the change
    (8, ["scaled", "flipped"], "fedavg", {}, 3, {"c8": ["norm", "krum"], "c9": ["krum", "cosine"]}),
    (8, ["scaled", "flipped"], "none", {}, 3, {"c8": ["norm", "krum"], "c9": ["krum"]}),
    (8, ["scaled", "flipped"], "fedavg", {"f": 1, "min_cosine": -1.0, "exclude": True}, 1, {"c8": ["norm", "krum"], "c9": ["krum"]}),
    (8, [], "fedavg", {}, 2, {}),
    (2, ["flipped"], "fedavg", {}, 0, None),  # n = 3: f clipped to 0
    (1, ["flipped"], "fedavg", {}, None, None),  # n = 2: no Krum
])
def test_filter_matches_naive(honest: int, attacks: list[str], aggregate: str, params: dict[str, Any], f: int | None,
                              expected: dict[str, list[str]] | None) -> None:
    rng = np.random.default_rng(6)
    rnd = attack_round(rng, honest, attacks, aggregate=aggregate)
    result = wl.filter(rnd, params)
    assert_plain(result)
    want_clients, want_suspects = ref_filter(rnd, f, min_cosine=params.get("min_cosine", 0.0))
    assert_scores(result["clients"], want_clients)
    assert result["suspects"] == want_suspects
    if expected is not None:
        assert {s["client"]: s["rules"] for s in result["suspects"]} == expected
    rules = result["rules"]
    assert (rules["f"], rules["norm_z"], rules["krum_z"]) == (f, 3.0, 3.0)
    assert rules["min_cosine"] == params.get("min_cosine", 0.0)
    assert result["exclude"] is params.get("exclude", False)
    assert any("krum" in note for note in rules["notes"]) == (f is None)
    assert any("aggregate" in note for note in rules["notes"]) == (aggregate == "none")


@pytest.mark.parametrize("outlier, suspects", [(5.0, ["c4"]), (1.0, [])])
def test_filter_zero_mad_falls_back_on_mean_deviation(outlier: float, suspects: list[str]) -> None:
    """Four identical updates make the MAD 0; an update 5x as large still stands out, and
    nobody does when all five are identical."""
    rng = np.random.default_rng(7)
    delta = random_delta(rng, SPECS["narrow"])
    rnd = make_round(rng, [delta] * 4 + [{k: outlier * v for k, v in delta.items()}], aggregate="none")
    result = wl.filter(rnd, {"krum_z": 1e9})
    assert [s["client"] for s in result["suspects"]] == suspects
    assert all(s["rules"] == ["norm"] for s in result["suspects"])


def test_filter_f_too_large_for_the_round() -> None:
    rng = np.random.default_rng(8)
    rnd = attack_round(rng, 5, [])
    assert wl.filter(rnd, {"f": 2})["rules"]["f"] == 2  # n - f - 2 = 1: the limit
    raises_code("bad_query", wl.filter, rnd, {"f": 3})


# -- cluster ---------------------------------------------------------------------------------------


def separated_round(rng: np.random.Generator, sizes: Sequence[int], **kwargs: Any) -> tuple[RoundData, list[int]]:
    """Clusters of updates around far-apart centres; returns the round and the true labels."""
    centres = [random_delta(rng, SPECS["narrow"], scale=1.0) for _ in sizes]
    truth = [c for c, size in enumerate(sizes) for _ in range(size)]
    order = rng.permutation(len(truth)).tolist()
    truth = [truth[i] for i in order]
    deltas = [{k: v + 0.01 * rng.standard_normal(v.shape) for k, v in centres[c].items()} for c in truth]
    return make_round(rng, deltas, **kwargs), truth


def ref_cluster_distances(rnd: RoundData, labels: list[int], k: int) -> np.ndarray:
    d, _ = ref_deltas(rnd)
    centroids = [np.mean([x for x, label in zip(d, labels) if label == c], axis=0) for c in range(k)]
    return np.array([[float(np.sum((x - m) ** 2)) for m in centroids] for x in d])


def assert_inertia(rnd: RoundData, inertia: float, labels: list[int], k: int) -> None:
    """The inertia of the returned assignments, to 1e-6 of the updates' total squared norm: it
    is a difference of Gram entries, as accurate as they are relative to the updates' size."""
    d, _ = ref_deltas(rnd)
    distances = ref_cluster_distances(rnd, labels, k)
    energy = sum(float(x @ x) for x in d)
    assert math.isclose(inertia, sum(distances[i, c] for i, c in enumerate(labels)), rel_tol=1e-6, abs_tol=1e-6 * energy)


def same_partition(a: Sequence[int], b: Sequence[int]) -> bool:
    return len({(x, y) for x, y in zip(a, b)}) == len(set(a)) == len(set(b))


@pytest.mark.parametrize("sizes, select, picks", [
    ([6, 3, 1], 1, [1, 0, 0]),
    ([6, 3, 1], 3, [1, 1, 1]),  # largest remainder gives [2, 1, 0]; one per cluster wins
    ([6, 3, 1], 5, [3, 1, 1]),
    ([6, 3, 1], None, [1, 1, 1]),  # select defaults to k
    ([6, 3, 1], 10, [6, 3, 1]),
    ([5, 5], 4, [2, 2]),
    ([7], 3, [3]),
])
def test_cluster_recovers_separated_clusters(sizes: list[int], select: int | None, picks: list[int]) -> None:
    rng = np.random.default_rng(9)
    rnd, truth = separated_round(rng, sizes)
    params: dict[str, Any] = {"k": len(sizes), "seed": 3}
    if select is not None:
        params["select"] = select
    result = wl.cluster(rnd, params)
    assert_plain(result)
    clients = [u.client for u in rnd.updates]
    labels = [result["assignments"][c] for c in clients]
    assert same_partition(labels, truth)
    assert labels[0] == 0 and sorted(set(labels)) == list(range(len(sizes)))  # numbered by first appearance
    assert result["sizes"] == [labels.count(c) for c in range(len(sizes))]
    assert_inertia(rnd, result["inertia"], labels, len(sizes))
    distances = ref_cluster_distances(rnd, labels, len(sizes))
    # picks per cluster (clusters ordered by size here), each the members closest to its centroid
    by_size = sorted(range(len(sizes)), key=lambda c: -result["sizes"][c])
    chosen = [[clients.index(c) for c in result["selection"] if labels[clients.index(c)] == label] for label in by_size]
    assert [len(members) for members in chosen] == picks
    for label, members in zip(by_size, chosen):
        ranked = sorted((i for i in range(len(clients)) if labels[i] == label), key=lambda i: distances[i, label])
        assert sorted(members) == sorted(ranked[: len(members)])
    assert wl.cluster(rnd, params) == result  # deterministic


@pytest.mark.parametrize("k, seed", [(2, 0), (3, 1), (4, 2)])
def test_cluster_inertia_matches_the_assignments(k: int, seed: int) -> None:
    """Random (not clustered) updates: whatever the partition, the inertia is its own."""
    rng = np.random.default_rng(10 + k)
    rnd = make_round(rng, [random_delta(rng, SPECS["mixed"]) for _ in range(9)], spec=SPECS["mixed"], aggregate="none")
    result = wl.cluster(rnd, {"k": k, "seed": seed})
    labels = [result["assignments"][u.client] for u in rnd.updates]
    assert_inertia(rnd, result["inertia"], labels, k)
    distances = ref_cluster_distances(rnd, labels, k)
    # a fixed point of Lloyd: every update is at its nearest centroid
    assert all(distances[i, c] <= distances[i].min() * (1 + 1e-6) for i, c in enumerate(labels))


def test_cluster_at_the_limits() -> None:
    rng = np.random.default_rng(11)
    rnd = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(wl.MAX_CLUSTERS)], aggregate="none")
    result = wl.cluster(rnd, {"k": wl.MAX_CLUSTERS, "iterations": wl.MAX_ITERATIONS, "select": wl.MAX_CLUSTERS})
    assert result["sizes"] == [1] * wl.MAX_CLUSTERS and result["inertia"] == 0.0
    assert sorted(result["selection"]) == sorted(u.client for u in rnd.updates)
    raises_code("bad_query", wl.cluster, rnd, {"k": wl.MAX_CLUSTERS + 1})
    raises_code("bad_query", wl.cluster, rnd, {"iterations": wl.MAX_ITERATIONS + 1})
    small = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)])
    raises_code("bad_query", wl.cluster, small, {"k": 4})  # more clusters than clients
    raises_code("bad_query", wl.cluster, small, {"k": 2, "select": 4})  # more picks than clients
    assert len(wl.cluster(small, {"k": 3, "select": 3})["selection"]) == 3


def test_cluster_identical_updates() -> None:
    """All distances 0: seeding and Lloyd still end, every cluster non-empty."""
    rng = np.random.default_rng(12)
    delta = random_delta(rng, SPECS["narrow"])
    rnd = make_round(rng, [delta] * 6)
    result = wl.cluster(rnd, {"k": 3})
    assert sum(result["sizes"]) == 6 and min(result["sizes"]) >= 1
    assert result["inertia"] < 1e-9


# -- reputation ------------------------------------------------------------------------------------


def reputation_rounds(rng: np.random.Generator) -> list[RoundData]:
    first = attack_round(rng, 4, ["flipped"], round_id=3, clients=["a", "b", "c", "d", "e"])
    second = attack_round(rng, 5, ["scaled"], round_id=4, clients=["a", "b", "f", "g", "h", "e"], aggregate="none")
    third = attack_round(rng, 3, [], round_id=7, clients=["b", "c", "f"])
    return [first, second, third]


def ref_reputation(rounds: list[RoundData], decay: float) -> dict[str, dict[str, Any]]:
    seen: dict[str, dict[str, list[Any]]] = {}
    for position, rnd in enumerate(rounds):
        age = len(rounds) - 1 - position
        d, change = ref_deltas(rnd)
        flagged = np.abs(ref_robust_z([np.linalg.norm(x) for x in d])) > 3.0
        for i, u in enumerate(rnd.updates):
            entry = seen.setdefault(u.client, {"w": [], "q": [], "rounds": [], "cos": [], "flagged": []})
            cos = ref_cos(d[i], change) if change is not None else None
            quality = 0.0 if flagged[i] else (max(0.0, cos) if cos is not None else 1.0)
            entry["w"].append(decay**age)
            entry["q"].append(quality)
            entry["rounds"].append(rnd.round)
            if cos is not None:
                entry["cos"].append(cos)
            if flagged[i]:
                entry["flagged"].append(rnd.round)
    return {client: {"score": sum(w * q for w, q in zip(e["w"], e["q"])) / sum(e["w"]), "rounds": e["rounds"],
                     "mean_cosine": float(np.mean(e["cos"])) if e["cos"] else None, "flagged": e["flagged"]}
            for client, e in seen.items()}


@pytest.mark.parametrize("decay", [0.5, 1.0, 0.1])
def test_reputation_matches_naive(decay: float) -> None:
    rng = np.random.default_rng(13)
    rounds = reputation_rounds(rng)
    result = wl.reputation(rounds, {"decay": decay})
    assert_plain(result)
    assert result["rounds"] == [3, 4, 7]
    want = ref_reputation(rounds, decay)
    assert list(result["clients"]) == list(want)
    for client, entry in want.items():
        got = result["clients"][client]
        assert math.isclose(got["score"], entry["score"], rel_tol=1e-6, abs_tol=1e-9), client
        assert (got["rounds"], got["flagged"]) == (entry["rounds"], entry["flagged"])
        assert (got["mean_cosine"] is None) == (entry["mean_cosine"] is None)
        if entry["mean_cosine"] is not None:
            assert math.isclose(got["mean_cosine"], entry["mean_cosine"], rel_tol=1e-6, abs_tol=1e-6)
    assert 4 in result["clients"]["e"]["flagged"] and result["clients"]["h"]["mean_cosine"] is None


def test_reputation_survives_decay_underflow() -> None:
    """decay**age underflows to 0 for a client seen only long ago: its score is still its own."""
    rng = np.random.default_rng(14)
    rounds = reputation_rounds(rng)
    result = wl.reputation(rounds, {"decay": 1e-300})
    d, change = ref_deltas(rounds[0])
    assert math.isclose(result["clients"]["d"]["score"], max(0.0, ref_cos(d[3], change)), rel_tol=1e-6)


def test_reputation_needs_rounds_in_order() -> None:
    rng = np.random.default_rng(15)
    rounds = reputation_rounds(rng)
    raises_code("bad_inputs", wl.reputation, rounds[::-1], {})
    raises_code("bad_inputs", wl.reputation, [rounds[0], rounds[0]], {})
    raises_code("bad_inputs", wl.reputation, [], {})


# -- provenance ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["narrow", "mixed"])
@pytest.mark.parametrize("tensor", [None, "conv.weight", "fc.weight"])
def test_provenance_matches_naive(spec: str, tensor: str | None) -> None:
    rng = np.random.default_rng(16)
    rnd = make_round(rng, [random_delta(rng, SPECS[spec]) for _ in range(5)], spec=SPECS[spec], aggregate="exact")
    result = wl.provenance(rnd, {"tensor": tensor} if tensor else {})
    assert_plain(result)
    samples = [u.samples for u in rnd.updates]
    weights = [s / sum(samples) for s in samples]
    assert (result["round"], result["version"], result["new_version"]) == (1, 41, 42)
    assert result["clients"] == [{"client": u.client, "samples": u.samples, "weight": pytest.approx(w, rel=1e-12)}
                                 for u, w in zip(rnd.updates, weights)]
    d, change = ref_deltas(rnd)
    shares = [w * (x @ change) / (change @ change) for w, x in zip(weights, d)]
    assert [s["client"] for s in result["share"]] == [u.client for u in rnd.updates]
    assert np.allclose([s["share"] for s in result["share"]], shares, atol=1e-6)
    assert math.isclose(sum(s["share"] for s in result["share"]), 1.0, abs_tol=1e-6)  # the aggregate is their FedAvg
    if tensor is None:
        assert "tensor" not in result
        return
    d, change = ref_deltas(rnd, [tensor])
    part = result["tensor"]
    assert part["name"] == tensor and math.isclose(part["change_norm"], np.linalg.norm(change), rel_tol=1e-6)
    for got, w, x in zip(part["contributions"], weights, d):
        assert math.isclose(got["norm"], w * np.linalg.norm(x), rel_tol=1e-6)
        assert math.isclose(got["share"], w * (x @ change) / (change @ change), abs_tol=1e-6)
    assert math.isclose(sum(c["share"] for c in part["contributions"]), 1.0, abs_tol=1e-6)


@pytest.mark.parametrize("params, aggregate, samples, code", [
    ({"tensor": "nope"}, "exact", None, "no_such_tensor"),
    ({"tensor": COUNTER}, "exact", None, "bad_query"),  # an int tensor takes no part
    ({"tensor": ""}, "exact", None, "bad_query"),
    ({}, "none", None, "no_aggregate"),
    ({}, "exact", [0, 0, 0], "bad_inputs"),
])
def test_provenance_refuses(params: dict[str, Any], aggregate: str, samples: list[int] | None, code: str) -> None:
    rng = np.random.default_rng(17)
    rnd = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)], aggregate=aggregate)
    if samples is not None:
        updates = [ClientUpdate(u.client, count, u.tensors) for u, count in zip(rnd.updates, samples)]
        rnd = RoundData(rnd.round, rnd.version, rnd.base, rnd.aggregate, updates)
    raises_code(code, wl.provenance, rnd, params)


def test_provenance_of_a_round_that_changed_nothing() -> None:
    rng = np.random.default_rng(18)
    zero = {k: np.zeros_like(v) for k, v in random_delta(rng, SPECS["narrow"]).items()}
    rnd = make_round(rng, [zero, zero], aggregate="none")
    rnd = RoundData(rnd.round, rnd.version, rnd.base, rnd.base, rnd.updates)  # version+1 is version
    result = wl.provenance(rnd, {"tensor": "fc.bias"})
    assert_plain(result)
    assert [s["share"] for s in result["share"]] == [0.0, 0.0]
    assert result["tensor"]["change_norm"] == 0.0


# -- malformed rounds ------------------------------------------------------------------------------


def broken(rnd: RoundData, how: str) -> RoundData:
    """The round with its first client's update (or its aggregate) broken ``how``."""
    assert rnd.aggregate is not None
    first = rnd.updates[0]
    tensors, samples, aggregate = dict(first.tensors), first.samples, rnd.aggregate
    if how == "missing tensor":
        del tensors["fc.bias"]
    elif how == "extra tensor":
        tensors["extra"] = frozen(np.zeros(3, np.float32))
    elif how == "shape":
        tensors["fc.bias"] = frozen(np.zeros(6, np.float32))
    elif how == "int for float":
        tensors["fc.bias"] = frozen(np.zeros(5, np.int32))
    elif how == "not an array":
        tensors["fc.bias"] = [0.0] * 5
    elif how == "nan":
        tensors["fc.bias"] = frozen(np.full(5, np.nan, np.float32))
    elif how == "inf aggregate":
        aggregate = {**aggregate, "conv.weight": frozen(np.full((4, 3, 3), np.inf, np.float32))}
    elif how == "aggregate shape":
        aggregate = {**aggregate, "conv.weight": frozen(np.zeros((4, 9), np.float32))}
    elif how == "negative samples":
        samples = -1
    updates = [ClientUpdate(first.client, samples, tensors), *rnd.updates[1:]]
    if how == "duplicate client":
        updates.append(updates[0])
    if how == "no updates":
        updates = []
    return RoundData(rnd.round, rnd.version, rnd.base, aggregate, updates)


BROKEN = ["no updates", "missing tensor", "extra tensor", "shape", "int for float", "not an array", "nan",
          "inf aggregate", "aggregate shape", "duplicate client", "negative samples"]


@pytest.mark.parametrize("how", BROKEN)
@pytest.mark.parametrize("workload", ["cosine", "filter", "cluster", "reputation", "provenance"])
def test_malformed_rounds_are_bad_inputs(how: str, workload: str) -> None:
    rng = np.random.default_rng(19)
    rnd = broken(make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)], aggregate="exact"), how)
    error = raises_code("bad_inputs", wl.run, workload, [rnd], {})
    assert "round 1" in error.message
    if how in ("nan", "duplicate client", "negative samples", "shape"):
        assert "c0" in error.message  # the culprit is named


# -- parameters ------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload, params, filled", [
    ("cosine", {}, {"against": "aggregate"}),
    ("filter", {}, {"f": None, "norm_z": 3.0, "krum_z": 3.0, "min_cosine": 0.0, "exclude": False}),
    ("filter", {"f": 0, "norm_z": 2, "min_cosine": -1, "exclude": True},
     {"f": 0, "norm_z": 2.0, "krum_z": 3.0, "min_cosine": -1.0, "exclude": True}),
    ("cluster", {}, {"k": 2, "seed": 0, "iterations": 100, "select": 2}),
    ("cluster", {"k": wl.MAX_CLUSTERS, "seed": wl.MAX_SEED, "iterations": wl.MAX_ITERATIONS, "select": None},
     {"k": wl.MAX_CLUSTERS, "seed": wl.MAX_SEED, "iterations": wl.MAX_ITERATIONS, "select": wl.MAX_CLUSTERS}),
    ("reputation", {}, {"decay": 0.5, "norm_z": 3.0}),
    ("reputation", {"decay": 1}, {"decay": 1.0, "norm_z": 3.0}),
    ("provenance", {}, {"tensor": None}),
    ("inference", {"inputs": [[[[0] * 8] * 8]]}, {"inputs": [[[[0] * 8] * 8]], "probabilities": False}),
])
def test_check_params_fills_defaults(workload: str, params: dict[str, Any], filled: dict[str, Any]) -> None:
    assert wl.check_params(workload, params) == filled


IMAGE = [[[0.5] * 8] * 8]
MALFORMED = [
    ("nope", {}, "unknown_workload"),
    ("cosine", [], "bad_query"),
    ("cosine", {"agains": "clients"}, "bad_query"),
    ("cosine", {"against": "everyone"}, "bad_query"),
    ("cosine", {"against": None}, "bad_query"),
    ("filter", {"f": -1}, "bad_query"),
    ("filter", {"f": 1.0}, "bad_query"),
    ("filter", {"f": True}, "bad_query"),
    ("filter", {"f": "2"}, "bad_query"),
    ("filter", {"norm_z": 0}, "bad_query"),
    ("filter", {"norm_z": -1.0}, "bad_query"),
    ("filter", {"krum_z": float("nan")}, "bad_query"),
    ("filter", {"krum_z": float("inf")}, "bad_query"),
    ("filter", {"min_cosine": 1.5}, "bad_query"),
    ("filter", {"min_cosine": -1.01}, "bad_query"),
    ("filter", {"exclude": 1}, "bad_query"),
    ("filter", {"exclude": "yes"}, "bad_query"),
    ("cluster", {"k": 0}, "bad_query"),
    ("cluster", {"k": wl.MAX_CLUSTERS + 1}, "bad_query"),
    ("cluster", {"k": 2.5}, "bad_query"),
    ("cluster", {"seed": -1}, "bad_query"),
    ("cluster", {"seed": wl.MAX_SEED + 1}, "bad_query"),
    ("cluster", {"iterations": 0}, "bad_query"),
    ("cluster", {"iterations": wl.MAX_ITERATIONS + 1}, "bad_query"),
    ("cluster", {"select": 0}, "bad_query"),
    ("reputation", {"decay": 0}, "bad_query"),
    ("reputation", {"decay": 1.0001}, "bad_query"),
    ("reputation", {"decay": "0.5"}, "bad_query"),
    ("reputation", {"decay": 0.5, "window": 3}, "bad_query"),
    ("provenance", {"tensor": 3}, "bad_query"),
    ("inference", {}, "bad_query"),
    ("inference", {"inputs": [IMAGE], "probabilities": "no"}, "bad_query"),
    ("inference", {"inputs": []}, "bad_inputs"),
    ("inference", {"inputs": [IMAGE] * (wl.MAX_INFERENCE_ROWS + 1)}, "bad_inputs"),
    ("inference", {"inputs": "[[[[0]]]]"}, "bad_inputs"),
    ("inference", {"inputs": [[[0.5] * 8] * 8]}, "bad_inputs"),  # (1, 8, 8): no channel axis
    ("inference", {"inputs": [[[[0.5] * 8] * 7]]}, "bad_inputs"),
    ("inference", {"inputs": [[[[0.5] * 8] * 8] * 3]}, "bad_inputs"),  # three channels
    ("inference", {"inputs": [IMAGE, [[[0.5] * 8] * 7]]}, "bad_inputs"),  # ragged
    ("inference", {"inputs": [[[["0.5"] * 8] * 8]]}, "bad_inputs"),
    ("inference", {"inputs": [[[[True] * 8] * 8]]}, "bad_inputs"),
    ("inference", {"inputs": [[[[None] * 8] * 8]]}, "bad_inputs"),
    ("inference", {"inputs": [[[[float("nan")] * 8] * 8]]}, "bad_inputs"),
    ("inference", {"inputs": [[[[1e39] * 8] * 8]]}, "bad_inputs"),  # overflows float32
]


@pytest.mark.parametrize("workload, params, code", MALFORMED)
def test_check_params_refuses(workload: str, params: Any, code: str) -> None:
    raises_code(code, wl.check_params, workload, params)


def test_inference_rows_at_the_limit() -> None:
    assert len(wl.check_params("inference", {"inputs": [IMAGE] * wl.MAX_INFERENCE_ROWS})["inputs"]) == wl.MAX_INFERENCE_ROWS


# -- run -------------------------------------------------------------------------------------------


def test_run_dispatches() -> None:
    rng = np.random.default_rng(20)
    rounds = reputation_rounds(rng)
    for workload in ("cosine", "filter", "cluster", "provenance"):
        assert wl.run(workload, rounds, {}) == getattr(wl, workload)(rounds[-1], {})
    assert wl.run("reputation", rounds, {}) == wl.reputation(rounds, {})
    raises_code("unknown_workload", wl.run, "nope", rounds, {})
    raises_code("bad_query", wl.run, "inference", rounds, {})
    raises_code("bad_inputs", wl.run, "cosine", [], {})
    raises_code("bad_inputs", wl.run, "cosine", rounds[::-1], {})
    raises_code("bad_query", wl.run, "cosine", rounds, {"k": 2})


# -- partials: decomposable workloads split over nodes ---------------------------------------------


@pytest.mark.parametrize("workload, params, expected", [
    ("cosine", {}, True),
    ("cosine", {"against": "aggregate"}, True),
    ("cosine", {"against": "clients"}, False),
    ("reputation", {}, True),
    ("reputation", {"decay": 0.9}, True),
    ("provenance", {}, True),
    ("provenance", {"tensor": "fc.weight"}, True),
    ("filter", {}, False),  # Krum compares updates pairwise
    ("cluster", {"k": 3}, False),
    ("inference", {}, False),
    ("nope", {}, False),
])
def test_decomposable(workload: str, params: dict[str, Any], expected: bool) -> None:
    assert wl.decomposable(workload, params) is expected


def sorted_updates(rnd: RoundData) -> RoundData:
    return RoundData(rnd.round, rnd.version, rnd.base, rnd.aggregate, sorted(rnd.updates, key=lambda u: u.client))


def shares_of(rounds: Sequence[RoundData], groups: Sequence[Sequence[str]]) -> list[list[RoundData]]:
    """Every node's share of every round: the updates of its group's clients (possibly none)."""
    return [[RoundData(r.round, r.version, r.base, r.aggregate, [u for u in r.updates if u.client in group]) for r in rounds]
            for group in groups]


def split_round(rng: np.random.Generator) -> list[RoundData]:
    """Six clients over the mixed spec, one of which did not move (cosine 0.0)."""
    deltas = [random_delta(rng, SPECS["mixed"]) for _ in range(6)]
    deltas[4] = {k: np.zeros_like(v) for k, v in deltas[4].items()}
    deltas[1] = {k: 10.0 * v for k, v in deltas[1].items()}
    return [make_round(rng, deltas, spec=SPECS["mixed"], aggregate="exact", round_id=5)]


# groups of indices into the sorted clients: one node; a node with one client; interleaved halves;
# three nodes, the one with the last client first (combine sorts whatever order partials come in)
SPLITS: dict[str, Any] = {
    "one": lambda n: [list(range(n))],
    "single+rest": lambda n: [[0], list(range(1, n))],
    "interleaved": lambda n: [list(range(0, n, 2)), list(range(1, n, 2))],
    "three": lambda n: [[n - 1], [1, 0], list(range(2, n - 1))],
}


def assert_close(got: Any, want: Any, where: str = "result") -> None:
    """Floats to 1e-9 relative; everything else (ids, lists, flags, key order) exactly."""
    if isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)
        return
    assert type(got) is type(want), (where, got, want)
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("workload, params", [
    ("cosine", {}),
    ("reputation", {"decay": 0.7}),
    ("provenance", {}),
    ("provenance", {"tensor": "fc.weight"}),  # stored transposed: read through flat iterators
])
def test_combine_equals_run(workload: str, params: dict[str, Any], split: str) -> None:
    rng = np.random.default_rng(30)
    rounds = [sorted_updates(r) for r in (reputation_rounds(rng) if workload == "reputation" else split_round(rng))]
    clients = sorted({u.client for r in rounds for u in r.updates})
    groups = [[clients[i] for i in group] for group in SPLITS[split](len(clients))]
    filled = wl.check_params(workload, params)  # what the node side passes
    partials = [wl.partial(workload, share, filled) for share in shares_of(rounds, groups)]
    for part in partials:
        assert_plain(part)
        sizes = [len(r["clients"]) for r in part["rounds"]]
        assert len(json.dumps(part)) < 400 * (sum(sizes) + len(sizes))  # O(clients), whatever the model's size
    over_the_wire = json.loads(json.dumps(partials))
    result = wl.combine(workload, over_the_wire, filled)
    assert_plain(result)
    assert_close(result, wl.run(workload, rounds, params))


def test_partial_layout() -> None:
    rng = np.random.default_rng(31)
    rounds = reputation_rounds(rng)
    part = wl.partial("reputation", shares_of(rounds, [["e", "a"]])[0], {})
    assert [(r["round"], r["version"]) for r in part["rounds"]] == [(3, 43), (4, 44), (7, 47)]
    first, second, third = part["rounds"]
    d, change = ref_deltas(rounds[0])
    assert change is not None and math.isclose(first["change_norm2"], change @ change, rel_tol=1e-12)
    assert [c["client"] for c in first["clients"]] == ["a", "e"]  # the order given
    assert math.isclose(first["clients"][1]["norm2"], d[4] @ d[4], rel_tol=1e-12)
    assert math.isclose(first["clients"][1]["dot"], d[4] @ change, rel_tol=1e-12)
    assert first["clients"][1]["samples"] == rounds[0].updates[4].samples
    assert second["change_norm2"] is None and all(c["dot"] is None for c in second["clients"])  # no aggregate
    assert third["clients"] == []  # neither took part: an empty share, not an error
    assert "tensor" not in first
    one = wl.partial("provenance", split_round(rng), {"tensor": "fc.bias"})
    assert len(one["rounds"]) == 1 and one["rounds"][0]["tensor"]["name"] == "fc.bias"
    assert [c["client"] for c in one["rounds"][0]["tensor"]["clients"]] == [c["client"] for c in one["rounds"][0]["clients"]]


@pytest.mark.parametrize("how", BROKEN)
@pytest.mark.parametrize("workload", ["cosine", "reputation", "provenance"])
def test_partial_refuses_what_run_refuses(how: str, workload: str) -> None:
    """The same code as run for the same input; what only the union of the shares can tell
    (a round without clients) combine refuses."""
    rng = np.random.default_rng(19)
    rounds = [broken(make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(3)], aggregate="exact"), how)]
    error = raises_code("bad_inputs", wl.run, workload, rounds, {})
    if how == "no updates":
        part = wl.partial(workload, rounds, {})
        assert raises_code("bad_inputs", wl.combine, workload, [part], {}).message == error.message
    else:
        assert raises_code("bad_inputs", wl.partial, workload, rounds, {}).message == error.message


@pytest.mark.parametrize("workload, params, change, code, of_params", [
    # of_params: the params alone are refused, so combine refuses them too, before any partial
    ("cosine", {}, "no aggregate", "no_aggregate", False),
    ("provenance", {}, "no aggregate", "no_aggregate", False),
    ("provenance", {"tensor": "nope"}, None, "no_such_tensor", False),
    ("provenance", {"tensor": COUNTER}, None, "bad_query", False),  # an int tensor takes no part
    ("provenance", {"decay": 0.5}, None, "bad_query", True),
    ("reputation", {"decay": 0}, None, "bad_query", True),
    ("reputation", {}, "reversed", "bad_inputs", False),
    ("cosine", {"against": "clients"}, None, "bad_query", True),  # run computes it; it does not decompose
    ("filter", {}, None, "bad_query", True),
    ("inference", {"inputs": [IMAGE]}, None, "bad_query", True),
    ("nope", {}, None, "unknown_workload", True),
])
def test_partial_and_combine_refuse(workload: str, params: dict[str, Any], change: str | None, code: str, of_params: bool) -> None:
    rng = np.random.default_rng(32)
    rounds = reputation_rounds(rng)[:2] if change == "reversed" else split_round(rng)
    if change == "no aggregate":
        rounds = [RoundData(r.round, r.version, r.base, None, r.updates) for r in rounds]
    elif change == "reversed":
        rounds = rounds[::-1]
    raises_code(code, wl.partial, workload, rounds, params)
    if of_params:
        raises_code(code, wl.combine, workload, [], params)
    elif workload in ("cosine", "provenance", "reputation"):
        raises_code(code, wl.run, workload, rounds, params)


def test_combine_needs_samples_in_the_union() -> None:
    rng = np.random.default_rng(33)
    rnd = split_round(rng)[0]
    updates = [ClientUpdate(u.client, 0, u.tensors) for u in rnd.updates]
    rounds = [RoundData(rnd.round, rnd.version, rnd.base, rnd.aggregate, updates)]
    partials = [wl.partial("provenance", share, {}) for share in shares_of(rounds, [["c0", "c1"], ["c2", "c3", "c4", "c5"]])]
    raises_code("bad_inputs", wl.combine, "provenance", partials, {})
    raises_code("bad_inputs", wl.run, "provenance", rounds, {})


def valid_partials(workload: str) -> list[dict[str, Any]]:
    """Two nodes' partials: provenance of fc.weight over one round, or reputation over three
    rounds (the second without an aggregate)."""
    rng = np.random.default_rng(34)
    if workload == "reputation":
        rounds = reputation_rounds(rng)
        groups = [["a", "d", "e", "g", "h"], ["b", "c", "f"]]  # the first has none of round 7's clients
    else:
        rounds = split_round(rng)
        groups = [["c0", "c1"], ["c2", "c3", "c4", "c5"]]
    return [wl.partial(workload, share, PARTIAL_PARAMS[workload]) for share in shares_of(rounds, groups)]


PARTIAL_PARAMS: dict[str, dict[str, Any]] = {"provenance": {"tensor": "fc.weight"}, "reputation": {}}
DELETE = object()
P, R = "provenance", "reputation"
NEXT = 1 + 1e-5  # beyond the 1e-6 agreement


def scaled(factor: float) -> Any:
    return lambda value: value * factor


MALFORMED_PARTIALS: list[tuple[str, str, tuple[Any, ...], Any, str]] = [
    # (workload, what, path into the list of partials, new value or function of the old, words of the message)
    (P, "not a list", (), {"workload": P}, "non-empty list"),
    (P, "no partials", (), [], "non-empty list"),
    (P, "a partial not an object", (1,), "partial", "partial 1 must be an object"),
    (P, "missing rounds", (1, "rounds"), DELETE, "missing: rounds"),
    (P, "unexpected field", (1, "node"), "n2", "unexpected: node"),
    (P, "another workload", (1, "workload"), "cosine", "not of provenance"),
    (P, "rounds not a list", (1, "rounds"), {"round": 5}, "must be a list"),
    (P, "no rounds", (1, "rounds"), [], "holds 0 rounds"),
    (P, "two rounds for provenance", (1, "rounds"), lambda rounds: rounds * 2, "holds 2 rounds"),
    (P, "round id a string", (1, "rounds", 0, "round"), "5", "round must be an integer"),
    (P, "round id a bool", (1, "rounds", 0, "round"), True, "round must be an integer"),
    (P, "version a float", (1, "rounds", 0, "version"), 45.0, "version must be an integer"),
    (P, "change NaN", (1, "rounds", 0, "change_norm2"), float("nan"), "change_norm2 must be a finite number"),
    (P, "change negative", (1, "rounds", 0, "change_norm2"), -1.0, "change_norm2 must be a finite number >= 0"),
    (P, "change null without which provenance cannot be", (1, "rounds", 0, "change_norm2"), None, "change_norm2"),
    (P, "clients not a list", (1, "rounds", 0, "clients"), "c2", "clients must be a list"),
    (P, "a client not an object", (1, "rounds", 0, "clients", 0), ["c2", 1, 1.0, 0.5], "client entry 0 must be an object"),
    (P, "a client without dot", (1, "rounds", 0, "clients", 0, "dot"), DELETE, "missing: dot"),
    (P, "client id a number", (1, "rounds", 0, "clients", 0, "client"), 2, "client must be a non-empty string"),
    (P, "client id empty", (1, "rounds", 0, "clients", 0, "client"), "", "client must be a non-empty string"),
    (P, "samples negative", (1, "rounds", 0, "clients", 0, "samples"), -1, "samples must be an integer >= 0"),
    (P, "samples a float", (1, "rounds", 0, "clients", 0, "samples"), 1.5, "samples"),
    (P, "samples a bool", (1, "rounds", 0, "clients", 0, "samples"), True, "samples"),
    (P, "norm2 NaN", (1, "rounds", 0, "clients", 0, "norm2"), float("nan"), "client c2: norm2 must be a finite number"),
    (P, "norm2 infinite", (1, "rounds", 0, "clients", 0, "norm2"), float("inf"), "norm2"),
    (P, "norm2 negative", (1, "rounds", 0, "clients", 0, "norm2"), -1e-3, "norm2 must be a finite number >= 0"),
    (P, "norm2 a string", (1, "rounds", 0, "clients", 0, "norm2"), "1.0", "norm2"),
    (P, "dot NaN", (1, "rounds", 0, "clients", 0, "dot"), float("nan"), "dot must be a finite number"),
    (P, "dot null", (1, "rounds", 0, "clients", 0, "dot"), None, "dot must be a finite number"),
    (P, "dot beyond |d||Δ|", (1, "rounds", 0, "clients", 0, "dot"), lambda _: 1e6, "exceeds"),
    (P, "another round", (1, "rounds", 0, "round"), 6, "covers"),
    (P, "another version", (1, "rounds", 0, "version"), 40, "covers"),
    (P, "changes disagree", (1, "rounds", 0, "change_norm2"), scaled(NEXT), "change_norm2: partial 0 has"),
    (P, "no tensor", (1, "rounds", 0, "tensor"), DELETE, "missing: tensor"),
    (P, "another tensor", (1, "rounds", 0, "tensor", "name"), "fc.bias", "not the tensor asked for"),
    (P, "tensor clients shorter", (1, "rounds", 0, "tensor", "clients"), lambda clients: clients[1:], "has 3 clients, the round 4"),
    (P, "tensor clients reordered", (1, "rounds", 0, "tensor", "clients"), lambda clients: clients[::-1], "the round's is c2"),
    (P, "tensor norm2 negative", (1, "rounds", 0, "tensor", "clients", 2, "norm2"), -2.0, "norm2"),
    (P, "tensor dot infinite", (1, "rounds", 0, "tensor", "clients", 2, "dot"), float("-inf"), "dot"),
    (P, "tensor changes disagree", (1, "rounds", 0, "tensor", "change_norm2"), scaled(1 / NEXT), "tensor change_norm2"),
    (R, "rounds out of order", (1, "rounds"), lambda rounds: rounds[::-1], "oldest first"),
    (R, "a round missing", (1, "rounds"), lambda rounds: rounds[:2], "covers"),
    (R, "a client in two partials", (1, "rounds", 0, "clients", 0, "client"), "a", "round 3: client a is in partial 0 and in partial 1"),
    (R, "a client twice in one partial", (1, "rounds", 0, "clients", 1, "client"), "b", "client b is in partial 1 and in partial 1"),
    (R, "an aggregate one node lacks", (0, "rounds", 2, "change_norm2"), None, "round 7: change_norm2: partial 0 has None"),
    (R, "an aggregate one node has", (1, "rounds", 1, "change_norm2"), 1.0, "dot must be a finite number"),
    (R, "a dot without an aggregate", (1, "rounds", 1, "clients", 0, "dot"), 0.5, "dot must be null"),
    (R, "a tensor reputation does not read", (1, "rounds", 0, "tensor"), {}, "unexpected: tensor"),
]


def replaced(partials: list[Any], path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    holder = partials
    for key in path[:-1]:
        holder = holder[key]
    if value is DELETE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value(holder[path[-1]]) if callable(value) else value
    return partials


@pytest.mark.parametrize("workload, what, path, value, words", MALFORMED_PARTIALS, ids=[m[1] for m in MALFORMED_PARTIALS])
def test_combine_refuses_malformed_partials(workload: str, what: str, path: tuple[Any, ...], value: Any, words: str) -> None:
    partials = replaced(valid_partials(workload), path, value)
    error = raises_code("bad_partial", wl.combine, workload, partials, PARTIAL_PARAMS[workload])
    assert words in error.message


@pytest.mark.parametrize("path, factor", [
    ((1, "rounds", 0, "change_norm2"), 1 + 1e-7),
    ((1, "rounds", 0, "tensor", "change_norm2"), 1 - 1e-7),
])
def test_combine_tolerates_rounding_between_nodes(path: tuple[Any, ...], factor: float) -> None:
    partials = valid_partials("provenance")
    want = wl.combine("provenance", partials, PARTIAL_PARAMS["provenance"])
    got = wl.combine("provenance", replaced(partials, path, scaled(factor)), PARTIAL_PARAMS["provenance"])
    assert got == want  # partial 0's |Δ|² is the one used


# -- inference -------------------------------------------------------------------------------------


def state_of(module: Any) -> dict[str, np.ndarray]:
    return {name: frozen(tensor.detach().numpy().copy()) for name, tensor in module.state_dict().items()}


@pytest.fixture(scope="module")
def cnn() -> tuple[Any, dict[str, np.ndarray]]:
    import torch

    module = wl.make_model("cnn", seed=5)
    with torch.no_grad():  # batch-norm statistics that are not the identity
        for layer in module:
            if isinstance(layer, torch.nn.BatchNorm2d):
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.running_var.uniform_(0.5, 2.0)
                layer.num_batches_tracked.fill_(17)
    return module.eval(), state_of(module)


def test_inference_matches_torch(cnn: tuple[Any, dict[str, np.ndarray]]) -> None:
    import torch

    module, state = cnn
    inputs = np.random.default_rng(21).random((5, 1, 8, 8))
    result = wl.inference("cnn", "test-v1", state, {"inputs": inputs.tolist(), "probabilities": True})
    assert_plain(result)
    with torch.no_grad():
        logits = module(torch.from_numpy(inputs.astype(np.float32)))
    assert result["predictions"] == logits.argmax(1).tolist()
    assert np.allclose(result["probabilities"], torch.softmax(logits.double(), 1).numpy(), atol=1e-6)
    assert "probabilities" not in wl.inference("cnn", "test-v1", state, {"inputs": inputs.tolist()})


def test_inference_at_the_row_limit(cnn: tuple[Any, dict[str, np.ndarray]]) -> None:
    _, state = cnn
    result = wl.inference("cnn", "test-v1", state, {"inputs": [IMAGE] * wl.MAX_INFERENCE_ROWS})
    assert len(result["predictions"]) == wl.MAX_INFERENCE_ROWS
    raises_code("bad_inputs", wl.inference, "cnn", "test-v1", state, {"inputs": [IMAGE] * (wl.MAX_INFERENCE_ROWS + 1)})


def test_inference_caches_built_models(cnn: tuple[Any, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch) -> None:
    _, state = cnn
    built: list[str] = []

    original = wl.make_model

    def counting(name: str) -> Any:
        built.append(name)
        return original(name)

    monkeypatch.setattr(wl, "make_model", counting)
    query = {"inputs": [IMAGE]}
    keys = [f"cache-{i}" for i in range(wl.MODEL_CACHE_SIZE + 1)]
    for key in keys:
        wl.inference("cnn", key, state, query)
    wl.inference("cnn", keys[-1], state, query)  # the newest: cached
    assert len(built) == len(keys)
    wl.inference("cnn", keys[0], state, query)  # the oldest was evicted
    assert len(built) == len(keys) + 1
    wl.inference("cnn", keys[-1], state, query)
    assert len(built) == len(keys) + 1


@pytest.mark.parametrize("architecture, change, code", [
    ("cnn", "missing", "bad_model"),
    ("cnn", "extra", "bad_model"),
    ("cnn", "shape", "bad_model"),
    ("mlp", None, "bad_model"),
])
def test_inference_refuses_models(cnn: tuple[Any, dict[str, np.ndarray]], architecture: str, change: str | None, code: str) -> None:
    _, state = cnn
    state = dict(state)
    first = next(iter(state))
    if change == "missing":
        del state[first]
    elif change == "extra":
        state["extra.weight"] = frozen(np.zeros(3, np.float32))
    elif change == "shape":
        state[first] = frozen(np.zeros((1, 2), np.float32))
    raises_code(code, wl.inference, architecture, f"refused-{architecture}-{change}", state, {"inputs": [IMAGE]})


@pytest.mark.parametrize("workload, params", [
    ("cosine", {}), ("cosine", {"against": "clients"}), ("filter", {}), ("cluster", {"k": 2}),
    ("reputation", {}), ("provenance", {"tensor": "fc.bias"}),
])
def test_statistics_of_a_keyed_round_are_derived_once_and_answer_alike(monkeypatch: pytest.MonkeyPatch, workload: str,
                                                                      params: dict[str, Any]) -> None:
    import dataclasses

    rng = np.random.default_rng(12)
    rnd = make_round(rng, [random_delta(rng, SPECS["narrow"]) for _ in range(5)])
    fresh = wl.run(workload, [rnd], wl.check_params(workload, params))
    keyed = dataclasses.replace(rnd, key=f"round-{workload}-{len(params)}")
    computed: list[str] = []
    for name in ("_compute_delta_gram", "_compute_round_stats"):
        original = getattr(wl, name)
        monkeypatch.setattr(wl, name, lambda *a, _o=original, _n=name: computed.append(_n) or _o(*a))
    first = wl.run(workload, [keyed], wl.check_params(workload, params))
    again = wl.run(workload, [keyed], wl.check_params(workload, params))
    assert first == fresh == again
    assert len(computed) == 1  # the second query read what the first derived
