"""One strategy step: the round's inputs become the next model x_{t+1} (and the optimiser's state).

Pure numpy, no I/O. The formulas are Flower 1.41's (flwr.server.strategy), so results compare:

- eager strategies read the round's sample-weighted mean w̄ and Δ = w̄ − x_t:
  fedavgm    m ← μ·m + Δ;  x ← x + η·m                                  (state m)
  fedadam    m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;
             x ← x + η·√(1−β2^(r+1))/(1−β1^(r+1)) · m/(√v + τ)          (state m, v)
  fedyogi    m as Adam;  v ← v − (1−β2)·Δ²·sign(v − Δ²);  x ← x + η·m/(√v + τ)
  fedadagrad v ← v + Δ²;  x ← x + η·Δ/(√v + τ)                          (Flower's β1 = 0: m = Δ)
  where r = version + 1 is Flower's server round (versions start at 0), and the state starts at
  zero (Flower's first momentum, the first pseudo-gradient, is the same thing).
- median and trimmed_mean are coordinate-wise over the clients' weights, unweighted;
  krum takes the update of lowest score, multi_krum the sample-weighted mean of the
  ``num_selected`` lowest (ties: the earlier update), scores over squared distances of the deltas;
- dp_fedavg and fedbuff combine the clients' changes w_k − base_k (see their functions).

Sharded rounds (``lifl.shards``): each shard's top steps its pieces of every tensor, named as
the tensors and placed by ``StepInputs.offsets``. Coordinate-wise rules need nothing else. Krum
and dp_fedavg read norms or distances of whole updates: each shard's top computes its
``partials`` (Krum: the Gram matrix of the deltas over its slice; dp_fedavg: the squared norms
of the changes), the shards' partials are summed, and each shard's step takes the sum as
``StepInputs.partials``, which is what the unsharded step computes over the whole model (the
node's top that completes the sum steps every shard: functions/aggregator/top.py). Blocks
lie at fixed positions of each tensor (multiples of ``BLOCK`` elements) and dp's noise is drawn
block by block from (seed, version, tensor, block), so every coordinate gets the same noise
however the model is cut.

Memory: updates are read-only views into shared memory, 45 MB each for a ResNet-18, so nothing
copies one, nor stacks them. Every rule walks each float tensor in blocks of ``BLOCK`` elements
and holds at most (updates × BLOCK) float64 scratch; Krum's distances come from the block-wise
Gram matrix of flstore's workloads. Sums are float64; results are written in the model's dtypes.

Tensors that are not floating point (BatchNorm's ``num_batches_tracked``) are not aggregated by
any rule: they come from the round's mean when the inputs carry it (always, for eager
strategies), otherwise from the first update.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lifl.flstore.workloads import flat_view, gram, krum_scores, squares_and_dots
from lifl.strategy.spec import StrategySpec

Tensors = Mapping[str, np.ndarray]
BLOCK = 1 << 15  # elements of one tensor per block: 20 updates' float64 rows are 5 MB
FLOAT_TYPES = (np.float16, np.float32, np.float64)


@dataclass(frozen=True)
class Update:
    """One client update of the round, mapped read-only from shared memory."""

    tensors: Tensors  # the client's weights after training, in model dtypes: read-only views, never copied whole
    samples: int
    staleness: int = 0  # current version − the update's base version (fedbuff); 0 in synchronous rounds
    base: Tensors | None = None  # the model it trained from (fedbuff); None: the round's current model
    client: str = ""


@dataclass(frozen=True)
class StepInputs:
    current: Tensors  # x_t: the model the round started from (version t)
    version: int  # t
    average: Tensors | None = None  # the round's sample-weighted mean (eager strategies): float64 or model dtype
    updates: Sequence[Update] = ()  # strategies that need every update
    state: Tensors | None = None  # what the previous step wrote into its state_out (None: the first step)
    seed: int = 0  # dp noise is drawn from (seed, version, tensor, block): a step run again releases the same model
    # a shard's step: where each named tensor's piece starts in the whole tensor (elements; absent: 0)...
    offsets: Mapping[str, int] = field(default_factory=dict)
    # ...and the sums over every shard of what ``partials`` computes (None: the step computes them itself)
    partials: np.ndarray | None = None
    count: int = 0  # the round's number of updates (dp_fedavg with clipping on the clients scales its noise by it)


_STATE_PREFIXES = {"fedavgm": ("m",), "fedadam": ("m", "v"), "fedyogi": ("m", "v"), "fedadagrad": ("v",)}


def _is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).type in FLOAT_TYPES


def state_spec(spec: StrategySpec, model: Sequence[tuple[str, np.dtype, tuple[int, ...]]]
               ) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """Names, dtypes and shapes of the state tensors ("m/<tensor>", "v/<tensor>", float64, one
    per float tensor of the model); [] when the strategy keeps no state."""
    return [(f"{prefix}/{name}", np.dtype(np.float64), tuple(shape))
            for prefix in _STATE_PREFIXES.get(spec.name, ()) for name, dtype, shape in model if _is_float(dtype)]


# -- blocks ----------------------------------------------------------------------------------------


def _spans(current: Tensors, names: Sequence[str], offsets: Mapping[str, int] | None = None
           ) -> Iterator[tuple[str, slice]]:
    """(tensor, flat slice) for every block of the named tensors. Blocks stay within a tensor
    (unlike flstore's packed Gram blocks): each result is written back to its own tensor. They
    end on multiples of BLOCK of the whole tensor (a piece starting at ``offsets[name]`` starts
    with what is left of its first block), so a block is the same block sharded or not."""
    for name in names:
        size = current[name].size
        offset = offsets.get(name, 0) if offsets else 0
        start = 0
        while start < size:
            stop = min(size, (offset + start) // BLOCK * BLOCK + BLOCK - offset)
            yield name, slice(start, stop)
            start = stop


def _tensor_id(name: str) -> int:
    """A number naming the tensor for dp's noise, whatever the tensors beside it."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _noise(seed: int, version: int, name: str, start: int, stop: int) -> np.ndarray:
    """Standard normal noise for elements [start, stop) of tensor ``name``, within one block:
    drawn for the whole block from (seed, version, tensor, block), so it does not depend on
    how the tensor is cut."""
    block, first = divmod(start, BLOCK)
    rng = np.random.default_rng([seed, version, _tensor_id(name), block])
    return rng.standard_normal(first + stop - start)[first:]


def _read(array: np.ndarray, span: slice) -> np.ndarray:
    """A block of an array as a fresh float64 array, free to modify (never a view of the input)."""
    return np.array(flat_view(array)[span], dtype=np.float64)


def _write(out: MutableMapping[str, np.ndarray], name: str, span: slice, values: np.ndarray) -> None:
    flat_view(out[name])[span] = values


def floats_of(tensors: Tensors) -> dict[str, np.ndarray]:
    """The floating-point tensors: what the rules aggregate."""
    return {name: array for name, array in tensors.items() if _is_float(array.dtype)}


def copy_non_float(inputs: StepInputs, out: MutableMapping[str, np.ndarray]) -> None:
    """Write the tensors no rule aggregates (not floating point) as ``step`` does: from the
    round's mean when the inputs carry it, else from the first update. A sharded round's tops
    each write their own pieces of these, whichever top steps the float tensors."""
    _copy_non_float(inputs, [name for name, array in inputs.current.items() if not _is_float(array.dtype)], out)


def _copy_non_float(inputs: StepInputs, names: Sequence[str], out: MutableMapping[str, np.ndarray]) -> None:
    if not names:
        return
    source = inputs.average if inputs.average is not None else inputs.updates[0].tensors
    for name in names:
        values = source[name]
        if _is_float(values.dtype):  # an integer tensor's float64 mean: round it to the nearest count
            values = np.rint(values)
        out[name][...] = values


# -- checks ----------------------------------------------------------------------------------------


def _check_like(what: str, tensors: Tensors | None, current: Tensors, *, dtypes: bool = False) -> None:
    if tensors is None:
        return
    if set(tensors) != set(current):
        raise ValueError(f"{what} has tensors {sorted(tensors)}, the model {sorted(current)}")
    for name, array in tensors.items():
        if array.shape != current[name].shape:
            raise ValueError(f"{what}: tensor {name} has shape {array.shape}, the model {current[name].shape}")
        if dtypes and array.dtype != current[name].dtype:
            raise ValueError(f"{what}: tensor {name} is {array.dtype}, the model {current[name].dtype}")


def _check_state(what: str, state: Tensors | None, layout: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> None:
    if state is None:
        return
    expected = {name: shape for name, _, shape in layout}
    if {name: tuple(array.shape) for name, array in state.items()} != expected:
        raise ValueError(f"{what} has tensors {sorted(state)}, the strategy's state {sorted(expected)}")


def _check_inputs(spec: StrategySpec, inputs: StepInputs, out: MutableMapping[str, np.ndarray],
                  state_out: MutableMapping[str, np.ndarray] | None) -> None:
    current = inputs.current
    _check_like("out", out, current, dtypes=True)
    if spec.eager and inputs.average is None:
        raise ValueError(f"strategy {spec.name} needs the round's average")
    _check_like("the average", inputs.average, current)
    if spec.needs_updates and not inputs.updates:
        raise ValueError(f"strategy {spec.name} needs the round's updates")
    if spec.clips_on_client and inputs.count < 1:
        raise ValueError("dp_fedavg with clipping on the clients needs the round's count of updates")
    limit = spec.max_staleness
    for update in inputs.updates:
        who = f"update {update.client or '?'}"
        _check_like(who, update.tensors, current)
        _check_like(f"{who}'s base", update.base, current)
        if isinstance(update.samples, bool) or not isinstance(update.samples, (int, np.integer)) or update.samples < 0:
            raise ValueError(f"{who} has samples={update.samples!r}, not a count")
        if not 0 <= update.staleness <= limit:
            raise ValueError(f"{who} has staleness {update.staleness}; strategy {spec.name} takes 0..{limit}")
        if update.staleness > 0 and update.base is None:
            raise ValueError(f"{who} is {update.staleness} versions stale but has no base model")
    for name, offset in inputs.offsets.items():
        if name not in current or isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"offset {offset!r} of {name!r}: offsets are element counts of the model's tensors")
    if inputs.partials is not None:
        n = len(inputs.updates)
        shape = _PARTIALS_SHAPES[spec.name](n) if spec.name in _PARTIALS_SHAPES else None
        if shape is None:
            raise ValueError(f"strategy {spec.name} reads its coordinates apart: it takes no partials")
        if inputs.partials.shape != shape:
            raise ValueError(f"strategy {spec.name}'s partials of {n} updates have shape {shape}, "
                             f"not {inputs.partials.shape}")
    layout = state_spec(spec, [(name, array.dtype, array.shape) for name, array in current.items()])
    if layout and state_out is None:
        raise ValueError(f"strategy {spec.name} keeps a state: state_out is needed")
    _check_state("the state", inputs.state, layout)
    _check_state("state_out", state_out, layout)


# -- what a sharded step sums over its shards -------------------------------------------------------

_PARTIALS_SHAPES = {"krum": lambda n: (n, n), "multi_krum": lambda n: (n, n), "dp_fedavg": lambda n: (n,)}


def partials(spec: StrategySpec, inputs: StepInputs) -> np.ndarray | None:
    """What a step of ``spec`` reads of whole updates, over the float tensors of ``inputs`` (a
    shard's: its pieces): Krum's Gram matrix of the deltas w_k − x (n × n), dp_fedavg's squared
    norms of the changes (n). Partials of disjoint slices of the model add up to the whole
    model's. None: the rule reads each coordinate apart."""
    if spec.name not in _PARTIALS_SHAPES:
        return None
    names = [name for name, array in inputs.current.items() if _is_float(array.dtype)]
    vectors = [update.tensors for update in inputs.updates]
    if spec.name == "dp_fedavg":
        return squares_and_dots(vectors, None, names, inputs.current, BLOCK)[0]
    return gram(vectors, names, BLOCK, origin=inputs.current)


# -- eager strategies ------------------------------------------------------------------------------


def _eager(spec: StrategySpec, inputs: StepInputs, names: Sequence[str], out: MutableMapping[str, np.ndarray],
           state_out: MutableMapping[str, np.ndarray] | None) -> dict[str, Any]:
    p = dict(spec.params)
    assert inputs.average is not None  # checked
    if spec.name == "fedadam":  # Flower's bias-corrected step size: its power is round + 1, round = t + 1
        power = inputs.version + 2.0
        eta = p["eta"] * np.sqrt(1.0 - p["beta_2"] ** power) / (1.0 - p["beta_1"] ** power)
    else:
        eta = p.get("eta", 0.0)
    for name, span in _spans(inputs.current, names, inputs.offsets):
        average = _read(inputs.average[name], span)
        if spec.name == "fedavg":
            _write(out, name, span, average)
            continue
        x = _read(inputs.current[name], span)
        delta = average - x

        def previous(prefix: str) -> np.ndarray:
            return _read(inputs.state[f"{prefix}/{name}"], span) if inputs.state is not None else np.zeros_like(x)

        new_state: dict[str, np.ndarray] = {}
        if spec.name == "fedavgm":
            m = new_state["m"] = p["server_momentum"] * previous("m") + delta
            x += p["server_learning_rate"] * m
        else:
            square = delta * delta
            if spec.name == "fedadagrad":
                m = delta
                v = new_state["v"] = previous("v") + square
            else:
                m = new_state["m"] = p["beta_1"] * previous("m") + (1.0 - p["beta_1"]) * delta
                v = previous("v")
                if spec.name == "fedadam":
                    v = p["beta_2"] * v + (1.0 - p["beta_2"]) * square
                else:  # fedyogi: the second moment moves towards Δ² by a bounded amount
                    v = v - (1.0 - p["beta_2"]) * square * np.sign(v - square)
                new_state["v"] = v
            x += eta * m / (np.sqrt(v) + p["tau"])
        _write(out, name, span, x)
        assert state_out is not None  # checked
        for prefix, values in new_state.items():
            _write(state_out, f"{prefix}/{name}", span, values)
    return {}


# -- strategies that read every update -------------------------------------------------------------


def _coordinate_wise(spec: StrategySpec, inputs: StepInputs, names: Sequence[str],
                     out: MutableMapping[str, np.ndarray]) -> dict[str, Any]:
    """median, trimmed_mean: each block of every update gathered into one (BLOCK × n) scratch."""
    n = len(inputs.updates)
    cut = int(spec.param("beta") * n) if spec.name == "trimmed_mean" else 0  # Flower's _trim_mean: per end
    # each coordinate's n values side by side, sorted in place: five times faster than np.median's
    # partition along a strided axis (20 ResNet-18 updates: 2 s instead of 5)
    scratch = np.empty((min(BLOCK, max((inputs.current[name].size for name in names), default=0)), n))
    for name, span in _spans(inputs.current, names, inputs.offsets):
        ranked = scratch[: span.stop - span.start]
        for column, update in enumerate(inputs.updates):
            ranked[:, column] = flat_view(update.tensors[name])[span]
        ranked.sort(axis=1)
        if spec.name == "median":
            _write(out, name, span, (ranked[:, (n - 1) // 2] + ranked[:, n // 2]) / 2)
        else:
            _write(out, name, span, ranked[:, cut: n - cut].mean(axis=1))
    return {"trimmed": cut} if spec.name == "trimmed_mean" else {}


def _weighted_mean(inputs: StepInputs, chosen: Sequence[tuple[float, Update]], names: Sequence[str],
                   out: MutableMapping[str, np.ndarray]) -> None:
    """Σ c_k·w_k / Σ c_k over the chosen (c_k, update): Flower's aggregate()."""
    total = sum(weight for weight, _ in chosen)
    if total <= 0:
        raise ValueError("the selected updates have no samples to weigh them by")
    for name, span in _spans(inputs.current, names, inputs.offsets):
        acc = np.zeros(span.stop - span.start)
        for weight, update in chosen:
            acc += weight * _read(update.tensors[name], span)
        _write(out, name, span, acc / total)


def _krum(spec: StrategySpec, inputs: StepInputs, names: Sequence[str],
          out: MutableMapping[str, np.ndarray]) -> dict[str, Any]:
    """Scores: each update's summed squared distance to its n − f − 2 nearest others (at least one,
    as Flower, should a round close with fewer updates than the goal)."""
    updates = inputs.updates
    n = len(updates)
    g = inputs.partials if inputs.partials is not None else partials(spec, inputs)
    scores = krum_scores(g, max(1, n - spec.param("num_malicious") - 2))
    if spec.name == "krum":  # the winner itself, whatever its samples
        chosen = [(1.0, updates[int(np.argmin(scores))])]
    else:
        best = np.argsort(scores, kind="stable")[: min(spec.param("num_selected"), n)]
        chosen = [(float(updates[i].samples), updates[i]) for i in best]
    _weighted_mean(inputs, chosen, names, out)
    return {"selected": [update.client for _, update in chosen]}


def _dp_fedavg(spec: StrategySpec, inputs: StepInputs, names: Sequence[str],
               out: MutableMapping[str, np.ndarray]) -> dict[str, Any]:
    """Central DP (DP-FedAvg): every change w_k − x clipped to L2 norm C over all float tensors,
    their mean (uniform, or by samples with ``weighted``), plus N(0, (z·C/n)²) on every float
    coordinate, drawn from (seed, version, tensor, block)."""
    updates, current = inputs.updates, inputs.current
    clip, z = float(spec.param("clipping_norm")), float(spec.param("noise_multiplier"))
    if spec.clips_on_client:
        return _dp_noise_only(inputs, names, out, z * clip / inputs.count)
    n = len(updates)
    norms = np.sqrt(inputs.partials if inputs.partials is not None else partials(spec, inputs))
    scales = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))  # a zero change stays zero
    if spec.param("weighted"):
        samples = np.array([update.samples for update in updates], np.float64)
        if samples.sum() <= 0:
            raise ValueError("weighted dp_fedavg: the updates have no samples to weigh them by")
        weights = samples / samples.sum()
    else:
        weights = np.full(n, 1.0 / n)
    coefficients = weights * scales
    std = z * clip / n
    for name, span in _spans(current, names, inputs.offsets):
        x = _read(current[name], span)
        start = inputs.offsets.get(name, 0) + span.start
        acc = std * _noise(inputs.seed, inputs.version, name, start, start + len(x))
        for coefficient, update in zip(coefficients, updates):
            acc += coefficient * (_read(update.tensors[name], span) - x)
        _write(out, name, span, x + acc)
    # epsilon is the agent's to add (lifl.strategy.privacy): bookkeeping, not the function's math
    return {"clipped": int(np.count_nonzero(norms > clip)), "noise_std": std}


def _dp_noise_only(inputs: StepInputs, names: Sequence[str], out: MutableMapping[str, np.ndarray],
                   std: float) -> dict[str, Any]:
    """DP-FedAvg whose clients clipped their own changes (a secure job's: the top sees only the
    round's sum): the round's mean plus N(0, std²) on every float coordinate, drawn as the
    server-clipping step draws it."""
    assert inputs.average is not None, "dp_fedavg with clipping on the clients steps the round's mean"
    for name, span in _spans(inputs.current, names, inputs.offsets):
        start = inputs.offsets.get(name, 0) + span.start
        mean = _read(inputs.average[name], span)
        _write(out, name, span, mean + std * _noise(inputs.seed, inputs.version, name, start, start + len(mean)))
    return {"clipped_on": "client", "noise_std": std}


def _fedbuff(spec: StrategySpec, inputs: StepInputs, names: Sequence[str],
             out: MutableMapping[str, np.ndarray]) -> dict[str, Any]:
    """x ← x + η·Σ a_k (w_k − b_k) / Σ a_k, a_k = samples_k·(1 + s_k)^−exponent, b_k the update's base.

    Computed as (η·Σ a_k (w_k + (x − b_k)) + (1 − η)·A·x) / A, A = Σ a_k: the same value, and with
    fresh updates (b_k = x, so x − b_k = 0 exactly) and η = 1 it is Σ a_k w_k / A, FedAvg to the
    last bit rather than x + (FedAvg − x)."""
    updates, current = inputs.updates, inputs.current
    lr = float(spec.param("server_learning_rate"))
    exponent = float(spec.param("staleness_exponent"))
    weights = np.array([update.samples * (1.0 + update.staleness) ** -exponent for update in updates])
    total = float(weights.sum())
    if total <= 0:
        raise ValueError("fedbuff: the buffered updates have no samples to weigh them by")
    for name, span in _spans(current, names, inputs.offsets):
        x = _read(current[name], span)
        acc = np.zeros_like(x)
        for weight, update in zip(weights, updates):
            w = _read(update.tensors[name], span)
            if update.base is not None:
                w += x - _read(update.base[name], span)
            acc += weight * w
        if lr != 1.0:
            acc = lr * acc + (1.0 - lr) * total * x
        _write(out, name, span, acc * (1.0 / total))  # as lifl's FedAvg finalises: times the inverse
    return {"staleness": [update.staleness for update in updates], "weights": [float(w / total) for w in weights]}


_RULES = {"median": _coordinate_wise, "trimmed_mean": _coordinate_wise, "krum": _krum, "multi_krum": _krum,
          "dp_fedavg": _dp_fedavg, "fedbuff": _fedbuff}


def step(spec: StrategySpec, inputs: StepInputs, out: MutableMapping[str, np.ndarray],
         state_out: MutableMapping[str, np.ndarray] | None) -> dict[str, Any]:
    """Write x_{t+1} into ``out`` (preallocated, model dtypes, every tensor of ``inputs.current``)
    and the new state into ``state_out`` (preallocated per ``state_spec``; None when the strategy
    keeps none). Returns a JSON-able report for the rounds history. Raises ValueError on
    inconsistent inputs."""
    _check_inputs(spec, inputs, out, state_out)
    floats = [name for name, array in inputs.current.items() if _is_float(array.dtype)]
    others = [name for name in inputs.current if name not in floats]
    _copy_non_float(inputs, others, out)
    if spec.eager and not spec.clips_on_client:
        return _eager(spec, inputs, floats, out, state_out)
    return _RULES[spec.name](spec, inputs, floats, out)
