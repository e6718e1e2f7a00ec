"""Which models leave a node's shared memory (issue 25: memory follows activity).

A job's current model is pinned in shared memory where it was installed, and every version a
client can see has a durable checkpoint. So a model nobody uses can leave memory (it is
*spilled*) and come back from its checkpoint on demand, with the same version and bytes; a
replica of another node's model is simply dropped (it is fetched again). A model is *idle*
once nothing has used it for ``model_idle_s``: no admission, no round in progress, no read and
no query of its job. Idle models also go early, least recently used first, when an admission
or a model upload is refused for want of memory (``lifl.store.SPILL_CODES``): when memory is
short (``shm_exhausted``) any tenant's, those of tenants over their fair shares first; when the
refused tenant's own models take its room (``fair_share``, ``shm_too_small``, its
``shm_bytes`` quota) its own.

Pure: the agent describes the models it has in memory (``Resident``) and performs the spills.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_MODEL_IDLE_S = 60.0


@dataclass(frozen=True)
class Resident:
    """A job's model (or replica) in this node's memory."""

    job: str
    tenant: str
    size: int  # bytes that spilling it frees
    last_used: float  # monotonic seconds
    busy: bool  # its job has a round here, or another holder uses the object (a download, a task, a query)


def expired(models: Iterable[Resident], now: float, idle_s: float) -> list[str]:
    """The jobs whose model has been idle for ``idle_s`` seconds or more."""
    return [m.job for m in models if not m.busy and now - m.last_used >= idle_s]


def to_make_room(models: Iterable[Resident], need: int, tenant: str | None, over_share: Mapping[str, int]) -> list[str]:
    """Idle models to spill so that at least ``need`` bytes are freed: ``tenant``'s own (None:
    any tenant's), those of tenants over their shares first, then least recently used first.
    Fewer if there are not enough (every bit helps: the refused caller retries); [] if none."""
    idle = [m for m in models if not m.busy and (tenant is None or m.tenant == tenant)]
    idle.sort(key=lambda m: (m.tenant not in over_share, m.last_used))
    victims, freed = [], 0
    for m in idle:
        if freed >= need:
            break
        victims.append(m.job)
        freed += m.size
    return victims
