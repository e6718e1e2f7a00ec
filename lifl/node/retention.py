"""The node's side of retention (``lifl.flstore.retention``): keep what a job's policy wants in
shared memory after its round, write it behind to the job's checkpoint store, drop it from
memory by policy, by the tenant's byte budget (the node's, or the tenant's ``retained_bytes``
quota if lower: ``MemoryLedger.retained_limit``; least recently used first) or under memory
pressure (retained bytes are the first to go), and fetch it back when a query misses.

Retained objects are ordinary store objects held by ``("retain", job)``: immutable, sealed,
readable by the tenant's functions only. Client updates are written behind once (their copy is
what a miss fetches back, from any node sharing the store); models need no copy: every version
is checkpointed before it is installed. Where each retained update lives is indexed in Redis
(``ClusterState.record_retained``) so that any node can find it.

Threads: the store and what this keeps belong to the agent's event loop. Methods called off
the loop (its write-behind thread, the duty that applies policies, queries' preparation) do
their reads and writes of Redis and the checkpoint store where they are, and touch the store
only through ``on_loop`` (``lifl.net.loop.Loop.call``: run there and wait).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lifl import checkpoints
from lifl import format as fmt
from lifl.errors import NotFound, Unavailable
from lifl.flstore.retention import MODEL, UPDATE, Held, RetentionPolicy, in_memory, lru_victims, round_queryable, version_queryable
from lifl.node.metrics import Metrics
from lifl.ledger import Pinned
from lifl.state import ClusterState
from lifl.store import RETAIN, ObjectStore, Tenant

Lookup = tuple[bytes, str]  # (object key, "memory" or "store")
T = TypeVar("T")
OnLoop = Callable[[Callable[[], T]], T]


def keep_holder(job: str) -> tuple[str, str]:
    return (RETAIN, job)


def write_holder(job: str) -> tuple[str, str, str]:
    return (RETAIN, job, "write")


def query_holder(job: str, query: int) -> tuple[str, str, str, int]:
    return (RETAIN, job, "query", query)


@dataclass(eq=False)
class Kept:
    """One retained object of this node."""

    job: str
    tenant: Tenant
    kind: str  # MODEL or UPDATE
    index: int  # a model's version, an update's round
    size: int
    key: bytes | None  # its object while in memory
    stored: bool  # its copy in the checkpoint store is durable
    client: str = ""
    samples: int = 0
    version: int = -1  # an update's base version
    blob: str = ""  # an update's name in the checkpoint store
    last_used: float = field(default_factory=time.monotonic)

    @property
    def held(self) -> Held:
        return Held(self.kind, self.index, self.client)


@dataclass
class RetentionStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    fetched_bytes: int = 0

    def to_json(self, retained: dict[str, int], pending: int) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "fetch_back_bytes": self.fetched_bytes, "bytes_retained": retained, "pending_writes": pending}


def update_blob(round_id: int, key: bytes) -> str:
    return f"r{round_id}-{key.hex()}"


class Retainer:
    def __init__(self, node: str, store: ObjectStore, state: ClusterState, ckpt: checkpoints.CheckpointStore,
                 metrics: Metrics, on_loop: OnLoop[Any], budget: int) -> None:
        self.node = node
        self.store = store
        self.state = state
        self.ckpt = ckpt
        self.metrics = metrics
        self.on_loop = on_loop
        self.budget = budget  # bytes each tenant may keep in memory for queries
        self.items: dict[tuple[str, str, int, str], Kept] = {}
        self.policies: dict[str, RetentionPolicy] = {}
        self.stats: dict[str, RetentionStats] = {}
        self._writes: queue.Queue[Kept | None] = queue.Queue()
        self._stopping = threading.Event()
        self._writer = threading.Thread(target=self._write_behind, name="retention-writer", daemon=True)
        self._writer.start()
        store.reclaim = self.reclaim

    def stop(self) -> None:
        """Stop writing behind (before the store closes: what is not written yet is dropped with it)."""
        self._stopping.set()
        self._writes.put(None)
        self._writer.join(timeout=30)

    # -- policies --------------------------------------------------------------------------------
    def policy(self, job: str) -> RetentionPolicy:
        """The job's policy as last read (Redis is read once per job here, then by ``apply``)."""
        policy = self.policies.get(job)
        if policy is None:
            policy = self.policies[job] = self.state.retention(job)
        return policy

    # -- keeping (on the loop) ------------------------------------------------------------------------
    def keep_update(self, job: str, tenant: Tenant, key: bytes, round_id: int, version: int, client: str,
                    samples: int) -> None:
        """A client update was accepted: keep it past its round and write it behind."""
        seg = self.store.add_ref(key, keep_holder(job))
        self.store.add_ref(key, write_holder(job))
        item = Kept(job, tenant, UPDATE, round_id, seg.size, key, False, client, samples, version,
                    update_blob(round_id, key))
        self.items[(job, UPDATE, round_id, client)] = item
        self._writes.put(item)

    def keep_model(self, job: str, tenant: Tenant, key: bytes, version: int) -> None:
        """A new version was installed (its checkpoint is durable): keep it when it is replaced."""
        seg = self.store.add_ref(key, keep_holder(job))
        self.items[(job, MODEL, version, "")] = Kept(job, tenant, MODEL, version, seg.size, key, True)

    def _write_behind(self) -> None:
        while (item := self._writes.get()) is not None:
            if self._stopping.is_set():
                continue
            try:
                fd = self.on_loop(lambda: os.dup(self.store.get(item.key).fd))
                try:
                    self.ckpt.save_blob(item.job, item.blob, fd, item.size)
                finally:
                    os.close(fd)
                self.state.record_retained(item.job, item.index, item.client, {
                    "client": item.client, "samples": item.samples, "version": item.version, "node": self.node,
                    "blob": item.blob, "size": item.size})
                self.on_loop(lambda: setattr(item, "stored", True))
            except Exception:  # the store or Redis is away: the update stays in memory only, unindexed
                traceback.print_exc()
                print(f"lifl agent: could not write retained update {item.blob} of {item.job!r} behind", file=sys.stderr)
            finally:
                self.on_loop(lambda: self.store.release(item.key, write_holder(item.job)) if item.key is not None else None)

    # -- applying the policy (a periodic duty) ---------------------------------------------------------
    def jobs(self) -> set[str]:
        return {item.job for item in self.items.values()} | set(self.policies)

    def apply(self, job: str) -> None:
        """Bring what this node keeps of ``job`` in line with its current policy: forget rounds no
        longer queryable (here, in the index and in the store, whichever node wrote them: level-
        based, so a restarted node cleans up too), drop from memory what the policy no longer
        keeps there, fetch back what it keeps again (a widened policy), then hold each tenant to
        its budget."""
        try:
            policy = self.state.retention(job)
            j = self.state.job(job)
        except NotFound:
            self.on_loop(lambda: self.forget_job(job))
            return
        self.on_loop(lambda: self.policies.__setitem__(job, policy))
        newest_round, newest_version = j.round - 1, j.version

        def level() -> list[Kept]:
            refetch: list[Kept] = []
            for k, item in list(self.items.items()):
                if item.job != job:
                    continue
                if not (round_queryable(policy, item.index, newest_round) if item.kind == UPDATE
                        else version_queryable(policy, item.index, newest_version)):
                    del self.items[k]
                    self._drop(item, "policy")
                elif not in_memory(policy, item.held, newest_round, newest_version):
                    if item.key is not None and item.stored:
                        self._drop(item, "policy")
                elif not self._present(item) and item.stored:
                    refetch.append(item)
            self._hold_budgets()
            return refetch

        refetch = self.on_loop(level)
        for round_id in self.state.retained_rounds(job):
            if not round_queryable(policy, round_id, newest_round):
                self._forget_round(job, round_id)
        for item in refetch:
            self._refetch(item)

    def forget_job(self, job: str) -> None:
        for k, item in list(self.items.items()):
            if item.job == job:
                del self.items[k]
                self._drop(item, "policy")
        self.policies.pop(job, None)

    def _forget_round(self, job: str, round_id: int) -> None:
        """A round left the history: its updates' copies go from the store, then from the index."""
        try:
            for meta in self.state.retained(job, round_id).values():
                self.ckpt.delete_blob(job, str(meta["blob"]))
            self.state.forget_retained(job, round_id)
        except Exception:  # the store or Redis is away: the next pass tries again
            traceback.print_exc()

    def _refetch(self, item: Kept) -> None:
        """Prefetch: the policy keeps it in memory again."""
        try:
            blob = self._load(item)
        except (OSError, NotFound):
            return

        def keep() -> None:
            if self.items.get((item.job, item.kind, item.index, item.client)) is not item or item.key is not None:
                return
            item.key = self._object(item.job, item.tenant, blob, keep_holder(item.job))
            item.last_used = time.monotonic()
            self.store.retain(item.key)

        self.on_loop(keep)

    def _drop(self, item: Kept, reason: str) -> None:
        """Out of memory (its copy in the store, if any, stays)."""
        if not self._present(item):
            return
        assert item.key is not None
        key, item.key = item.key, None
        self.store.release(key, keep_holder(item.job))
        self.stats.setdefault(item.job, RetentionStats()).evictions += 1
        self.metrics.evictions.labels(item.job, reason).inc()

    def _hold_budgets(self) -> None:
        by_tenant: dict[str, list[tuple[float, int, Kept]]] = {}
        for item in list(self.items.values()):
            if self._present(item) and item.stored and self._only_kept(item):
                by_tenant.setdefault(item.tenant.name, []).append((item.last_used, item.size, item))
        for tenant, held in by_tenant.items():
            for victim in lru_victims(held, self.store.ledger.retained_limit(tenant, self.budget)):
                self._drop(victim, "budget")

    def _present(self, item: Kept) -> bool:
        """Whether the item's object is in memory. The round may have let go of an update it
        never aggregated (store.discard: an update of a round already over here); the item
        then forgets it, and with no copy in the store, it is forgotten itself."""
        if item.key is None:
            return False
        try:
            self.store.get(item.key)
            return True
        except NotFound:
            item.key = None
            if not item.stored and self.items.get((item.job, item.kind, item.index, item.client)) is item:
                del self.items[(item.job, item.kind, item.index, item.client)]
            return False

    def _only_kept(self, item: Kept) -> bool:
        """Nothing but retention holds it (not the current model, nor a query or a round at work)."""
        assert item.key is not None
        return set(self.store.holders(item.key)) == {keep_holder(item.job)}

    def reclaim(self) -> bool:
        """Memory is short: drop the least recently used retained object whose copy is durable
        (on the loop: the store asks while it admits)."""
        candidates = [i for i in list(self.items.values()) if self._present(i) and i.stored and self._only_kept(i)]
        if not candidates:
            return False
        self._drop(min(candidates, key=lambda i: i.last_used), "pressure")
        return True

    def round_updates(self, job: str, round_id: int) -> dict[str, dict[str, Any]]:
        """The updates of ``job``'s round ``round_id`` kept in memory here, by client, described
        as the retention index describes them (on the loop)."""
        return {item.client: {"size": item.size, "samples": item.samples, "version": item.version, "blob": item.blob}
                for item in self.items.values()
                if (item.job, item.kind, item.index) == (job, UPDATE, round_id) and item.key is not None}

    # -- queries ---------------------------------------------------------------------------------------
    def acquire_updates(self, job: str, tenant: Tenant, round_id: int, wanted: list[tuple[str, dict[str, Any], bool]],
                        holder: Hashable) -> list[Lookup]:
        """Objects of retained updates of a round for a query (``holder`` lets go of them), each
        wanted as (client, its retention record, ``keep``: the policy keeps it in memory, so a
        copy fetched back stays). Those in memory are taken in one turn of the loop; the others
        are fetched back. (Off the loop.)"""

        def hits() -> list[tuple[Kept | None, Lookup | None]]:
            out = []
            for client, _, _ in wanted:
                item = self.items.get((job, UPDATE, round_id, client))
                out.append((item, self._hit(item, holder) if item is not None and item.key is not None else None))
            return out

        lookups = []
        for (client, meta, keep), (item, found) in zip(wanted, self.on_loop(hits)):
            if found is None:
                if item is None:
                    item = Kept(job, tenant, UPDATE, round_id, int(meta["size"]), None, True, client, int(meta["samples"]),
                                int(meta["version"]), str(meta["blob"]))
                found = self._miss(item, holder, keep)
            lookups.append(found)
        return lookups

    def acquire_model(self, job: str, tenant: Tenant, version: int, holder: Hashable, keep: bool,
                      current: bytes | None = None) -> Lookup:
        """An object of model ``version`` for a query: retained, the current model (``current``),
        or fetched back from its checkpoint. (Off the loop.)"""

        def hit() -> tuple[Kept | None, Lookup | None]:
            item = self.items.get((job, MODEL, version, ""))
            if item is not None and item.key is not None:
                return item, self._hit(item, holder)
            if current is not None:
                self.store.add_ref(current, holder)
                self._count(job, "memory", 0)
                return item, (current, "memory")
            return item, None

        item, found = self.on_loop(hit)
        if found is not None:
            return found
        if item is None:
            item = Kept(job, tenant, MODEL, version, 0, None, True)
        return self._miss(item, holder, keep)

    def _hit(self, item: Kept, holder: Hashable) -> Lookup:
        assert item.key is not None
        self.store.add_ref(item.key, holder)
        item.last_used = time.monotonic()
        self._count(item.job, "memory", 0)
        return item.key, "memory"

    def _miss(self, item: Kept, holder: Hashable, keep: bool) -> Lookup:
        """Fetch it back from the store; keep it in memory again if the policy wants it there."""
        try:
            blob = self._load(item)
        except OSError as e:
            raise Unavailable(f"{item.kind} {item.index} of job {item.job!r} is neither in memory nor readable from the "
                              f"checkpoint store here: {e}", code="retained_unreachable") from None

        def hold() -> Lookup:
            key = self._object(item.job, item.tenant, blob, holder)
            self._count(item.job, "store", len(blob))
            slot = (item.job, item.kind, item.index, item.client)
            if keep and self.items.setdefault(slot, item) is item and item.key is None:  # cached here from now on
                self.store.add_ref(key, keep_holder(item.job))
                item.key, item.size, item.last_used = key, len(blob), time.monotonic()
            self.store.retain(key)
            return key, "store"

        return self.on_loop(hold)

    def _load(self, item: Kept) -> bytes:
        if item.kind == MODEL:
            return self.ckpt.load(item.job, item.index)
        return self.ckpt.load_blob(item.job, item.blob)

    def _object(self, job: str, tenant: Tenant, blob: bytes, holder: Hashable) -> bytes:
        layout = fmt.parse_layout(blob, allow_partial=True)
        seg = self.store.create(tenant, layout.total_size, holder, affinity="gateway", owner=Pinned(job))
        os.pwrite(seg.fd, blob, 0)
        self.store.seal(seg.key)
        return seg.key

    def _count(self, job: str, source: str, fetched: int) -> None:
        stats = self.stats.setdefault(job, RetentionStats())
        if source == "memory":
            stats.hits += 1
        else:
            stats.misses += 1
            stats.fetched_bytes += fetched
            self.metrics.fetch_backs.labels(job).inc(fetched)
        self.metrics.retention_lookups.labels(job, source).inc()

    # -- status ------------------------------------------------------------------------------------------
    def retained_bytes(self, job: str) -> dict[str, int]:
        out = {MODEL: 0, UPDATE: 0}
        for item in self.items.values():
            if item.job == job and item.key is not None:
                out[item.kind] += item.size
        return out

    def status(self) -> dict[str, Any]:
        jobs = {i.job for i in self.items.values()} | set(self.stats)
        out = {}
        for job in jobs:
            retained = self.retained_bytes(job)
            for kind, n in retained.items():
                self.metrics.retained_bytes.labels(job, kind).set(n)
            pending = sum(1 for i in self.items.values() if i.job == job and not i.stored)
            out[job] = self.stats.get(job, RetentionStats()).to_json(retained, pending)
        return out
