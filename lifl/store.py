"""Shared-memory object store (POSIX shared memory through posix_ipc).

Objects are immutable once sealed and named by random 16-byte keys:
``/dev/shm/lifl-<node>-<tenant>-<32 hex digits>``. Only the node agent creates, recycles and
destroys them (``ObjectStore``); other processes map them (``MappingCache``).

- Ownership and mode make each tenant a namespace: an object is owned by the agent's user,
  its group is the tenant's, and it is mode 0600 while being written, 0440 once sealed. A
  tenant's functions run with the tenant's uid/gid and can open only their own objects.
- Every object has reference holders (a task, an upload, the job's current model). When the
  last one lets go the object is recycled: renamed to a pool name and given to the next
  object of the same tenant and size, so its pages are already faulted in; past the pool's
  budget it is destroyed. A holder that dies (its process or connection) is released.
- Nothing leaks: ``close`` unlinks everything, and ``remove_node_objects`` deletes what a
  killed agent left behind (the node supervisor calls it, and every start does).
- Memory is accounted by ``lifl.ledger.MemoryLedger``: an object belongs to a job's
  round (working memory, drawn from what the round reserved when its inputs were admitted)
  or is pinned (``Pinned``: models and replicas), and counts against the job's tenant;
  nothing is created beyond capacity or into memory reserved for others.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Hashable

import posix_ipc

from lifl.errors import Internal, LiflError, NotFound, Overloaded
from lifl.ledger import JobSizes, MemoryLedger, Owner, Pinned, RoundOf

SHM_DIR = Path("/dev/shm")
KEY_BYTES = 16
WRITING_MODE = 0o640  # the tenant's group reads it (a parent may open a result before it is sealed); only the agent's fd writes
SEALED_MODE = 0o440
RETAIN = "retain"  # holders ("retain", ...) keep objects for queries only (lifl.node.retention)
# refusals that idle models may lift by leaving memory (``ObjectStore.spill``): memory is short
# (any tenant's models), or the refused tenant's own models take its share, room or quota
SPILL_CODES = ("shm_exhausted", "fair_share", "shm_too_small", "quota_exceeded")


def retention_holder(holder: Hashable) -> bool:
    return isinstance(holder, tuple) and len(holder) > 0 and holder[0] == RETAIN


@dataclass(frozen=True)
class Tenant:
    name: str
    uid: int | None = None  # None: not isolated (the agent is not root)
    gid: int | None = None
    id: int = 0  # the same on every node (lifl.state.ClusterState.tenant_id): key messages carry it


def object_name(node: str, tenant: str, key: bytes) -> str:
    return f"/lifl-{node}-{tenant}-{key.hex()}"


def _path(name: str) -> str:
    """The file of a shared-memory name (a string: this is on the hot path)."""
    return "/dev/shm" + name


def node_prefix(node: str) -> str:
    return f"lifl-{node}-"


def remove_node_objects(node: str) -> int:
    """Unlink every shared-memory name of a node; returns how many there were."""
    removed = 0
    for path in SHM_DIR.glob(node_prefix(node) + "*"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


@dataclass(eq=False)
class Segment:
    tenant: Tenant
    size: int
    name: str
    fd: int
    inode: int
    key: bytes = b""
    sealed: bool = False
    holders: Counter = field(default_factory=Counter)
    freed_at: float = 0.0
    affinity: Hashable = None  # who mapped it last: recycling prefers them (warm page tables)
    owner: Owner = None  # the round whose working memory it is, or the job that pins it; None: of no job
    refund: int = 0  # reserved bytes it gives back to its round if freed while the round is open
    retained: bool = False  # only retention holds it (accounted as retained bytes, evictable)


class ObjectStore:
    """The agent's side: creation, reference counting, recycling and destruction. It belongs to
    the agent's event loop (one thread), so it takes no lock. Holders and pooled buffers are
    indexed, so that letting a holder go or taking a buffer costs the same however many
    objects the node keeps."""

    def __init__(self, node: str, capacity: int, pool_limit: int) -> None:
        self.node = node
        self.capacity = capacity
        self.pool_limit = pool_limit
        self.ledger = MemoryLedger(capacity)
        self._objects: dict[bytes, Segment] = {}
        self._held: dict[Hashable, set[bytes]] = {}  # holder -> keys of the objects it holds
        self._pool: OrderedDict[int, Segment] = OrderedDict()  # inode -> free segment, oldest first
        self._pool_shapes: dict[tuple[str, int], OrderedDict[int, Segment]] = {}  # (tenant, size) -> free segments
        self._pool_seq = 0
        self.pooled_bytes = 0
        self.recycled = 0
        self.created = 0
        self.on_free: Callable[[bytes], None] | None = None  # told of every object whose last holder let go
        # asked to drop one retained object when memory is short; False when it has none left
        self.reclaim: Callable[[], bool] | None = None
        # asked, once retained objects are gone, to spill idle models of at least so many bytes for
        # a refused tenant (given the refusal's code: lifl.node.spill); False when none is idle
        self.spill: Callable[[str, str, int], bool] | None = None

    @property
    def used_bytes(self) -> int:
        return self.ledger.used

    # -- admission ----------------------------------------------------------------------------
    def admit(self, tenant: Tenant, size: int, holder: Hashable, owner: RoundOf, kind: str, sizes: JobSizes) -> Segment:
        """The object of an admitted input of ``owner`` (a client update or another node's
        partial), created only once what aggregating it needs is reserved; raises ``Overloaded``."""
        self._evicting(lambda: self.ledger.reserve(owner, kind, sizes, size, time.monotonic(), tenant.name), tenant, size)
        try:
            return self.create(tenant, size, holder, affinity="gateway", owner=owner)
        except LiflError:
            self.ledger.withdraw(owner, kind, unused=size)
            raise

    def admit_pinned(self, tenant: Tenant, size: int, holder: Hashable, job: str) -> Segment:
        """The object of the model a client sends for ``job``, created only within its
        tenant's quota and share (``MemoryLedger.admit_pinned``); raises ``Overloaded``."""
        owner = Pinned(job)
        self._evicting(lambda: self.ledger.admit_pinned(owner, size, time.monotonic(), tenant.name), tenant, size)
        return self.create(tenant, size, holder, affinity="gateway", owner=owner)

    def _evicting(self, check: Callable[[], object], tenant: Tenant, size: int) -> None:
        """Run an admission check of ``size`` bytes for ``tenant``; while it finds memory short,
        retained objects go first, then idle models (which come back from their checkpoints)."""
        while True:
            try:
                check()
                return
            except Overloaded as e:
                if e.code == "shm_exhausted" and self.reclaim is not None and self.reclaim():
                    continue
                if e.code not in SPILL_CODES or self.spill is None or not self.spill(e.code, tenant.name, size):
                    raise

    def withdraw(self, owner: RoundOf, kind: str) -> None:
        """An admitted input will not be aggregated: its round gives back what it reserved for it."""
        self.ledger.withdraw(owner, kind)

    def release_round(self, owner: RoundOf) -> None:
        """The round is over here: what it reserved and did not allocate is free again."""
        self.ledger.release_round(owner)

    # -- creation -------------------------------------------------------------------------
    def create(self, tenant: Tenant, size: int, holder: Hashable, affinity: Hashable = None, *,
               owner: Owner = None, scratch: bool = False) -> Segment:
        """A writable object of ``size`` bytes, held by ``holder``; reuses a pooled buffer if any,
        preferably one that ``affinity`` (the process that will map it) has mapped before.
        ``owner``: the round it is working memory of, or ``Pinned(job)`` (a model, a replica, a
        copy for a query: counted against the job's tenant); None: pinned, of no job.
        ``scratch``: a task's accumulator, given back to the round's reservation if it is freed
        before the round ends (a re-run of a crashed task allocates it again)."""
        if size <= 0:
            raise Internal(f"object size must be positive, got {size}")
        self._evicting(lambda: self.ledger.check_object(owner, size), tenant, size)
        seg = self._take_pooled(tenant, size, affinity)
        if seg is None:
            self._make_room(size)
            seg = self._new_segment(tenant, size)
        seg.affinity = affinity
        drawn = self.ledger.add_object(owner, size, tenant.name)
        seg.owner, seg.refund = owner, drawn if scratch else 0
        seg.key = self._fresh_key(tenant, seg)
        self._objects[seg.key] = seg
        self._hold(seg, holder)
        return seg

    def _fresh_key(self, tenant: Tenant, seg: Segment) -> bytes:
        while True:
            key = secrets.token_bytes(KEY_BYTES)
            name = object_name(self.node, tenant.name, key)
            if key in self._objects:
                continue
            try:  # a name taken already (a leftover, or 2^-128 bad luck) is never overwritten
                os.link(_path(seg.name), _path(name))
            except FileExistsError:
                continue
            os.unlink(_path(seg.name))
            seg.name = name
            return key

    def _new_segment(self, tenant: Tenant, size: int) -> Segment:
        self._pool_seq += 1
        name = f"/{node_prefix(self.node)}{tenant.name}-new{self._pool_seq}"
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=WRITING_MODE, size=size)
        except posix_ipc.ExistentialError:
            posix_ipc.unlink_shared_memory(name)  # a leftover of a killed agent with our name
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=WRITING_MODE, size=size)
        except (OSError, ValueError) as e:
            raise Overloaded(f"cannot create a {size}-byte shared-memory object: {e}", code="shm_exhausted") from None
        fd = shm.fd
        if tenant.gid is not None:
            os.fchown(fd, -1, tenant.gid)
        self.created += 1
        return Segment(tenant, size, name, fd, os.fstat(fd).st_ino)

    def _take_pooled(self, tenant: Tenant, size: int, affinity: Hashable) -> Segment | None:
        """A free buffer of this tenant and size: the most recently freed one that ``affinity``
        mapped before (its page tables are warm), else the most recently freed."""
        shape = self._pool_shapes.get((tenant.name, size))
        if not shape:
            return None
        seg = None
        if affinity is not None:
            for candidate in reversed(shape.values()):
                if candidate.affinity == affinity:
                    seg = candidate
                    break
        if seg is None:
            seg = next(reversed(shape.values()))
        self._unpool(seg)
        os.fchmod(seg.fd, WRITING_MODE)
        seg.sealed = False
        self.recycled += 1
        return seg

    def _unpool(self, seg: Segment) -> None:
        del self._pool[seg.inode]
        shape = self._pool_shapes[(seg.tenant.name, seg.size)]
        del shape[seg.inode]
        if not shape:
            del self._pool_shapes[(seg.tenant.name, seg.size)]
        self.pooled_bytes -= seg.size

    def _make_room(self, size: int) -> None:
        """Destroy pooled buffers until ``size`` more fits (the ledger checked that it can)."""
        while self.used_bytes + self.pooled_bytes + size > self.capacity and self._pool:
            seg = next(iter(self._pool.values()))
            self._unpool(seg)
            self._destroy(seg)

    # -- state and references -----------------------------------------------------------------
    def get(self, key: bytes) -> Segment:
        seg = self._objects.get(key)
        if seg is None:
            raise NotFound(f"object {key.hex()} does not exist", code="no_such_object")
        return seg

    def seal(self, key: bytes) -> Segment:
        seg = self.get(key)
        os.fchmod(seg.fd, SEALED_MODE)
        seg.sealed = True
        return seg

    def add_ref(self, key: bytes, holder: Hashable) -> Segment:
        seg = self.get(key)
        self._hold(seg, holder)
        return seg

    def move_ref(self, key: bytes, old: Hashable, new: Hashable) -> None:
        seg = self.get(key)
        self._drop(seg, old)
        self._hold(seg, new)
        self._settle_retention(seg)

    def pin(self, key: bytes) -> None:
        """A round's result became its job's model: pinned, out of the job's working memory."""
        seg = self.get(key)
        if isinstance(seg.owner, RoundOf):
            seg.owner, seg.refund = self.ledger.pin(seg.owner, seg.size), 0

    def hand_over(self, key: bytes, new: Hashable) -> None:
        """Move an object in flight, which has exactly one holder, to ``new``."""
        seg = self.get(key)
        working = [h for h in seg.holders if not retention_holder(h)]
        if len(working) != 1:
            raise Internal(f"object {key.hex()} has holders {sorted(map(repr, seg.holders))}, not one")
        (old,) = working
        count = seg.holders.pop(old)
        self._unindex(old, key)
        seg.holders[new] += count
        self._held.setdefault(new, set()).add(key)

    def pass_on(self, key: bytes, via: Hashable, new: Hashable) -> None:
        """Move an object in flight to ``new``: the one holder it has, or, when tasks of several
        tensor shards hold the same client update, the reference ``via`` holds."""
        seg = self.get(key)
        if sum(not retention_holder(h) for h in seg.holders) == 1:
            self.hand_over(key, new)
        else:
            self.move_ref(key, via, new)

    def discard(self, key: bytes) -> None:
        """Let go of an object whoever holds it (nobody will use it)."""
        seg = self.get(key)
        for holder in list(seg.holders):
            self._unindex(holder, key)
        seg.holders.clear()
        self._free(seg)

    def release(self, key: bytes, holder: Hashable, *, pool: bool = True) -> None:
        """Let ``holder``'s reference go; ``pool``: if it was the last, keep the buffer for the
        next object of its tenant and size (False: give its memory back to the system now)."""
        seg = self.get(key)
        self._drop(seg, holder)
        if not seg.holders:
            self._free(seg, pool)
        else:
            self._settle_retention(seg)

    def release_holder(self, holder: Hashable) -> int:
        """Drop every reference of a holder (a finished or dead task, a closed connection)."""
        keys = self._held.pop(holder, set())
        for key in keys:
            seg = self._objects[key]
            del seg.holders[holder]
            if not seg.holders:
                self._free(seg)
            else:
                self._settle_retention(seg)
        return len(keys)

    def held_by_any(self, key: bytes, which: Callable[[Hashable], bool]) -> bool:
        """Whether a holder of the object (if it still exists) is one of ``which``."""
        seg = self._objects.get(key)
        return seg is not None and any(which(h) for h in seg.holders)

    def holders(self, key: bytes) -> Counter:
        return Counter(self.get(key).holders)

    def _hold(self, seg: Segment, holder: Hashable) -> None:
        seg.holders[holder] += 1
        self._held.setdefault(holder, set()).add(seg.key)

    def _unindex(self, holder: Hashable, key: bytes) -> None:
        keys = self._held.get(holder)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._held[holder]

    def _drop(self, seg: Segment, holder: Hashable) -> None:
        if seg.holders[holder] <= 0:
            del seg.holders[holder]
            raise Internal(f"{holder!r} holds no reference to object {seg.key.hex()}")
        seg.holders[holder] -= 1
        if not seg.holders[holder]:
            del seg.holders[holder]
            self._unindex(holder, seg.key)

    def retain(self, key: bytes) -> None:
        """Account the object as retained if only retention holds it (a fetched-back copy)."""
        self._settle_retention(self.get(key))

    def _settle_retention(self, seg: Segment) -> None:
        """Once only retention holds a sealed object, it no longer counts as its round's working
        memory (or a pinned model) but as retained bytes, which admission evicts first."""
        if not seg.retained and seg.sealed and all(retention_holder(h) for h in seg.holders):
            self.ledger.retain(seg.owner, seg.size, seg.tenant.name)
            seg.owner, seg.refund, seg.retained = None, 0, True

    def _free(self, seg: Segment, pool: bool = True) -> None:
        if self.on_free is not None:
            self.on_free(seg.key)
        del self._objects[seg.key]
        if seg.retained:
            self.ledger.remove_retained(seg.size, seg.tenant.name)
        else:
            self.ledger.remove_object(seg.owner, seg.size, seg.refund)
        seg.owner, seg.refund, seg.retained = None, 0, False
        if not pool or self.pooled_bytes + seg.size > self.pool_limit:
            self._destroy(seg)
            return
        self._pool_seq += 1
        name = f"/{node_prefix(self.node)}{seg.tenant.name}-pool{self._pool_seq}"
        os.rename(_path(seg.name), _path(name))  # its key no longer opens it
        seg.name, seg.key, seg.freed_at = name, b"", time.monotonic()
        self._pool[seg.inode] = seg
        self._pool_shapes.setdefault((seg.tenant.name, seg.size), OrderedDict())[seg.inode] = seg
        self.pooled_bytes += seg.size

    def _destroy(self, seg: Segment) -> None:
        try:
            posix_ipc.unlink_shared_memory(seg.name)
        except posix_ipc.ExistentialError:
            pass
        os.close(seg.fd)

    def trim_pool(self, idle_seconds: float) -> None:
        """Destroy pooled buffers unused for ``idle_seconds`` (memory goes back to the system)."""
        now = time.monotonic()
        for seg in [s for s in self._pool.values() if now - s.freed_at >= idle_seconds]:
            self._unpool(seg)
            self._destroy(seg)

    def object_count(self) -> int:
        return len(self._objects)

    def close(self) -> None:
        """Unlink every object and pooled buffer (clean shutdown)."""
        for seg in list(self._objects.values()) + list(self._pool.values()):
            self._destroy(seg)
        self._objects.clear()
        self._held.clear()
        self._pool.clear()
        self._pool_shapes.clear()
        self.ledger = MemoryLedger(self.capacity)
        self.pooled_bytes = 0


