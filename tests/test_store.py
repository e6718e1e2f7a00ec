"""Object store lifecycle: references, recycling, capacity, mapping cache; nothing leaks."""

from __future__ import annotations

import os

import pytest

from lifl.errors import Internal, NotFound, Overloaded
from lifl.ledger import UPDATE, JobSizes, RoundOf
from lifl.store import SHM_DIR, SEALED_MODE, WRITING_MODE, MappingCache, ObjectStore, Tenant, object_name, remove_node_objects

T = Tenant("acme")


def names(node: str) -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"lifl-{node}-*")}


def test_lifecycle_refs_seal_and_recycle_keep_the_inode(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=16 << 20, pool_limit=8 << 20)
    seg = store.create(T, 1 << 20, "upload")
    key, inode, name = seg.key, seg.inode, seg.name
    assert len(key) == 16 and names(shm_node) == {object_name(shm_node, "acme", key)[1:]}
    assert os.stat(SHM_DIR / seg.name[1:]).st_mode & 0o777 == WRITING_MODE
    store.seal(key)
    assert os.stat(SHM_DIR / seg.name[1:]).st_mode & 0o777 == SEALED_MODE
    store.move_ref(key, "upload", "task")
    store.add_ref(key, "reader")
    store.release(key, "task")
    assert store.object_count() == 1  # the reader still holds it
    with pytest.raises(Internal, match="holds no reference"):
        store.release(key, "task")
    store.release(key, "reader")
    assert store.object_count() == 0 and store.pooled_bytes == 1 << 20
    assert not (SHM_DIR / name[1:]).exists()  # its key no longer opens it...
    pooled = names(shm_node)
    assert len(pooled) == 1 and "-acme-pool" in next(iter(pooled))  # ...it waits in the pool, renamed
    assert os.stat(SHM_DIR / next(iter(pooled))).st_ino == inode
    with pytest.raises(NotFound):
        store.get(key)
    again = store.create(T, 1 << 20, "upload")
    assert again.inode == inode and again.key != key and store.recycled == 1  # pages already faulted in
    assert store.create(Tenant("other"), 1 << 20, "x").inode != inode  # never across tenants
    store.close()
    assert names(shm_node) == set()


def test_capacity_evicts_the_pool_then_pushes_back(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=3 << 20, pool_limit=3 << 20)
    a = store.create(T, 1 << 20, "h")
    store.release(a.key, "h")
    assert store.pooled_bytes == 1 << 20
    big = store.create(T, 3 << 20, "h")  # evicts the pooled buffer to make room
    assert store.pooled_bytes == 0 and store.used_bytes == 3 << 20
    with pytest.raises(Overloaded) as info:
        store.create(T, 1, "h")
    assert info.value.code == "shm_exhausted"
    store.release(big.key, "h")
    store.close()


def test_pool_limit_destroys_what_it_cannot_keep(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=8 << 20, pool_limit=1 << 20)
    segs = [store.create(T, 1 << 20, "h") for _ in range(3)]
    for s in segs:
        store.release(s.key, "h")
    assert store.pooled_bytes == 1 << 20 and len(names(shm_node)) == 1
    store.trim_pool(idle_seconds=0)
    assert names(shm_node) == set()
    store.close()


def test_release_holder_frees_everything_of_a_dead_holder(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=8 << 20, pool_limit=0)
    keys = [store.create(T, 4096, "dead").key for _ in range(3)]
    store.add_ref(keys[0], "alive")
    assert store.release_holder("dead") == 3
    assert store.object_count() == 1 and store.holders(keys[0]) == {"alive": 1}
    store.close()


def test_mapping_cache_reuses_mappings_of_recycled_objects_and_drops_destroyed_ones(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=8 << 20, pool_limit=8 << 20)
    cache = MappingCache()
    seg = store.create(T, 1 << 20, "h")
    first = cache.map_fd(seg.fd, writable=True)
    first[:5] = b"hello"
    store.seal(seg.key)
    ro = cache.open(seg.name)
    assert ro[:5] == b"hello"
    with pytest.raises(TypeError):
        ro[:1] = b"x"  # readers map read-only
    store.release(seg.key, "h")
    again = store.create(T, 1 << 20, "h")
    assert cache.map_fd(again.fd, writable=True) is first  # same inode: same mapping, warm page tables
    store.release(again.key, "h")
    store.close()  # destroyed: the cache must let go on its next sweep
    cache._swept = 0
    cache._sweep()
    assert not cache._entries


