"""FLStore's non-training workloads over the client updates of a round, as pure numpy.

A round holds the base model it trained from, every client's model after local training and,
once known, the aggregate. "Update" means a client's delta d_i = x_i - base; the round's change
is Δ = aggregate - base. Only float tensors take part (integer ones such as BatchNorm's
``num_batches_tracked`` are skipped).

Updates are large (a ResNet-18 is ~45 MB) and arrive as read-only views into shared memory, so
nothing here copies one: every workload derives from Gram matrices of the deltas, computed block
by block (``gram``). The deltas are formed per block inside a small scratch, relative to the
base, rather than derived afterwards from a Gram of the raw models through bilinear identities:
a delta is typically 1e-3 of its weights, so <d_i, d_j> = G_ij - G_ib - G_jb + G_bb cancels
six digits, and float32 block products then leave ~10 % errors. Subtracting first keeps float32
products accurate to ~1e-7 relative and twice as fast as float64 ones.

Cosine against the aggregate, reputation and provenance need no Gram matrix, only |d_i|²,
<d_i, Δ> and |Δ|², which a node can compute over its own clients: ``partial`` there and
``combine`` on one node give what ``run`` gives over all the updates, without moving them.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from lifl.errors import BadRequest
from lifl.params import REQUIRED, Checks, Param, optional, show
from lifl.models import MODELS, make_model

T = TypeVar("T")

Tensors = Mapping[str, np.ndarray]  # name -> array; arrays are READ-ONLY VIEWS into shared memory


@dataclass(frozen=True)
class ClientUpdate:
    client: str
    samples: int  # its FedAvg weight
    tensors: Tensors  # the client's model after local training (weights, not a delta)


@dataclass(frozen=True)
class RoundData:
    round: int
    version: int  # the global version the round trained from
    base: Tensors  # the model of `version`
    aggregate: Tensors | None  # the round's result (model of version+1), None if not available
    updates: Sequence[ClientUpdate]
    # names the round's immutable data (its objects' keys): what is derived from it (the Gram
    # matrix, norms and dots) is kept under it for the next query; "": computed afresh
    key: str = ""


WORKLOADS = ("cosine", "filter", "cluster", "reputation", "provenance", "inference")

DEFAULT_BLOCK = 1 << 16  # elements per block: 22 float32 rows are 5.8 MB (float64, per-client figures: 11.5 MB)
MAX_CLUSTERS = 64
MAX_ITERATIONS = 1000  # Lloyd iterations of one k-means run
MAX_SEED = 2**63 - 1
MAX_INFERENCE_ROWS = 1024
DERIVED_CACHE_ENTRIES = 64  # rounds' statistics kept (a Gram matrix is n², tiny beside the updates)
MODEL_CACHE_SIZE = 4  # built torch modules kept per (architecture, model key)
KMEANS_RESTARTS = 10  # k-means++ seedings tried; the lowest inertia wins
INPUT_SHAPE = (1, 8, 8)  # one digits image: every architecture of lifl.workload takes it
FLOAT_TYPES = (np.float16, np.float32, np.float64)

MAD_SCALE = 1.4826  # MAD -> standard deviation, for normal data
MEAN_AD_SCALE = 1.253314  # mean absolute deviation -> standard deviation, for normal data
SPREAD_FLOOR = 1e-6  # spreads below this fraction of the median are float rounding, not spread
PARTIAL_TOLERANCE = 1e-6  # relative: how far nodes' |Δ|² may differ, and a dot exceed |d| |Δ|, by rounding


# -- parameters ------------------------------------------------------------------------------------


_QUERY = Checks("bad_query")


def _bad_inputs(message: str) -> BadRequest:
    return BadRequest(message, code="bad_inputs")


def _inputs(name: str, value: Any) -> Any:
    _inputs_array(value)
    return value


_SPECS: dict[str, dict[str, Param]] = {
    "cosine": {"against": Param("aggregate", _QUERY.choice("aggregate", "clients"))},
    "filter": {
        "f": Param(None, optional(_QUERY.integer(0))),
        "norm_z": Param(3.0, _QUERY.number(0.0, low_open=True)),
        "krum_z": Param(3.0, _QUERY.number(0.0, low_open=True)),
        "min_cosine": Param(0.0, _QUERY.number(-1.0, 1.0)),
        "exclude": Param(False, _QUERY.boolean),
    },
    "cluster": {
        "k": Param(2, _QUERY.integer(1, MAX_CLUSTERS)),
        "seed": Param(0, _QUERY.integer(0, MAX_SEED)),
        "iterations": Param(100, _QUERY.integer(1, MAX_ITERATIONS)),
        "select": Param(None, optional(_QUERY.integer(1))),
    },
    "reputation": {
        "decay": Param(0.5, _QUERY.number(0.0, 1.0, low_open=True)),
        "norm_z": Param(3.0, _QUERY.number(0.0, low_open=True)),
    },
    "provenance": {"tensor": Param(None, optional(_QUERY.text))},
    "inference": {"inputs": Param(REQUIRED, _inputs), "probabilities": Param(False, _QUERY.boolean)},
}


def check_params(workload: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a workload's parameters and fill in defaults, without any data (a caller checks
    a query before it fetches anything). Defaults that depend on the round (filter's ``f``)
    stay None."""
    if workload not in _SPECS:
        raise BadRequest(f"unknown workload {show(workload)}; choose one of {', '.join(WORKLOADS)}", code="unknown_workload")
    if not isinstance(params, Mapping):
        raise _QUERY.bad(f"params must be an object, got {show(params)}")
    filled = _QUERY.fill(workload, _SPECS[workload], params)
    if workload == "cluster" and filled["select"] is None:
        filled["select"] = filled["k"]
    return filled


# -- the round's data ------------------------------------------------------------------------------


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.type in FLOAT_TYPES


