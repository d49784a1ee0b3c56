"""The host tier's two-phase protocol: storing is not a hit, failures roll back, pins hold."""

import pytest
from conftest import ks

from kvtier.tier.books.host import HostTier
from kvtier.tier.books.policy import POLICIES
from kvtier.tier.books.protocol import PrepareStoreResult, SlotIndex
from kvtier.tier.keys import Medium, hash_blocks


def toks(*ids: int) -> list[list[int]]:
    return [[i, i] for i in ids]


def store(tier: HostTier, *ids: int) -> PrepareStoreResult:
    result = tier.prepare_store(ks(*ids), toks(*ids))
    assert result is not None
    tier.complete_store(result.keys, success=True)
    return result


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_host_tier_is_a_tier() -> None:
    tier: SlotIndex = HostTier(2)
    assert tier.medium is Medium.HOST and tier.num_slots == 2


def test_store_then_touch_decides_the_victim(policy: str) -> None:
    # capacity 2: store [1, 2]; touch [1]; store [3] -> evicts [2], 3 reuses 2's slot
    tier = HostTier(2, policy)
    assert store(tier, 1, 2).slots == [0, 1]
    tier.touch(ks(1))
    assert store(tier, 3) == PrepareStoreResult(ks(3), [1], ks(2))
    assert tier.lookup(ks(1)) == 1 and tier.lookup(ks(2)) == 0 and tier.lookup(ks(3)) == 1
    assert tier.stats.evictions == 1
    tier.check_invariants()


def test_a_key_being_stored_is_not_a_hit_until_it_completes(policy: str) -> None:
    # capacity 4: store [1]; prepare [2] -> lookup [1, 2] counts 1; complete -> counts 2
    tier = HostTier(4, policy)
    store(tier, 1)
    result = tier.prepare_store(ks(2), toks(2))
    assert result is not None and result.keys == ks(2)
    assert tier.lookup(ks(1, 2)) == 1
    tier.touch(ks(2))  # storing: ignored
    with pytest.raises(KeyError, match="not present and complete"):
        tier.prepare_load(ks(2))
    # a second store of [1, 2, 3] copies only 3: 1 is present, 2 already on its way
    again = tier.prepare_store(ks(1, 2, 3), toks(1, 2, 3))
    assert again is not None and again.keys == ks(3) and again.slots == [2]
    tier.complete_store(ks(2, 3), success=True)
    assert tier.lookup(ks(1, 2, 3)) == 3
    tier.check_invariants()


def test_a_failed_store_frees_its_slots_and_is_never_a_hit(policy: str) -> None:
    # capacity 2: prepare [1, 2]; complete failed -> both forgotten, slots free again
    tier = HostTier(2, policy)
    result = tier.prepare_store(ks(1, 2), toks(1, 2))
    assert result is not None and result.slots == [0, 1]
    tier.complete_store(result.keys, success=False)
    assert tier.lookup(ks(1)) == 0 and tier.lookup(ks(1), toks(1)) == 0
    stats = tier.stats
    assert (stats.used, stats.pinned, stats.stores, stats.store_failures) == (0, 0, 0, 2)
    # the slots are reused without evicting anything, and a retry may succeed
    assert store(tier, 2, 1) == PrepareStoreResult(ks(2, 1), [0, 1], [])
    assert tier.lookup(ks(1)) == 1
    with pytest.raises(KeyError, match="not being stored"):
        tier.complete_store(ks(1), success=False)  # already complete: a caller bug
    tier.check_invariants()


def test_pinned_slots_are_never_evicted(policy: str) -> None:
    # capacity 2: store [1, 2]; load [1] -> store [3] evicts [2] although 1 is older
    tier = HostTier(2, policy)
    store(tier, 1, 2)
    assert tier.prepare_load(ks(1)) == [0]
    three = tier.prepare_store(ks(3), toks(3))
    assert three == PrepareStoreResult(ks(3), [1], ks(2))
    # 1 loading, 3 storing: nothing can go -> store [4] is None and nothing changed
    before = tier.stats
    assert tier.prepare_store(ks(4), toks(4)) is None
    assert tier.stats == before and before.pinned == 2 and before.used == 2
    assert tier.remove(ks(1, 3)) == 0
    # unpinned again -> store [4] evicts [1], the least recently used
    tier.complete_load(ks(1))
    tier.complete_store(ks(3), success=True)
    assert store(tier, 4).evicted == ks(1)
    tier.check_invariants()


def test_nothing_changes_when_a_batch_cannot_fit(policy: str) -> None:
    # capacity 3: store [1, 2]; store [3, 4, 5, 6] needs 4 slots of 3 -> None, 1 and 2 stay
    tier = HostTier(3, policy)
    store(tier, 1, 2)
    before = tier.stats
    assert tier.prepare_store(ks(3, 4, 5, 6), toks(3, 4, 5, 6)) is None
    assert tier.stats == before and tier.lookup(ks(1, 2)) == 2
    assert tier.prepare_store([], []) == PrepareStoreResult([], [], [])
    tier.check_invariants()


def test_keys_of_the_batch_are_not_evicted_to_make_room_for_it(policy: str) -> None:
    # capacity 2: store [1]; store [2]; store [1, 3] -> evicts [2] although 1 is older
    tier = HostTier(2, policy)
    store(tier, 1)
    store(tier, 2)
    assert store(tier, 1, 3) == PrepareStoreResult(ks(3), [1], ks(2))
    # capacity 2: store [1, 3, 4] cannot evict 1 or 3 -> None
    assert tier.prepare_store(ks(1, 3, 4), toks(1, 3, 4)) is None
    tier.check_invariants()


