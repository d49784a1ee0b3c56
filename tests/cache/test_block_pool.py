"""The device block pool: references, LRU reuse of freed blocks, the prefix index."""

from kvtier.cache.block_pool import BlockPool
from kvtier.tier.fingerprint import Fingerprint
from kvtier.tier.keys import hash_block, hash_blocks

NS = b"\x00" * 16


def test_allocate_all_then_none_and_nothing_taken() -> None:
    # 3 blocks: take 2, asking for 2 more fails and takes nothing
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    pool.check_invariants()


def test_cached_free_blocks_are_reused_least_recently_freed_first() -> None:
    # capacity 3: register blocks 0 and 1, free 0 then 1 -> a fresh allocation takes the
    # uncached block 2 first, then 0 (freed earliest), evicting its key
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)  # type: ignore[misc]
    pool.register(a, hash_block(NS, [1]), [1])
    pool.register(b, hash_block(NS, [2]), [2])
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.allocate(1) == [c]
    assert pool.allocate(1) == [a]
    assert pool.num_cached == 1 and pool.stats.evictions == 1
    pool.check_invariants()


def test_lookup_confirms_tokens_and_touch_revives_a_free_block() -> None:
    pool = BlockPool(2)
    keys = hash_blocks(NS, [1, 2, 3, 4], block_size=2)
    ids = pool.allocate(2)
    assert ids is not None
    for block_id, key, toks in zip(ids, keys, ([1, 2], [3, 4])):
        pool.register(block_id, key, toks)
    pool.free(list(reversed(ids)))
    assert pool.num_free == 2
    hits = pool.lookup(keys, [[1, 2], [3, 4]])
    assert hits == ids
    pool.touch(hits)
    assert pool.num_free == 0 and pool.ref_cnt == [1, 1]
    # a key whose stored tokens differ is a miss, never served
    assert pool.lookup(keys[:1], [[9, 9]]) == []
    assert pool.stats.key_collisions == 1
    pool.check_invariants()


def test_chained_keys_depend_on_the_whole_prefix_and_namespace() -> None:
    # block 2's tokens are equal but its parents differ -> different keys
    k1 = hash_blocks(NS, [1, 2, 5, 6], 2)
    k2 = hash_blocks(NS, [3, 4, 5, 6], 2)
    assert k1[1] != k2[1]
    other = hash_blocks(b"\x01" * 16, [1, 2, 5, 6], 2)
    assert other[0] != k1[0]


def test_fingerprint_fields_and_salt_change_the_namespace() -> None:
    base = Fingerprint("w", "arch", "float32", 16, "tok")
    assert base.namespace() == Fingerprint("w", "arch", "float32", 16, "tok").namespace()
    changed = [
        Fingerprint("w2", "arch", "float32", 16, "tok"),
        Fingerprint("w", "arch2", "float32", 16, "tok"),
        Fingerprint("w", "arch", "bfloat16", 16, "tok"),
        Fingerprint("w", "arch", "float32", 32, "tok"),
        Fingerprint("w", "arch", "float32", 16, "tok2"),
        Fingerprint("w", "arch", "float32", 16, "tok", kv_layout_version=2),
    ]
    namespaces = {f.namespace() for f in changed} | {base.namespace(), base.namespace("tenant")}
    assert len(namespaces) == len(changed) + 2


def test_prefix_caching_off_never_hits() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    ids = pool.allocate(1)
    assert ids is not None
    assert not pool.register(ids[0], hash_block(NS, [1]), [1])
    assert pool.lookup([hash_block(NS, [1])], [[1]]) == []


def test_allocate_run_prefers_a_window_that_evicts_nothing() -> None:
    # 8 blocks: 2 and 5 in use; 0 and 1 hold cached prefixes -> a run of 2 is taken at 3-4
    pool = BlockPool(8)
    ids = pool.allocate(8)
    assert ids is not None
    pool.register(0, hash_block(NS, [1]), [1])
    pool.register(1, hash_block(NS, [2]), [2])
    pool.free([0, 1, 3, 4, 6, 7])
    assert pool.allocate_run(2) == [3, 4]
    assert pool.num_cached == 2  # nothing evicted
    # a run of 3 does not exist among the free blocks (0, 1, 6, 7): fall back is the caller's
    assert pool.allocate_run(3) is None
    pool.check_invariants()
