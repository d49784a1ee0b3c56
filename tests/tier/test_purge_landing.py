"""A purge that comes while a job holds the blocks: a copy still landing on host is dropped
when it lands and never written on to the tiers below (it would outlive the purge there);
a copy being written down is erased from that tier once there, and host's copy dropped
once read. Tiny numbers, no torch: each job answered with the Result a worker would send."""

from __future__ import annotations

from test_retained_fetch import CHUNKS, KEYS, NBYTES, manager

from kvtier.tier.books.manager import FETCHING, TierManager
from kvtier.tier.jobs import Result
from kvtier.tier.keys import Medium


def answer(m: TierManager) -> None:
    """Every job decided so far lands whole, as a worker would say (an erase: each key)."""
    m.apply([Result(j.id, (True,) * n, ("",) * n, NBYTES * j.num_blocks, 1e-6)
             for j in m.take_jobs() for n in [len(j.keys) if j.erase else j.num_blocks]])


def test_a_block_purged_while_landing_is_dropped_and_never_written_below() -> None:
    m = manager()
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")  # decided, not landed
    assert all(m.host.storing(k) for k in KEYS[:4])
    purged = m.purge(KEYS[:4])
    assert purged.host_blocks == 0 and purged.host_in_use == 4  # gone once landed
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


def test_a_block_purged_while_written_to_disk_is_erased_once_there() -> None:
    m = manager()
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")
    answer(m)  # on host now; the writes down to disk decided, not landed
    purged = m.purge(KEYS[:4])
    assert purged.host_in_use == 4  # read by the writes down: dropped once they are done
    assert purged.below == {Medium.DISK: 0}
    answer(m)  # the writes land: their slots are erased at once, the host copies dropped
    assert m.host.lookup(KEYS[:4]) == 0
    answer(m)  # the erase lands
    assert not any(m.below.holds(k) for k in KEYS[:4])
    below = m.report().below
    assert below is not None and below.erased_blocks == {"disk": 4}


def test_a_block_purged_while_fetched_up_from_disk_leaves_both_tiers() -> None:
    m = manager()
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")
    answer(m)
    answer(m)  # on host and on disk
    m.host.remove(KEYS[:4])  # pushed down: only the disk has them
    assert m.match("x", KEYS[:4], CHUNKS[:4]) is FETCHING  # the fetch reads the disk copies
    purged = m.purge(KEYS[:4])
    assert purged.host_in_use == 4 and purged.below == {Medium.DISK: 0}  # all held by it
    answer(m)  # the fetch lands: host drops its copies, the disk slots are erased
    answer(m)  # the erase lands
    m.finished("x")
    assert m.host.lookup(KEYS[:4]) == 0
    assert not any(m.below.holds(k) for k in KEYS[:4])
    below = m.report().below
    assert below is not None and below.erased_blocks == {"disk": 4}