def test_concurrent_loads_hold_one_pin_each(policy: str) -> None:
    # capacity 1: store [1]; two loads of [1] share slot 0; one completion leaves it pinned
    tier = HostTier(1, policy)
    store(tier, 1)
    assert tier.prepare_load(ks(1)) == [0]
    assert tier.prepare_load(ks(1)) == [0]
    assert tier.stats.pinned == 1
    tier.complete_load(ks(1))
    assert tier.prepare_store(ks(2), toks(2)) is None
    assert tier.remove(ks(1)) == 0
    tier.complete_load(ks(1), success=False)
    with pytest.raises(KeyError, match="no load pin left"):
        tier.complete_load(ks(1))
    stats = tier.stats
    assert (stats.loads, stats.load_failures, stats.pinned) == (1, 1, 0)
    assert tier.lookup(ks(1)) == 1  # a failed load leaves the stored block a hit
    assert tier.remove(ks(1)) == 1 and tier.lookup(ks(1)) == 0
    tier.check_invariants()


def test_prepare_load_of_an_absent_key_pins_nothing() -> None:
    # store [1]; load [1, 9] raises (9 absent) -> 1 is not pinned
    tier = HostTier(2)
    store(tier, 1)
    with pytest.raises(KeyError, match="lookup first"):
        tier.prepare_load(ks(1, 9))
    assert tier.stats.pinned == 0 and tier.remove(ks(1)) == 1


def test_token_mismatch_is_a_miss_and_counted() -> None:
    # store [1, 2] with tokens [[1, 1], [2, 2]]; asking with [[1, 1], [2, 9]] -> 1 hit
    tier = HostTier(4)
    store(tier, 1, 2)
    assert tier.lookup(ks(1, 2), [[1, 1], [2, 9]]) == 1
    assert tier.lookup(ks(1), [[1]]) == 0  # a shorter chunk is a mismatch too
    assert tier.lookup(ks(1, 2)) == 2  # no tokens given: presence only
    stats = tier.stats
    assert (stats.lookups, stats.hits, stats.collisions) == (5, 3, 2)


def test_remove_drops_only_present_unpinned_keys() -> None:
    # capacity 4: store [1, 2, 3]; load [2]; prepare [4] -> remove [1, 2, 4, 9] drops only 1
    tier = HostTier(4)
    store(tier, 1, 2, 3)
    tier.prepare_load(ks(2))
    tier.prepare_store(ks(4), toks(4))
    assert tier.remove(ks(1, 2, 4, 9, 1)) == 1
    assert tier.lookup(ks(1)) == 0 and tier.lookup(ks(2, 3)) == 2
    assert tier.stats.used == 3
    tier.check_invariants()


def test_per_request_keys_of_any_length_hold_partial_blocks(policy: str) -> None:
    # a preempted request's 2 full blocks (content keys) and its partial last block [9, 10]
    # (key b"swap:req-7:2") are stored and confirmed the same way
    tier = HostTier(4, policy)
    tokens = [1, 2, 3, 4, 9, 10]
    keys = [*hash_blocks(b"\x00" * 16, tokens, block_size=2)[:2], b"swap:req-7:2"]
    chunks = [[1, 2], [3, 4], [9, 10]]
    result = tier.prepare_store(keys, chunks)
    assert result is not None and result.slots == [0, 1, 2]
    tier.complete_store(result.keys, success=True)
    assert tier.lookup(keys, chunks) == 3
    assert tier.lookup([b"swap:req-7:2"], [[9, 10, 11]]) == 0
    assert tier.prepare_load([b"swap:req-7:2"]) == [2]
    tier.complete_load([b"swap:req-7:2"])
    assert tier.remove([b"swap:req-7:2"]) == 1
    tier.check_invariants()


def test_stats_count_keys_and_report_occupancy() -> None:
    # capacity 2: store [1, 2]; hit and load [1]; store [3] evicts [2]; lookup [1, 3]
    tier = HostTier(2)
    store(tier, 1, 2)
    assert tier.lookup(ks(1)) == 1
    tier.touch(ks(1))  # lookup and prepare_load record no hit for the policy: touch does
    tier.prepare_load(ks(1))
    tier.complete_load(ks(1))
    store(tier, 3)
    tier.lookup(ks(1, 3))
    stats = tier.stats
    assert (stats.stores, stats.loads, stats.evictions) == (3, 1, 1)
    assert (stats.lookups, stats.hits, stats.used, stats.capacity) == (3, 3, 2, 2)
    stats.hits = 99  # a snapshot: the tier's counters are not shared
    assert tier.stats.hits == 3


def test_held_keys_are_not_evicted_and_room_counts_them(policy: str) -> None:
    tier = HostTier(3, policy)
    store(tier, 1, 2, 3)
    assert tier.room() == 3  # all complete and unpinned: a store could evict any
    tier.hold(ks(1, 2))  # fetched blocks waiting for their request's admission
    assert tier.room() == 1
    assert tier.prepare_store(ks(4, 5), toks(4, 5)) is None  # only key 3 may go
    assert tier.stats.loads == 0  # a hold is not a load
    tier.release(ks(1, 2))
    assert tier.room() == 3 and tier.stats.pinned == 0
    with pytest.raises(KeyError):
        tier.release(ks(1))
    with pytest.raises(KeyError):
        tier.hold(ks(9))
    tier.check_invariants()
