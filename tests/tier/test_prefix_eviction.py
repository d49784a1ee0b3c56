"""A prefix leaves a slot tier from its tail: a block that another block here continues goes
only after that one. Before, the policy took a prefix's head first (it was stored first, so
least recent), and the 9 blocks left after it were held and never served: a request cannot
skip a block."""

from __future__ import annotations

import pytest

from kvtier.tier.books.host import HostTier
from kvtier.tier.books.policy import POLICIES
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.keys import BlockKey, chain_parents, hash_blocks
from kvtier.tier.stores.disk.index import DiskTier

NS = bytes(16)


def chain(seed: int, blocks: int) -> list[BlockKey]:
    return hash_blocks(NS, [seed * 1000 + i for i in range(blocks * 4)], 4)


def store(tier: HostTier | DiskTier, keys: list[BlockKey],
          parents: list[BlockKey | None] | None) -> list[BlockKey]:
    result = tier.prepare_store(keys, [(i,) for i in range(len(keys))], parents=parents)
    assert result is not None
    tier.complete_store(result.keys, True)
    return result.evicted


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("how", ["one store", "a block a step"])
def test_a_full_tier_takes_a_prefix_from_its_tail(policy: str, how: str) -> None:
    host = HostTier(12, policy, tenancy=Tenancy())
    a = chain(1, 10)
    if how == "one store":  # kvtier's engine: a sequence's blocks from its first
        store(host, a, chain_parents(a))
    else:  # vLLM: each block as it fills, its parent stored a step before
        for i, key in enumerate(a):
            store(host, [key], [a[i - 1] if i else None])
    b = chain(2, 4)
    evicted = store(host, b, chain_parents(b))
    assert evicted == [a[9], a[8]]
    assert host.lookup(a) == 8  # 8 blocks still served; the head first would leave 0
    host.check_invariants()


def test_a_hit_keeps_a_prefix_tail_first_and_the_disk_is_told_the_chain() -> None:
    """A hit touches a prefix's head last (most recent); the blocks written down to disk
    carry their parents, so the disk too drops the tail first."""
    tenancy = Tenancy()
    disk = DiskTier(8, tenancy=tenancy)
    a, b = chain(1, 4), chain(2, 4)
    store(disk, a, chain_parents(a))
    store(disk, b, chain_parents(b))
    disk.touch(a)  # a is hit: b is now the older prefix
    evicted = store(disk, chain(3, 2), None)  # two blocks with no chain told
    assert evicted == [b[3], b[2]]
    assert disk.lookup(a) == 4 and disk.lookup(b) == 2


def test_with_no_parents_told_the_policy_order_is_unchanged() -> None:
    host = HostTier(4, tenancy=Tenancy())
    a = chain(1, 4)
    store(host, a, None)
    assert store(host, chain(2, 1), None) == [a[0]]


def test_a_head_goes_when_nothing_else_can() -> None:
    """Tail first is a preference within the rules: with the tail pinned by a load, the
    head still goes if the store needs it (as before), never a refusal that the count of
    evictable slots did not predict."""
    host = HostTier(3, tenancy=Tenancy())
    a = chain(1, 3)
    store(host, a, chain_parents(a))
    host.prepare_load(a[1:])
    evicted = store(host, chain(2, 1), None)
    assert evicted == [a[0]]
    host.check_invariants()