class MappingCache:
    """A process's mappings of shared-memory objects, kept per inode.

    Recycled objects keep their inode, so a process that maps them again finds the mapping
    (and its page tables) still in place: no page faults on the hot path. Entries whose file
    has been destroyed are dropped on the next sweep so they do not pin memory.
    """

    SWEEP_SECONDS = 1.0

    def __init__(self, max_entries: int = 256) -> None:
        self._entries: OrderedDict[tuple[int, int, bool], tuple[mmap.mmap, int]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def map_fd(self, fd: int, *, writable: bool) -> mmap.mmap:
        """Map an open object; the caller keeps ownership of ``fd``."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            raise Internal(f"fd {fd} is not a shared-memory object")
        key = (st.st_ino, st.st_size, writable)
        with self._lock:
            self._sweep()
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
            if writable:  # populating page tables in one go is ~4x cheaper than faulting them in
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            else:  # read faults map 16 pages at a time, cheaper than populate
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self._entries[key] = (mm, os.dup(fd))
            while len(self._entries) > self._max:
                self._evict(next(iter(self._entries)))
            return mm

    def open(self, name: str) -> mmap.mmap:
        """Map an object read-only by name; raises NotFound (or PermissionError) otherwise."""
        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except posix_ipc.ExistentialError:
            raise NotFound(f"shared-memory object {name} does not exist", code="no_such_object") from None
        except posix_ipc.PermissionsError:
            raise PermissionError(errno.EACCES, f"no permission to open {name}") from None
        try:
            return self.map_fd(shm.fd, writable=False)
        finally:
            shm.close_fd()

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < self.SWEEP_SECONDS:
            return
        self._swept = now
        for key, (_, fd) in list(self._entries.items()):
            if os.fstat(fd).st_nlink == 0:
                self._evict(key)

    def _evict(self, key: tuple[int, int, bool]) -> None:
        """Forget a mapping: it is unmapped when its last user lets go of it (at once, if the cache
        was its only one). Never closed here: a task may hold more mappings than the cache keeps
        (a middle folding hundreds of leaves' results at once)."""
        _, fd = self._entries.pop(key)
        os.close(fd)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._evict(key)