def _float_names(rnd: RoundData, *, share: bool = False) -> list[str]:
    """The float tensors that take part, once every model of the round is known to hold the
    base's tensors with the base's shapes. ``share``: the updates are one node's share of the
    round, which may hold none of its clients."""
    if not rnd.updates and not share:
        raise _bad_inputs(f"round {rnd.round} has no client updates")
    clients = [update.client for update in rnd.updates]
    repeated = sorted({client for client in clients if clients.count(client) > 1})
    if repeated:
        raise _bad_inputs(f"round {rnd.round}: client(s) {', '.join(repeated)} appear more than once")
    for update in rnd.updates:
        if isinstance(update.samples, bool) or not isinstance(update.samples, (int, np.integer)) or update.samples < 0:
            raise _bad_inputs(f"round {rnd.round}: client {update.client} has samples={show(update.samples)}, not a count")
    models = [("the base", rnd.base)]
    if rnd.aggregate is not None:
        models.append(("the aggregate", rnd.aggregate))
    models += [(f"client {update.client}", update.tensors) for update in rnd.updates]
    for label, tensors in models:
        for name, array in tensors.items():
            if not isinstance(array, np.ndarray):
                raise _bad_inputs(f"round {rnd.round}: tensor {name} of {label} is a {type(array).__name__}, not an array")
    for label, tensors in models[1:]:
        if set(tensors) != set(rnd.base):
            missing, extra = sorted(set(rnd.base) - set(tensors)), sorted(set(tensors) - set(rnd.base))
            raise _bad_inputs(f"round {rnd.round}: {label} does not have the base's tensors"
                              f" (missing: {', '.join(missing) or 'none'}; extra: {', '.join(extra) or 'none'})")
        for name, reference in rnd.base.items():
            array = tensors[name]
            if array.shape != reference.shape:
                raise _bad_inputs(f"round {rnd.round}: tensor {name} of {label} has shape {array.shape}, the base's is {reference.shape}")
            if _is_float(array) != _is_float(reference):
                raise _bad_inputs(f"round {rnd.round}: tensor {name} of {label} is {array.dtype}, the base's is {reference.dtype}")
    return [name for name, array in rnd.base.items() if _is_float(array)]


# -- Gram matrices ---------------------------------------------------------------------------------


def flat_view(array: np.ndarray) -> np.ndarray | np.flatiter:
    """Something sliceable in C order without copying the array: a flat view of a contiguous
    array; otherwise its flat iterator, whose slices copy only the block asked for."""
    return array.reshape(-1) if array.flags.c_contiguous else array.flat


def _blocks(vectors: Sequence[Tensors], names: Sequence[str], origin: Tensors | None, block: int,
            work: type[np.floating[Any]]) -> Iterator[np.ndarray]:
    """The named tensors of every vector, concatenated, minus the origin's (None: zero), as
    successive (n x width) slices of one ``work``-typed scratch, width <= ``block``: each slice
    is overwritten by the next. Small tensors share a slice, so a model with many tiny tensors
    takes no more slices than one with a few large ones."""
    count = len(vectors)
    length = sum(vectors[0][name].size for name in names) if count else 0
    if length == 0:
        return
    scratch = np.empty((count, min(block, length)), work)
    width = scratch.shape[1]
    filled = 0
    for name in names:
        flats = [flat_view(vector[name]) for vector in vectors]
        zero = flat_view(origin[name]) if origin is not None else None
        size = vectors[0][name].size
        start = 0
        while start < size:
            stop = start + min(width - filled, size - start)
            rows = scratch[:, filled : filled + stop - start]
            for row, flat in zip(rows, flats):
                if zero is None:
                    row[...] = flat[start:stop]
                else:
                    np.subtract(flat[start:stop], zero[start:stop], out=row, dtype=work)
            filled += stop - start
            start = stop
            if filled == width:
                yield scratch
                filled = 0
    if filled:
        yield scratch[:, :filled]


def gram(vectors: Sequence[Tensors], names: Sequence[str], block: int = DEFAULT_BLOCK,
         origin: Tensors | None = None) -> np.ndarray:
    """The float64 Gram matrix G[i, j] = <v_i - origin, v_j - origin> over the concatenation of
    the named tensors (origin None: zero), computed ``block`` elements at a time.

    Each block of every vector is written (minus the origin) into one (n x block) scratch, whose
    float32 product B @ B.T is accurate within the block; blocks accumulate in float64. The
    scratch is float64 when any tensor is.
    """
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    total = np.zeros((len(vectors), len(vectors)), np.float64)
    wide = any(vector[name].dtype == np.float64 for vector in vectors for name in names) or (
        origin is not None and any(origin[name].dtype == np.float64 for name in names))
    for rows in _blocks(vectors, names, origin, block, np.float64 if wide else np.float32):
        total += rows @ rows.T
    return total


