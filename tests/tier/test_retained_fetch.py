"""A retained prefix that went down to disk comes back up even when the host is full of
retained blocks: its owner's other retained blocks that the disk keeps go down to make room
(they stay retained there), never another tenant's. Tiny numbers, no torch: the test answers
each job with the Result a worker would send."""

from __future__ import annotations

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import FETCHING, TierManager, job_ids
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.config import TierConfig
from kvtier.tier.jobs import Result
from kvtier.tier.keys import hash_blocks
from kvtier.tier.load_policy import Decline
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.stores.disk.index import DiskTier

BS, NBYTES = 4, 1000
TOKENS = list(range(100, 156))  # 14 blocks of 4
KEYS = hash_blocks(b"\x00" * 16, TOKENS, BS)
CHUNKS = [TOKENS[i * BS:(i + 1) * BS] for i in range(len(KEYS))]
X, Y, Z = slice(0, 4), slice(4, 8), slice(8, 14)  # two retained sessions, and a burst


def manager() -> TierManager:
    """Host 10 over disk 20, one tenancy; restoring always beats recomputing."""
    ids, tenancy = job_ids(), Tenancy(max_retention_s=3600.0)
    host, disk = HostTier(10, tenancy=tenancy), DiskTier(20, tenancy=tenancy)
    planner = Planner(Calibration(link_gbps=10.0, transfer_overhead_s=0.0,
                                  prefill_tokens_per_s=1.0, tier_gbps={"disk": 1.0}))
    return TierManager(TierConfig.of(kv_offloading_size=1), BS, host, planner, NBYTES,
                       BelowHost(host, [disk], NBYTES, ids), ids)


def answer(m: TierManager) -> None:
    """Every job decided so far lands, as a worker would say."""
    m.apply([Result(j.id, (True,) * j.num_blocks, ("",) * j.num_blocks,
                    NBYTES * j.num_blocks, 1e-6) for j in m.take_jobs()])


def stored(m: TierManager, part: slice, tenant: str, retain: bool) -> None:
    """`part`'s blocks stored for `tenant` (retained or not), written down to disk."""
    m.store(list(range(part.start, part.stop)), KEYS[part], CHUNKS[part], tenant=tenant)
    answer(m)  # the stores land; the writes down are decided
    answer(m)  # the writes land
    if retain:
        assert m.retain(KEYS[part], tenant, 600.0).refused is None


def full_host(owner_of_y: str) -> TierManager:
    """X (tenant a, retained) only on disk; Y (`owner_of_y`, retained) on host and disk; the
    host's other six slots pinned by a burst still being stored: no unretained slot left."""
    m = manager()
    stored(m, X, "a", True)
    stored(m, Y, owner_of_y, True)
    m.host.remove(KEYS[X])  # pushed down earlier: only the disk has X now
    m.store(list(range(Z.start, Z.stop)), KEYS[Z], CHUNKS[Z], tenant="burst")  # in flight
    assert m.host.room() == 0
    return m


def test_a_retained_session_comes_back_by_sending_its_owners_other_one_down() -> None:
    m = full_host("a")
    assert m.host.room("a", m.below.holds) == 4  # Y: a's own, and the disk keeps it
    assert m.match("x", KEYS[X], CHUNKS[X]) is FETCHING
    answer(m)  # the burst's stores and X's fetch land
    again = m.match("x", KEYS[X], CHUNKS[X])
    assert again is not None and list(again.load_keys) == KEYS[X]
    tenancy = m.host.tenancy
    assert m.host.lookup(KEYS[Y]) == 0 and m.below.holds(KEYS[Y][0])  # down, not away
    assert all(tenancy.retained(k) for k in KEYS[:8])  # both sessions still retained
    m.finished("x")


def test_another_tenants_retained_blocks_never_make_room() -> None:
    m = full_host("b")
    assert m.host.room("a", m.below.holds) == 0
    declined = m.match("x", KEYS[X], CHUNKS[X])
    assert declined is not None and not declined.load_keys  # recomputed, and said why
    assert m.host.lookup(KEYS[Y]) == 4
    assert dict(declined.declined_by) == {Decline.NO_ROOM: 16}


def test_a_reset_releases_every_retention_it_made_unreachable() -> None:
    # X and Y retained on disk (Y on host too); a cache reset (new weights) drops the host's
    # blocks and ends both retentions: the disk keeps the blocks, pinned by nobody, counted
    # retained nowhere, and a burst may now evict them.
    m = manager()
    stored(m, X, "a", True)
    stored(m, Y, "b", True)
    tenancy = m.host.tenancy
    assert tenancy.counts["a"].retained["disk"] == 4 and tenancy.any_retained
    assert m.reset() == 8
    assert not tenancy.any_retained
    assert not any(tenancy.retained(k) for k in KEYS[:8])
    assert sum(tenancy.counts["a"].retained.values()) == 0
    assert sum(tenancy.counts["b"].retained.values()) == 0
    assert all(m.below.holds(k) for k in KEYS[:8])  # down, not away


def test_a_fetch_with_no_room_still_loads_what_host_holds() -> None:
    # X on host (retained by b), Y after it only on disk, the host's other six slots pinned
    # by a burst: Y cannot come up, and X is loaded alone (this asserted in the manager once)
    m = manager()
    stored(m, X, "b", True)
    stored(m, Y, "b", False)
    m.host.remove(KEYS[Y])
    m.store(list(range(Z.start, Z.stop)), KEYS[Z], CHUNKS[Z], tenant="burst")  # in flight
    assert m.host.room() == 0
    both = slice(X.start, Y.stop)
    found = m.match("x", KEYS[both], CHUNKS[both])
    assert found is not None and list(found.load_keys) == KEYS[X]
    assert dict(found.declined_by) == {Decline.NO_ROOM: 16}
