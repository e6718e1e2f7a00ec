"""The query function: FLStore's non-training workloads, run where the updates already are.

The agent invokes a warm instance of the job's tenant with role ``query``; the handler asks it
what to compute (``TakeQuery``: the workload, its parameters and the keys of the retained
objects it reads), maps those objects read-only (the kernel checks the tenant's identity on
every open), and runs ``lifl.flstore.workloads`` on views of them: no update is copied. The
result travels back in the task's statistics; a workload refusing its input (a parameter, an
input that does not fit the model) reports the error for the agent to pass on.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.errors import BadRequest, LiflError, NotFound
from lifl.flstore import workloads
from lifl.protocol import QueryRound, TakeQuery
from lifl.runtime import Context


def _tensors(ctx: Context, key: bytes) -> dict[str, np.ndarray]:
    mm = ctx.open(key)
    layout = ctx.layout(mm)
    if bf16 := [e.spec.name for e in layout.entries if e.spec.dtype == fmt.BF16]:
        # numpy has no bfloat16: its views are raw uint16 bits, which no workload may read as numbers
        raise BadRequest(f"the workloads read float16, float32 and float64 tensors; {', '.join(bf16[:3])} "
                         f"{'is' if len(bf16) == 1 else 'are'} bfloat16", code="unsupported_dtype")
    return fmt.views(mm, layout)


def _round(ctx: Context, entry: QueryRound) -> workloads.RoundData:
    updates = [workloads.ClientUpdate(u.client, u.samples, _tensors(ctx, u.key)) for u in entry.updates]
    if not entry.base:
        raise NotFound(f"the model round {entry.round} trained from is no longer retained", code="not_retained")
    base = _tensors(ctx, entry.base)
    aggregate = _tensors(ctx, entry.aggregate) if entry.aggregate else None
    # objects are immutable and their keys never reused: the keys name what the round's statistics derive from
    identity = hashlib.sha256(" ".join([entry.base.hex(), entry.aggregate.hex(), *(u.key.hex() for u in entry.updates)])
                              .encode()).hexdigest()
    return workloads.RoundData(entry.round, entry.version, base, aggregate, updates, identity)


def _one_thread() -> None:
    """Queries share the node with aggregation: torch computes on one core, and its idle
    threads do not spin on the other."""
    import torch  # loaded before the instance dropped privileges (it was started for inference)

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def handle(task: int, ctx: Context) -> dict[str, Any]:
    work, _ = ctx.client.call(TakeQuery(task))
    t0 = time.perf_counter()
    try:
        if work.workload == "inference":
            _one_thread()
            # the object's key names the model: immutable, and never reused for other bytes
            result = workloads.inference(work.architecture, work.model.hex(), _tensors(ctx, work.model), work.params)
        else:
            rounds = [_round(ctx, entry) for entry in work.rounds]
            compute = workloads.partial if work.mode == "partial" else workloads.run
            result = compute(work.workload, rounds, work.params)
    except LiflError as e:
        return {"error": {"type": type(e).__name__, "code": e.code, "message": e.message}}
    return {"result": result, "compute_s": round(time.perf_counter() - t0, 6)}
