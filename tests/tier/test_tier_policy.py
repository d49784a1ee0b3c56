"""Eviction policies: LRU and ARC order, ARC's scan resistance and adaptation, the registry."""

import pytest
from conftest import k, ks

from kvtier.errors import ConfigError
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.policy import POLICIES, ARCPolicy, LRUPolicy, make_policy


def never(key: bytes) -> bool:
    return False


def filled(name: str, capacity: int, *ids: int) -> LRUPolicy | ARCPolicy:
    policy = make_policy(name, capacity)
    for i in ids:
        policy.insert(k(i))
    return policy  # type: ignore[return-value]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_untouched_keys_go_oldest_first_and_skipped_keys_stay(name: str) -> None:
    # capacity 3: insert [1, 2, 3] -> evict 1 gives [1]; with 2 pinned, evict 1 gives [3]
    policy = filled(name, 3, 1, 2, 3)
    assert policy.evict(1, never) == ks(1)
    assert policy.evict(1, lambda key: key == k(2)) == ks(3)
    assert len(policy) == 1 and k(2) in policy and k(1) not in policy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_evict_more_than_evictable_is_none_and_changes_nothing(name: str) -> None:
    # capacity 3: insert [1, 2, 3], 3 pinned -> evict 3 is None; all three still resident
    policy = filled(name, 3, 1, 2, 3)
    assert policy.evict(3, lambda key: key == k(3)) is None
    assert len(policy) == 3
    assert policy.evict(0, never) == []
    assert policy.evict(3, never) == ks(1, 2, 3)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_touch_protects_a_key_and_remove_forgets_it(name: str) -> None:
    # capacity 3: insert [1, 2, 3]; touch [1]; remove [2] -> evict 2 gives [3, 1]
    policy = filled(name, 3, 1, 2, 3)
    policy.touch(k(1))
    policy.touch(k(9))  # not resident: ignored
    policy.remove(k(2))
    policy.remove(k(9))  # not resident: ignored
    assert len(policy) == 2 and k(2) not in policy
    assert policy.evict(2, never) == ks(3, 1)


def test_lru_evicts_the_least_recently_touched() -> None:
    # capacity 3: insert [1, 2, 3]; touch [2, 1] -> evict order [3, 2, 1]
    policy = filled("lru", 3, 1, 2, 3)
    policy.touch(k(2))
    policy.touch(k(1))
    assert policy.evict(3, never) == ks(3, 2, 1)


def test_arc_evicts_seen_once_keys_before_hit_keys() -> None:
    # capacity 3: insert [1, 2, 3]; touch [1] -> 1 moves to t2; while p = 0, t1 empties
    # first: evict order [2, 3, 1] (as LRU here; the scan test below shows where they differ)
    policy = filled("arc", 3, 1, 2, 3)
    assert isinstance(policy, ARCPolicy)
    policy.touch(k(1))
    assert list(policy.t2) == ks(1) and list(policy.t1) == ks(2, 3)
    assert policy.evict(3, never) == ks(2, 3, 1)
    assert list(policy.b1) == ks(2, 3) and list(policy.b2) == ks(1)


def test_arc_ghost_hits_move_the_target_p_both_ways() -> None:
    # capacity 3: insert [1]; touch [1] (t2); insert [2, 3]; evict -> [2] (ghost in b1);
    # insert 4; evict -> [3]
    policy = filled("arc", 3, 1)
    assert isinstance(policy, ARCPolicy)
    policy.touch(k(1))
    policy.insert(k(2))
    policy.insert(k(3))
    assert policy.evict(1, never) == ks(2)
    policy.insert(k(4))
    assert policy.evict(1, never) == ks(3)
    # insert 2 again: its ghost is in b1 -> t1 was too small: p 0 -> 1, and 2 enters t2
    policy.insert(k(2))
    assert policy.p == 1.0 and list(policy.t2) == ks(1, 2) and list(policy.t1) == ks(4)
    # |t1| = 1 is not above p = 1 -> t2's oldest goes: evict -> [1] (ghost in b2)
    assert policy.evict(1, never) == ks(1)
    policy.insert(k(5))
    # |t1| = 2 > p = 1 -> evict -> [4]; insert 1 again: ghost in b2 -> p 1 -> 0
    assert policy.evict(1, never) == ks(4)
    policy.insert(k(1))
    assert policy.p == 0.0 and list(policy.t2) == ks(2, 1)


def test_arc_ghost_lists_stay_bounded_and_remove_drops_the_ghost() -> None:
    # capacity 3: one hot key in t2, then 20 one-time keys -> |t1| + |b1| <= 3, all <= 6
    policy = ARCPolicy(3)
    policy.insert(k(0))
    policy.touch(k(0))
    for i in range(1, 21):
        if len(policy) == 3:
            assert policy.evict(1, never) != ks(0)
        policy.insert(k(i))
        assert len(policy.t1) + len(policy.b1) <= 3
        assert len(policy) + len(policy.b1) + len(policy.b2) <= 6
    assert list(policy.t2) == ks(0) and list(policy.b1) == ks(18)
    policy.remove(k(18))
    assert not policy.b1
    policy.evict(1, never)
    policy.insert(k(18))  # a plain new key now, not a ghost hit: p stays 0
    assert policy.p == 0.0 and k(18) in policy.t1


def store(tier: HostTier, *ids: int) -> None:
    result = tier.prepare_store(ks(*ids), [[i] for i in ids])
    assert result is not None
    tier.complete_store(result.keys, success=True)


@pytest.mark.parametrize(("name", "hot_kept"), [("lru", 0), ("arc", 2)])
def test_a_scan_flushes_hot_keys_under_lru_but_not_under_arc(name: str, hot_kept: int) -> None:
    # capacity 3: store [1, 2]; touch [1, 2]; scan [10 .. 19] one store each
    # -> LRU: the scan's 2nd key evicts 1, its 3rd evicts 2; ARC: the scan only churns t1
    tier = HostTier(3, policy=name)
    store(tier, 1, 2)
    tier.touch(ks(1, 2))
    for i in range(10, 20):
        assert tier.lookup(ks(i)) == 0
        store(tier, i)
    assert tier.lookup(ks(1, 2)) == hot_kept
    assert tier.lookup(ks(19)) == 1
    tier.check_invariants()


def test_unknown_policy_is_a_config_error_listing_the_choices() -> None:
    with pytest.raises(ConfigError, match="'fifo' is unknown; choose one of arc, lru"):
        make_policy("fifo", 4)
    with pytest.raises(ConfigError, match="choose one of arc, lru"):
        HostTier(4, policy="LRU")
    with pytest.raises(ConfigError, match="capacity=0"):
        ARCPolicy(0)
    with pytest.raises(ConfigError, match="num_slots=0"):
        HostTier(0)
