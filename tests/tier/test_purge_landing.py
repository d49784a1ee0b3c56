"""A purge that comes while the blocks' copy into host is still on its way: the copy is
dropped when it lands and never written on to the tiers below (it would outlive the purge
there). Tiny numbers, no torch: each job answered with the Result a worker would send."""

from __future__ import annotations

from test_retained_fetch import CHUNKS, KEYS, answer, manager

from kvtier.tier.keys import Medium


def test_a_block_purged_while_landing_is_dropped_and_never_written_below() -> None:
    m = manager()
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")  # decided, not landed
    assert all(m.host.storing(k) for k in KEYS[:4])
    purged = m.purge(KEYS[:4])
    assert purged.host_blocks == 4 and purged.host_in_use == 0
    assert purged.below == {Medium.DISK: 0}  # nothing there yet to erase
    answer(m)  # the stores land now: dropped, nothing goes down
    assert m.host.lookup(KEYS[:4]) == 0
    assert not any(m.below.holds(k) for k in KEYS[:4])
    assert not [j for j in m.take_jobs() if j.dst is Medium.DISK and not j.erase]


def test_a_purge_leaves_other_landing_blocks_alone() -> None:
    m = manager()
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")
    m.purge(KEYS[:2])
    answer(m)
    assert m.host.lookup(KEYS[2:4]) == 2  # kept, and on their way down
    answer(m)
    assert all(m.below.holds(k) for k in KEYS[2:4])