def squares_and_dots(vectors: Sequence[Tensors], reference: Tensors | None, names: Sequence[str], origin: Tensors,
                     block: int = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """|v_i - origin|² of every vector, then of the reference if there is one, and
    <v_i - origin, reference - origin> (empty without a reference), over the named tensors.

    Only these O(n) figures, not a Gram matrix, and in float64 throughout (float32 products are
    exact in float64): a client's figures then do not depend on which other clients share its
    scratch (a float32 block product rounds differently with more rows), so one node's partial
    and the whole round agree to ~1e-15."""
    rows_of = [*vectors, reference] if reference is not None else list(vectors)
    squares = np.zeros(len(rows_of), np.float64)
    dots = np.zeros(len(vectors) if reference is not None else 0, np.float64)
    for rows in _blocks(rows_of, names, origin, block, np.float64):
        squares += np.einsum("ij,ij->i", rows, rows)
        if reference is not None:
            dots += rows[:-1] @ rows[-1]
    return squares, dots


def _require_finite(rnd: RoundData, squares: np.ndarray) -> None:
    """``squares``: the squared norms of the clients' deltas, then of Δ if the aggregate is known."""
    if np.isfinite(squares).all():
        return
    labels = [f"client {update.client}" for update in rnd.updates] + ["the aggregate"]
    culprits = [labels[i] for i in np.flatnonzero(~np.isfinite(squares))]
    where = "every model (the base, probably)" if len(culprits) == len(squares) > 1 else ", ".join(culprits)
    raise _bad_inputs(f"round {rnd.round}: values that are not finite, or overflow, in {where}")


_DERIVED: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # statistics of immutable rounds, least recently used first


def _derived(what: tuple[Any, ...], rnd: RoundData, compute: Callable[[], T]) -> T:
    """``compute()``, kept under the round's key (none: not kept) for the queries that follow:
    retained rounds never change, and every Gram-based workload reads the same matrix."""
    if not rnd.key:
        return compute()
    slot = (rnd.key, *what)
    if slot in _DERIVED:
        _DERIVED.move_to_end(slot)
        return _DERIVED[slot]
    value = _DERIVED[slot] = compute()
    while len(_DERIVED) > DERIVED_CACHE_ENTRIES:
        _DERIVED.popitem(last=False)
    return value


def _delta_gram(rnd: RoundData, names: Sequence[str]) -> np.ndarray:
    """The Gram of [d_1..d_n] followed by Δ when the aggregate is known."""
    return _derived(("gram", tuple(names)), rnd, lambda: _compute_delta_gram(rnd, names))


def _compute_delta_gram(rnd: RoundData, names: Sequence[str]) -> np.ndarray:
    models = [update.tensors for update in rnd.updates]
    if rnd.aggregate is not None:
        models.append(rnd.aggregate)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, Inf and overflow are reported next
        result = gram(models, names, origin=rnd.base)
    _require_finite(rnd, np.diag(result))
    result.setflags(write=False)  # shared by the queries that follow
    return result


def _norms(g: np.ndarray) -> np.ndarray:
    return np.sqrt(np.clip(np.diag(g), 0.0, None))


def _cosines(g: np.ndarray) -> np.ndarray:
    """All pairwise cosines of a Gram's vectors; a zero vector has cosine 0.0 with anything."""
    norms = _norms(g)
    scale = np.outer(norms, norms)
    cosines = np.divide(g, scale, out=np.zeros_like(g), where=scale > 0)
    return np.clip(cosines, -1.0, 1.0)


def _squared_distances(g: np.ndarray) -> np.ndarray:
    diagonal = np.diag(g)
    return np.clip(diagonal[:, None] + diagonal[None, :] - 2.0 * g, 0.0, None)


def _floats(values: np.ndarray) -> list[float]:
    return [float(value) for value in values]


def _require_aggregate(rnd: RoundData, workload: str) -> None:
    if rnd.aggregate is None:
        raise BadRequest(f"{workload} needs round {rnd.round}'s aggregate, which is not available", code="no_aggregate")


# -- workloads -------------------------------------------------------------------------------------


def cosine(rnd: RoundData, params: Mapping[str, Any]) -> dict[str, Any]:
    """Cosine similarity of every client's update with the round's change, or with each other."""
    p = check_params("cosine", params)
    if p["against"] == "aggregate":
        return _decide("cosine", _stats("cosine", [rnd], p), p)
    names = _float_names(rnd)
    g = _delta_gram(rnd, names)
    n = len(rnd.updates)
    return {"clients": [update.client for update in rnd.updates], "norms": _floats(_norms(g)[:n]),
            "matrix": [_floats(row) for row in _cosines(g)[:n, :n]]}


def _robust_z(values: np.ndarray) -> np.ndarray:
    """Signed robust z-scores (x - median) / (1.4826 MAD). A zero MAD falls back on the mean
    absolute deviation from the median; when that is zero too (all values equal), all zeros."""
    median = float(np.median(values))
    deviation = values - median
    noise = SPREAD_FLOOR * abs(median)
    spread = MAD_SCALE * float(np.median(np.abs(deviation)))
    if spread <= noise:
        spread = MEAN_AD_SCALE * float(np.mean(np.abs(deviation)))
    if spread <= noise:
        return np.zeros_like(values)
    return deviation / spread


def _norm_suspects(norms: np.ndarray, norm_z: float) -> np.ndarray:
    return np.abs(_robust_z(norms)) > norm_z


def krum_scores(g: np.ndarray, neighbours: int) -> np.ndarray:
    """Each update's sum of squared distances to its ``neighbours`` closest other updates."""
    distances = _squared_distances(g)
    np.fill_diagonal(distances, np.inf)
    return np.sort(distances, axis=1)[:, :neighbours].sum(axis=1)


def filter(rnd: RoundData, params: Mapping[str, Any]) -> dict[str, Any]:  # the workload's name; shadows the builtin
    """Malicious-client filtering: norm outliers, Krum outliers, updates against the change."""
    p = check_params("filter", params)
    names = _float_names(rnd)
    n = len(rnd.updates)
    f = p["f"]
    notes: list[str] = []
    if n >= 3:
        if f is None:
            f = min(max(1, (n - 3) // 2), n - 3)  # Krum needs n - f - 2 >= 1 neighbours
        elif n - f - 2 < 1:
            raise _QUERY.bad(f"f={f} leaves Krum no neighbours with {n} clients: f must be at most {n - 3}")
    else:
        notes.append(f"krum needs at least 3 clients; round {rnd.round} has {n}")
    if rnd.aggregate is None:
        notes.append(f"round {rnd.round} has no aggregate: the cosine rule was not applied")
    g = _delta_gram(rnd, names)
    norms = _norms(g)[:n]
    cosines = _cosines(g)[:n, n] if rnd.aggregate is not None else None
    krum = krum_scores(g[:n, :n], n - f - 2) if n >= 3 else None
    flags: dict[str, np.ndarray] = {"norm": _norm_suspects(norms, p["norm_z"])}
    if krum is not None:
        flags["krum"] = _robust_z(krum) > p["krum_z"]
    if cosines is not None:
        flags["cosine"] = cosines < p["min_cosine"]
    clients = [{"client": update.client, "norm": float(norms[i]),
                "cosine": float(cosines[i]) if cosines is not None else None,
                "krum": float(krum[i]) if krum is not None else None} for i, update in enumerate(rnd.updates)]
    suspects = [{"client": update.client, "rules": [rule for rule, flagged in flags.items() if flagged[i]]}
                for i, update in enumerate(rnd.updates) if any(flagged[i] for flagged in flags.values())]
    rules: dict[str, Any] = {"f": f, "norm_z": p["norm_z"], "krum_z": p["krum_z"], "min_cosine": p["min_cosine"], "notes": notes}
    return {"clients": clients, "suspects": suspects, "rules": rules, "exclude": p["exclude"]}


def _centroid_distances(g: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Squared distance of every vector to every cluster's centroid, from the Gram alone:
    |v_i - m_c|² = G_ii - 2 <v_i, m_c> + <m_c, m_c>. Every cluster must be non-empty."""
    members = np.zeros((len(labels), k))
    members[np.arange(len(labels)), labels] = 1.0
    means = members / members.sum(axis=0)  # column c: the weights making m_c from the vectors
    cross = g @ means
    within = np.einsum("ic,ic->c", means, cross)
    return np.clip(np.diag(g)[:, None] - 2.0 * cross + within[None, :], 0.0, None)


def _seed_clusters(g: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++: seeds drawn with probability proportional to the squared distance to the
    nearest seed so far; every vector joins its nearest seed (each seed its own cluster)."""
    n = len(g)
    distances = _squared_distances(g)
    seeds = [int(rng.integers(n))]
    nearest = distances[seeds[0]].copy()
    while len(seeds) < k:
        total = float(nearest.sum())
        if total > 0:
            seed = int(rng.choice(n, p=nearest / total))
        else:  # the rest coincide with seeds: any other vector will do
            seed = int(rng.choice([i for i in range(n) if i not in seeds]))
        seeds.append(seed)
        nearest = np.minimum(nearest, distances[seed])
    labels = np.argmin(distances[:, seeds], axis=1)
    labels[seeds] = np.arange(k)
    return labels


def _refill_empty(labels: np.ndarray, distances: np.ndarray, k: int) -> np.ndarray:
    """Give each empty cluster the vector farthest from its centroid, taken from a cluster
    that keeps at least one member."""
    labels = labels.copy()
    rows = np.arange(len(labels))
    for cluster in range(k):
        if not (labels == cluster).any():
            sizes = np.bincount(labels, minlength=k)
            own = np.where(sizes[labels] > 1, distances[rows, labels], -np.inf)
            labels[int(np.argmax(own))] = cluster
    return labels


def _lloyd(g: np.ndarray, labels: np.ndarray, k: int, iterations: int) -> np.ndarray:
    rows = np.arange(len(labels))
    for _ in range(iterations):
        distances = _centroid_distances(g, labels, k)
        nearest = np.argmin(distances, axis=1)
        # a tie keeps the current cluster: Lloyd then never cycles between equal assignments
        moved = np.where(distances[rows, nearest] < distances[rows, labels], nearest, labels)
        moved = _refill_empty(moved, distances, k)
        if np.array_equal(moved, labels):
            break
        labels = moved
    return labels


def _kmeans(g: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    """The lowest-inertia labels of KMEANS_RESTARTS k-means++ seeded Lloyd runs, relabelled in
    order of first appearance."""
    rng = np.random.default_rng(seed)
    rows = np.arange(len(g))
    runs = [_lloyd(g, _seed_clusters(g, k, rng), k, iterations) for _ in range(KMEANS_RESTARTS)]
    best = min(runs, key=lambda labels: float(_centroid_distances(g, labels, k)[rows, labels].sum()))
    order = {int(label): position for position, label in enumerate(dict.fromkeys(best.tolist()))}
    return np.array([order[int(label)] for label in best])


def _allocate(sizes: np.ndarray, select: int) -> list[int]:
    """How many of ``select`` picks each cluster gets: proportional to its size by largest
    remainder (integer arithmetic, so no float ties); when select >= the number of clusters,
    a cluster left with none takes one from the cluster most above its quota."""
    n, k = int(sizes.sum()), len(sizes)
    allocation = [select * int(size) // n for size in sizes]
    by_remainder = sorted(range(k), key=lambda c: (-(select * int(sizes[c]) % n), -int(sizes[c]), c))
    for cluster in by_remainder[: select - sum(allocation)]:
        allocation[cluster] += 1
    if select >= k:
        for cluster in sorted((c for c in range(k) if allocation[c] == 0), key=lambda c: (-int(sizes[c]), c)):
            donor = max((c for c in range(k) if allocation[c] >= 2),
                        key=lambda c: (allocation[c] * n - select * int(sizes[c]), -c))
            allocation[donor] -= 1
            allocation[cluster] += 1
    return allocation


def cluster(rnd: RoundData, params: Mapping[str, Any]) -> dict[str, Any]:
    """Kernel k-means of the updates (distances from their Gram matrix) and a clustered
    selection of clients for the next round."""
    p = check_params("cluster", params)
    names = _float_names(rnd)
    n = len(rnd.updates)
    k, select = p["k"], p["select"]
    if k > n:
        raise _QUERY.bad(f"k={k} clusters need at least {k} clients; round {rnd.round} has {n}")
    if select > n:
        raise _QUERY.bad(f"select={select} exceeds round {rnd.round}'s {n} clients")
    g = _delta_gram(rnd, names)[:n, :n]
    labels = _kmeans(g, k, p["iterations"], p["seed"])
    distances = _centroid_distances(g, labels, k)
    rows = np.arange(n)
    sizes = np.bincount(labels, minlength=k)
    selection: list[str] = []
    for label, count in enumerate(_allocate(sizes, select)):
        members = sorted(np.flatnonzero(labels == label).tolist(), key=lambda i: (float(distances[i, label]), i))
        selection += [rnd.updates[i].client for i in members[:count]]
    return {
        "assignments": {update.client: int(labels[i]) for i, update in enumerate(rnd.updates)},
        "sizes": [int(size) for size in sizes],
        "inertia": float(distances[rows, labels].sum()),
        "selection": selection,
    }


def _check_rounds(rounds: Sequence[RoundData]) -> None:
    if not rounds:
        raise _bad_inputs("no rounds to run over")
    ids = [rnd.round for rnd in rounds]
    if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
        raise _bad_inputs(f"rounds must come oldest first with increasing ids, got {show(ids)}")


# -- decomposable workloads ------------------------------------------------------------------------
# cosine against the aggregate, reputation and provenance read a client only through |d_i|²,
# <d_i, Δ> and |Δ|² (provenance: also those of one tensor). In a cluster each node computes
# them over its own clients (``partial``: O(clients) numbers, not 45 MB updates) and one node
# ``combine``s them; on one node ``run`` computes them and decides with the same code.


@dataclass(frozen=True)
class _TensorStats:
    name: str
    change_norm2: float  # |Δ_t|²
    norm2: np.ndarray  # |d_i,t|², in the clients' order
    dot: np.ndarray  # <d_i,t, Δ_t>


@dataclass(frozen=True)
class _RoundStats:
    """All a decomposable workload reads of a round, or of one node's share of it."""

    round: int
    version: int
    change_norm2: float | None  # |Δ|²; None without the aggregate
    clients: list[str]
    samples: list[int]
    norm2: np.ndarray  # |d_i|²
    dot: np.ndarray | None  # <d_i, Δ>; None without the aggregate
    tensor: _TensorStats | None  # provenance's tensor, when one is asked for


def _round_stats(rnd: RoundData, names: Sequence[str], tensor: str | None) -> _RoundStats:
    return _derived(("stats", tuple(names), tensor), rnd, lambda: _compute_round_stats(rnd, names, tensor))


def _compute_round_stats(rnd: RoundData, names: Sequence[str], tensor: str | None) -> _RoundStats:
    models = [update.tensors for update in rnd.updates]
    n = len(models)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, Inf and overflow are reported next
        squares, dots = squares_and_dots(models, rnd.aggregate, names, rnd.base)
    _require_finite(rnd, squares)
    known = rnd.aggregate is not None
    part = None
    if tensor is not None:  # part of the whole, so finite too; provenance has checked the aggregate is known
        tensor_squares, tensor_dots = squares_and_dots(models, rnd.aggregate, [tensor], rnd.base)
        part = _TensorStats(tensor, float(tensor_squares[n]), tensor_squares[:n], tensor_dots)
    return _RoundStats(int(rnd.round), int(rnd.version), float(squares[n]) if known else None,
                       [update.client for update in rnd.updates], [int(update.samples) for update in rnd.updates],
                       squares[:n], dots if known else None, part)


def _stats(workload: str, rounds: Sequence[RoundData], p: Mapping[str, Any]) -> list[_RoundStats]:
    """What a decomposable workload reads of the rounds (reputation: all of them, the others:
    the newest), over the updates given: a whole round's or one node's share. A share may be
    empty; ``_decide`` refuses a round without clients."""
    _check_rounds(rounds)
    tensor = p.get("tensor")  # provenance's only
    stats = []
    for rnd in rounds if workload == "reputation" else rounds[-1:]:
        names = _float_names(rnd, share=True)
        if tensor is not None:
            if tensor not in rnd.base:
                raise BadRequest(f"round {rnd.round}'s model has no tensor {show(tensor)}", code="no_such_tensor")
            if tensor not in names:
                raise _QUERY.bad(f"tensor {tensor} is {rnd.base[tensor].dtype}: only float tensors take part")
        if workload != "reputation":
            _require_aggregate(rnd, "cosine against the aggregate" if workload == "cosine" else workload)
        stats.append(_round_stats(rnd, names, tensor))
    return stats


def _cosines_to_change(norm2: np.ndarray, dot: np.ndarray, change_norm2: float) -> np.ndarray:
    """cos(d_i, Δ); 0.0 for an update or a change of norm 0."""
    scale = np.sqrt(norm2) * math.sqrt(change_norm2)
    return np.clip(np.divide(dot, scale, out=np.zeros_like(dot), where=scale > 0), -1.0, 1.0)


def _change(stats: _RoundStats) -> tuple[np.ndarray, float]:
    """<d_i, Δ> and |Δ|² of a round read with its aggregate (``_stats`` and ``combine`` check it)."""
    if stats.dot is None or stats.change_norm2 is None:
        raise BadRequest(f"round {stats.round}'s aggregate is not available", code="no_aggregate")
    return stats.dot, stats.change_norm2


def _cosine_decision(stats: Sequence[_RoundStats], p: Mapping[str, Any]) -> dict[str, Any]:
    (newest,) = stats
    dot, change_norm2 = _change(newest)
    return {"clients": list(newest.clients), "norms": _floats(np.sqrt(newest.norm2)),
            "cosine": _floats(_cosines_to_change(newest.norm2, dot, change_norm2))}


def _reputation_decision(stats: Sequence[_RoundStats], p: Mapping[str, Any]) -> dict[str, Any]:
    """Each client's decayed mean quality over the rounds it took part in (oldest round first).

    A round's quality is max(0, cos(d_i, Δ)), 1.0 without an aggregate, and 0 for a norm
    outlier (filter's norm rule, over all the round's clients)."""
    history: dict[str, dict[str, list[Any]]] = {}
    for position, rnd in enumerate(stats):
        age = len(stats) - 1 - position
        suspects = _norm_suspects(np.sqrt(rnd.norm2), p["norm_z"])
        cosines = None
        if rnd.dot is not None and rnd.change_norm2 is not None:
            cosines = _cosines_to_change(rnd.norm2, rnd.dot, rnd.change_norm2)
        for i, client in enumerate(rnd.clients):
            record = history.setdefault(client, {"ages": [], "qualities": [], "rounds": [], "cosines": [], "flagged": []})
            quality = max(0.0, float(cosines[i])) if cosines is not None else 1.0
            if suspects[i]:
                quality = 0.0
                record["flagged"].append(rnd.round)
            if cosines is not None:
                record["cosines"].append(float(cosines[i]))
            record["ages"].append(age)
            record["qualities"].append(quality)
            record["rounds"].append(rnd.round)
    clients: dict[str, Any] = {}
    for client, record in history.items():
        # weights relative to the client's newest round: decay**age alone underflows to 0 when old
        newest = min(record["ages"])
        weights = [p["decay"] ** (age - newest) for age in record["ages"]]
        score = sum(w * q for w, q in zip(weights, record["qualities"])) / sum(weights)
        clients[client] = {
            "score": float(score),
            "rounds": record["rounds"],
            "mean_cosine": float(np.mean(record["cosines"])) if record["cosines"] else None,
            "flagged": record["flagged"],
        }
    return {"rounds": [rnd.round for rnd in stats], "clients": clients}


def _provenance_decision(stats: Sequence[_RoundStats], p: Mapping[str, Any]) -> dict[str, Any]:
    (rnd,) = stats
    dot, change_norm2 = _change(rnd)
    total = sum(rnd.samples)
    if total == 0:
        raise _bad_inputs(f"round {rnd.round}'s clients report 0 samples in all: no FedAvg weights")
    weights = np.array(rnd.samples, np.float64) / total

    def shares(dots: np.ndarray, change: float) -> np.ndarray:
        """share_i = <w_i d_i, Δ> / |Δ|², 0.0 when nothing changed."""
        return weights * dots / change if change > 0 else np.zeros_like(weights)

    result: dict[str, Any] = {
        "round": rnd.round,
        "version": rnd.version,
        "new_version": rnd.version + 1,
        "clients": [{"client": client, "samples": samples, "weight": float(w)}
                    for client, samples, w in zip(rnd.clients, rnd.samples, weights)],
        "share": [{"client": client, "share": float(s)} for client, s in zip(rnd.clients, shares(dot, change_norm2))],
    }
    if rnd.tensor is not None:
        part = rnd.tensor
        result["tensor"] = {
            "name": part.name,
            "change_norm": math.sqrt(part.change_norm2),
            "contributions": [{"client": client, "norm": float(w * norm), "share": float(s)} for client, w, norm, s
                              in zip(rnd.clients, weights, np.sqrt(part.norm2), shares(part.dot, part.change_norm2))],
        }
    return result


_DECISIONS: dict[str, Callable[[Sequence[_RoundStats], Mapping[str, Any]], dict[str, Any]]] = {
    "cosine": _cosine_decision, "reputation": _reputation_decision, "provenance": _provenance_decision}


def _decide(workload: str, stats: Sequence[_RoundStats], p: Mapping[str, Any]) -> dict[str, Any]:
    """A decomposable workload's result from its statistics, whether read here or combined."""
    for rnd in stats:
        if not rnd.clients:
            raise _bad_inputs(f"round {rnd.round} has no client updates")
    return _DECISIONS[workload](stats, p)


def reputation(rounds: Sequence[RoundData], params: Mapping[str, Any]) -> dict[str, Any]:
    """Each client's decayed mean quality over the rounds it took part in (oldest round first)."""
    p = check_params("reputation", params)
    return _decide("reputation", _stats("reputation", rounds, p), p)


def provenance(rnd: RoundData, params: Mapping[str, Any]) -> dict[str, Any]:
    """Who made version+1 and how much of the change each client's weighted update explains."""
    p = check_params("provenance", params)
    return _decide("provenance", _stats("provenance", [rnd], p), p)


def decomposable(workload: str, params: Mapping[str, Any]) -> bool:
    """Whether nodes can each compute a ``partial`` over their own clients for ``combine``:
    cosine against the aggregate, reputation and provenance. Validates nothing (``check_params``
    does): an unknown workload is simply not decomposable."""
    if workload == "cosine":
        return params.get("against", "aggregate") == "aggregate"
    return workload in ("reputation", "provenance")


def _decomposable_params(workload: str, params: Mapping[str, Any]) -> dict[str, Any]:
    p = check_params(workload, params)
    if not decomposable(workload, p):
        how = f"{workload} against the clients" if workload == "cosine" else workload
        raise _QUERY.bad(f"{how} does not decompose into per-node partials: run it over every update")
    return p


def partial(workload: str, rounds: Sequence[RoundData], params: Mapping[str, Any]) -> dict[str, Any]:
    """One node's part of a decomposable workload, over the updates given (its share of each
    round: possibly none of a round's clients). JSON-able and O(clients):
    ``{"workload", "rounds": [{"round", "version", "change_norm2", "clients": [{"client",
    "samples", "norm2", "dot"}], "tensor" (provenance with a tensor): {"name", "change_norm2",
    "clients": [{"client", "norm2", "dot"}]}}]}``, the rounds those ``run`` reads (reputation: all,
    the others: the newest), clients in the order given. Refuses what ``run`` refuses, with the
    same codes, except what only the union can tell: a round without clients, 0 samples in all."""
    p = _decomposable_params(workload, params)
    return {"workload": workload, "rounds": [_round_json(rnd) for rnd in _stats(workload, rounds, p)]}


def _round_json(rnd: _RoundStats) -> dict[str, Any]:
    dots = _floats(rnd.dot) if rnd.dot is not None else [None] * len(rnd.clients)
    entry: dict[str, Any] = {
        "round": rnd.round, "version": rnd.version, "change_norm2": rnd.change_norm2,
        "clients": [{"client": client, "samples": samples, "norm2": float(norm2), "dot": dot}
                    for client, samples, norm2, dot in zip(rnd.clients, rnd.samples, rnd.norm2, dots)],
    }
    if rnd.tensor is not None:
        part = rnd.tensor
        entry["tensor"] = {"name": part.name, "change_norm2": part.change_norm2,
                           "clients": [{"client": client, "norm2": float(norm2), "dot": float(dot)}
                                       for client, norm2, dot in zip(rnd.clients, part.norm2, part.dot)]}
    return entry


def combine(workload: str, partials: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    """The result ``run`` gives over the union of the partials' clients, with the clients in
    client-id order (sorted strings; ``run`` keeps the order of the updates it is given, so the
    two agree when those come sorted). The partials arrive from other nodes: a malformed one
    (wrong types or fields, a non-finite or negative norm, a dot beyond |d_i||Δ|, a client in
    two partials, rounds or a |Δ|² that differ between partials) raises
    BadRequest(code="bad_partial") naming the problem."""
    p = _decomposable_params(workload, params)
    if not isinstance(partials, (list, tuple)) or not partials:
        raise _bad_partial(f"partials must be a non-empty list, got {show(partials)}")
    read = [_read_partial(workload, part, p, f"partial {i}") for i, part in enumerate(partials)]
    return _decide(workload, _merge(read), p)


# -- reading partials from other nodes --

def _bad_partial(message: str) -> BadRequest:
    return BadRequest(message, code="bad_partial")


def _fields(value: Any, keys: Sequence[str], where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad_partial(f"{where} must be an object, got {show(value)}")
    if set(value) != set(keys):
        missing, extra = sorted(set(keys) - set(value)), sorted(map(str, set(value) - set(keys)))
        raise _bad_partial(f"{where} must have the fields {', '.join(keys)}"
                           f" (missing: {', '.join(missing) or 'none'}; unexpected: {', '.join(extra) or 'none'})")
    return value


def _entries(value: Any, where: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise _bad_partial(f"{where} must be a list, got {show(value)}")
    return value


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad_partial(f"{where} must be an integer >= 0, got {show(value)}")
    return value


def _real(value: Any, where: str, *, nonnegative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (nonnegative and value < 0):
        raise _bad_partial(f"{where} must be a finite number{' >= 0' if nonnegative else ''}, got {show(value)}")
    return float(value)


def _norm2_and_dot(entry: Mapping[str, Any], change_norm2: float | None, where: str) -> tuple[float, float | None]:
    norm2 = _real(entry["norm2"], f"{where}: norm2", nonnegative=True)
    if change_norm2 is None:
        if entry["dot"] is not None:
            raise _bad_partial(f"{where}: dot must be null, as the round has no aggregate (change_norm2 null)")
        return norm2, None
    dot = _real(entry["dot"], f"{where}: dot")
    bound = math.sqrt(norm2) * math.sqrt(change_norm2)
    if abs(dot) > (1.0 + PARTIAL_TOLERANCE) * bound:
        raise _bad_partial(f"{where}: dot {dot!r} exceeds |d| |Δ| = {bound!r}")
    return norm2, dot


def _read_partial(workload: str, part: Any, p: Mapping[str, Any], where: str) -> list[_RoundStats]:
    fields = _fields(part, ("workload", "rounds"), where)
    if fields["workload"] != workload:
        raise _bad_partial(f"{where} is a part of {show(fields['workload'])}, not of {workload}")
    entries = _entries(fields["rounds"], f"{where}: rounds")
    if not entries or (workload != "reputation" and len(entries) != 1):
        raise _bad_partial(f"{where} holds {len(entries)} rounds; {workload} reads {'at least one' if workload == 'reputation' else 'one'}")
    rounds = [_read_round(workload, entry, p, f"{where}, round entry {i}") for i, entry in enumerate(entries)]
    ids = [rnd.round for rnd in rounds]
    if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
        raise _bad_partial(f"{where}: rounds must come oldest first with increasing ids, got {show(ids)}")
    return rounds


def _read_round(workload: str, entry: Any, p: Mapping[str, Any], where: str) -> _RoundStats:
    tensor = p.get("tensor")
    fields = _fields(entry, ("round", "version", "change_norm2", "clients", *(("tensor",) if tensor is not None else ())), where)
    round_id = _whole(fields["round"], f"{where}: round")
    version = _whole(fields["version"], f"{where}: version")
    where = f"{where} (round {round_id})"
    change_norm2 = None
    if fields["change_norm2"] is not None or workload != "reputation":  # only reputation reads rounds without an aggregate
        change_norm2 = _real(fields["change_norm2"], f"{where}: change_norm2", nonnegative=True)
    clients, samples, norms, dots = [], [], [], []
    for i, item in enumerate(_entries(fields["clients"], f"{where}: clients")):
        values = _fields(item, ("client", "samples", "norm2", "dot"), f"{where}, client entry {i}")
        if not isinstance(values["client"], str) or not values["client"]:
            raise _bad_partial(f"{where}, client entry {i}: client must be a non-empty string, got {show(values['client'])}")
        clients.append(values["client"])
        samples.append(_whole(values["samples"], f"{where}, client {values['client']}: samples"))
        norm2, dot = _norm2_and_dot(values, change_norm2, f"{where}, client {values['client']}")
        norms.append(norm2)
        dots.append(dot)
    part = None
    if tensor is not None:
        part = _read_tensor(fields["tensor"], tensor, clients, f"{where}: tensor")
    return _RoundStats(round_id, version, change_norm2, clients, samples, np.array(norms, np.float64),
                       np.array(dots, np.float64) if change_norm2 is not None else None, part)


def _read_tensor(value: Any, name: str, clients: Sequence[str], where: str) -> _TensorStats:
    fields = _fields(value, ("name", "change_norm2", "clients"), where)
    if fields["name"] != name:
        raise _bad_partial(f"{where} is {show(fields['name'])}, not the tensor asked for, {name}")
    change_norm2 = _real(fields["change_norm2"], f"{where}: change_norm2", nonnegative=True)
    entries = _entries(fields["clients"], f"{where}: clients")
    if len(entries) != len(clients):
        raise _bad_partial(f"{where} has {len(entries)} clients, the round {len(clients)}")
    norms, dots = [], []
    for i, (item, client) in enumerate(zip(entries, clients)):
        values = _fields(item, ("client", "norm2", "dot"), f"{where}, client entry {i}")
        if values["client"] != client:
            raise _bad_partial(f"{where}, client entry {i} is {show(values['client'])}, the round's is {client}")
        norm2, dot = _norm2_and_dot(values, change_norm2, f"{where}, client {client}")
        norms.append(norm2)
        dots.append(dot)
    return _TensorStats(name, change_norm2, np.array(norms, np.float64), np.array(dots, np.float64))


def _agree(values: Sequence[float | None], what: str) -> None:
    """The same |Δ|² (or |Δ_t|²) from every partial, to PARTIAL_TOLERANCE, or none from any."""
    first = values[0]
    for i, value in enumerate(values):
        if (value is None) != (first is None) or (
                value is not None and first is not None and abs(value - first) > PARTIAL_TOLERANCE * max(value, first)):
            raise _bad_partial(f"{what}: partial 0 has {first!r}, partial {i} {value!r}")


def _merge(partials: Sequence[Sequence[_RoundStats]]) -> list[_RoundStats]:
    """The rounds over the union of the partials' clients, sorted by client id."""
    covered = [[(rnd.round, rnd.version) for rnd in rounds] for rounds in partials]
    for i, rounds in enumerate(covered):
        if rounds != covered[0]:
            raise _bad_partial(f"partial {i} covers (round, version) {rounds}, partial 0 {covered[0]}")
    merged = []
    for position, first in enumerate(partials[0]):
        shares = [rounds[position] for rounds in partials]
        _agree([share.change_norm2 for share in shares], f"round {first.round}: change_norm2")
        owner: dict[str, int] = {}
        for i, share in enumerate(shares):
            for client in share.clients:
                if client in owner:
                    raise _bad_partial(f"round {first.round}: client {client} is in partial {owner[client]} and in partial {i}")
                owner[client] = i
        clients = [client for share in shares for client in share.clients]
        order = np.array(sorted(range(len(clients)), key=clients.__getitem__), np.intp)

        def joined(arrays: Sequence[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays)[order]

        samples = [sample for share in shares for sample in share.samples]
        dots = [share.dot for share in shares if share.dot is not None]  # all or none, as the change_norm2 agree
        part = None
        if first.tensor is not None:
            tensors = [share.tensor for share in shares if share.tensor is not None]  # all: the params ask for it
            _agree([t.change_norm2 for t in tensors], f"round {first.round}: tensor change_norm2")
            part = _TensorStats(first.tensor.name, first.tensor.change_norm2,
                                joined([t.norm2 for t in tensors]), joined([t.dot for t in tensors]))
        merged.append(_RoundStats(first.round, first.version, first.change_norm2, [clients[i] for i in order],
                                  [samples[i] for i in order], joined([share.norm2 for share in shares]),
                                  joined(dots) if first.dot is not None else None, part))
    return merged


# -- inference -------------------------------------------------------------------------------------


def _inputs_array(inputs: Any) -> np.ndarray:
    """The inputs as a finite float32 array of shape (N, 1, 8, 8), N in 1..MAX_INFERENCE_ROWS."""
    expected = f"(N, {', '.join(map(str, INPUT_SHAPE))}) with N in 1..{MAX_INFERENCE_ROWS}"
    if not isinstance(inputs, list):
        raise _bad_inputs(f"inputs must be a nested list of shape {expected}, got {type(inputs).__name__}")
    if not 1 <= len(inputs) <= MAX_INFERENCE_ROWS:
        raise _bad_inputs(f"inputs must have shape {expected}: got {len(inputs)} rows")
    try:
        array = np.asarray(inputs)
    except ValueError:  # ragged nesting
        raise _bad_inputs(f"inputs must be a regular nested list of shape {expected}") from None
    if array.dtype.kind not in "iuf":
        raise _bad_inputs(f"inputs must hold numbers only, of shape {expected}")
    if array.shape[1:] != INPUT_SHAPE:
        raise _bad_inputs(f"inputs must have shape {expected}, got {array.shape}")
    with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf, refused next
        array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise _bad_inputs("inputs must be finite float32 numbers")
    return array


_built: OrderedDict[tuple[str, str], Any] = OrderedDict()  # the most recently used last
_built_lock = threading.Lock()


def _build(architecture: str, model: Tensors) -> Any:
    import torch

    module = make_model(architecture)
    # torch warns that the read-only views could be written through; load_state_dict only
    # reads them, copying into the module's own parameters (the views may go away later)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        try:
            state = {name: torch.from_numpy(np.asarray(array)) for name, array in model.items()}
            module.load_state_dict(state, strict=True)
        except (RuntimeError, TypeError) as e:
            raise BadRequest(f"the model does not fit {architecture}: {e}", code="bad_model") from None
    return module.eval()


def _model(architecture: str, model_key: str, model: Tensors) -> Any:
    """A built module per (architecture, model key), the MODEL_CACHE_SIZE most recently used."""
    if architecture not in MODELS:
        raise BadRequest(f"unknown architecture {show(architecture)}; choose one of {', '.join(MODELS)}", code="bad_model")
    key = (architecture, model_key)
    with _built_lock:
        if key in _built:
            _built.move_to_end(key)
            return _built[key]
    module = _build(architecture, model)  # outside the lock: building takes a while
    with _built_lock:
        _built[key] = module
        _built.move_to_end(key)
        while len(_built) > MODEL_CACHE_SIZE:
            _built.popitem(last=False)
    return module


def inference(architecture: str, model_key: str, model: Tensors, params: Mapping[str, Any]) -> dict[str, Any]:
    """Predictions (and class probabilities if asked) of a model version on digits images.
    ``model_key`` names the version: the same key is served from the built-module cache."""
    import torch

    p = check_params("inference", params)
    inputs = _inputs_array(p["inputs"])
    module = _model(architecture, model_key, model)
    with torch.inference_mode():
        logits = module(torch.from_numpy(inputs)).double()
        if not torch.isfinite(logits).all():
            raise BadRequest(f"model {model_key} gives outputs that are not finite", code="bad_model")
        predictions = logits.argmax(dim=1).tolist()
        probabilities = torch.softmax(logits, dim=1).numpy()
    result: dict[str, Any] = {"predictions": [int(c) for c in predictions]}
    if p["probabilities"]:
        result["probabilities"] = [_floats(row) for row in probabilities]
    return result


# -- dispatch --------------------------------------------------------------------------------------

_ROUND_WORKLOADS: dict[str, Callable[[RoundData, Mapping[str, Any]], dict[str, Any]]] = {
    "cosine": cosine, "filter": filter, "cluster": cluster, "provenance": provenance}


def run(workload: str, rounds: Sequence[RoundData], params: Mapping[str, Any]) -> dict[str, Any]:
    """Run a data workload: reputation over all ``rounds`` (oldest first), the others over the
    newest one. Inference runs on a model, not on rounds: call ``inference``."""
    if workload not in WORKLOADS:
        raise BadRequest(f"unknown workload {show(workload)}; choose one of {', '.join(WORKLOADS)}", code="unknown_workload")
    if workload == "inference":
        raise _QUERY.bad("inference runs on a model version, not over rounds")
    _check_rounds(rounds)
    if workload == "reputation":
        return reputation(rounds, params)
    return _ROUND_WORKLOADS[workload](rounds[-1], params)