def test_mappings_past_the_caches_size_stay_valid_for_whoever_holds_them(shm_node: str) -> None:
    """A task may hold more inputs mapped than the cache keeps (a middle folding hundreds of
    leaves' results at once): the cache forgets the oldest, but never unmaps what is in use."""
    store = ObjectStore(shm_node, capacity=8 << 20, pool_limit=8 << 20)
    cache = MappingCache(max_entries=2)
    try:
        held = []
        for i in range(5):
            seg = store.create(T, 4096, "h")
            os.pwrite(seg.fd, bytes([i]) * 8, 0)
            store.seal(seg.key)
            held.append(cache.open(seg.name))
        assert len(cache._entries) == 2 and [mm[0] for mm in held] == [0, 1, 2, 3, 4]
    finally:
        store.close()


def test_open_of_a_missing_object_names_it(shm_node: str) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        MappingCache().open(object_name(shm_node, "acme", bytes(16)))


def test_remove_node_objects_only_touches_that_node(shm_node: str) -> None:
    mine = SHM_DIR / f"lifl-{shm_node}-acme-{'ab' * 16}"
    other = SHM_DIR / f"lifl-{shm_node}x-acme-{'ab' * 16}"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert remove_node_objects(shm_node) == 1
        assert other.exists() and not mine.exists()
    finally:
        other.unlink(missing_ok=True)


def test_recycling_prefers_the_buffer_the_caller_mapped_before(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=8 << 20, pool_limit=8 << 20)
    a = store.create(T, 4096, "h", affinity="instance-1")
    b = store.create(T, 4096, "h", affinity="instance-2")
    inode_a = a.inode
    store.release(a.key, "h")
    store.release(b.key, "h")
    assert store.create(T, 4096, "h", affinity="instance-1").inode == inode_a
    store.close()


SIZES = JobSizes(accumulator=3 << 20, model=1 << 20, leaf_fan_in=2)
ROUND = RoundOf("j", 0)


def test_an_admitted_update_reserves_its_aggregation_and_tasks_draw_from_it(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=16 << 20, pool_limit=16 << 20)
    first = store.admit(T, 1 << 20, "upload", ROUND, UPDATE, SIZES)  # itself and the next model
    second = store.admit(T, 1 << 20, "upload", ROUND, UPDATE, SIZES)  # itself and the leaf's accumulator
    assert (store.used_bytes, store.ledger.reserved) == (2 << 20, 4 << 20)
    with pytest.raises(Overloaded) as info:  # 10 MiB are free, but not for a model outside the reservations
        store.create(T, 11 << 20, "replica")
    assert info.value.code == "shm_exhausted"
    acc = store.create(T, 3 << 20, "task", owner=ROUND, scratch=True)
    assert store.ledger.usage("j").__dict__ == {"working": 5 << 20, "reserved": 1 << 20}
    store.release(acc.key, "task")  # its instance died: the re-run allocates it again from the reservation
    assert store.ledger.usage("j").reserved == 4 << 20
    model = store.create(T, 1 << 20, "pending", owner=ROUND, scratch=True)
    store.pin(model.key)  # installed: a model, no longer the round's
    assert (store.ledger.pinned, store.ledger.usage("j").working) == (1 << 20, 2 << 20)
    store.release_round(ROUND)
    for seg, holder in ((first, "upload"), (second, "upload"), (model, "pending")):
        store.release(seg.key, holder)
    assert store.used_bytes == 0 and store.ledger.reserved == 0 and store.ledger.jobs == {}
    store.close()


def test_admission_at_the_limit_and_one_past_it(shm_node: str) -> None:
    store = ObjectStore(shm_node, capacity=(2 << 20) + 1, pool_limit=1 << 20)
    pooled = store.create(T, 1, "h")
    store.release(pooled.key, "h")  # a pooled buffer counts as free: it is evicted to make room
    seg = store.admit(T, 1 << 20, "upload", ROUND, UPDATE, SIZES)  # 1 MiB and the next model: 1 byte to spare
    store.create(T, 1, "model")  # exactly the last free byte
    with pytest.raises(Overloaded) as info:
        store.create(T, 1, "model")
    assert info.value.code == "shm_exhausted"
    store.withdraw(ROUND, UPDATE)  # the upload is aborted: the model's reservation goes back
    store.release(seg.key, "upload")
    assert store.ledger.free == 2 << 20
    store.close()
    small = ObjectStore(shm_node, capacity=(2 << 20) - 1, pool_limit=0)
    with pytest.raises(Overloaded) as info:
        small.admit(T, 1 << 20, "upload", ROUND, UPDATE, SIZES)
    assert info.value.code == "shm_too_small" and small.object_count() == 0 and small.ledger.jobs == {}
    small.close()
    assert names(shm_node) == set()
