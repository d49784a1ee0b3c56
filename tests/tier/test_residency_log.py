"""The residency log: which keys became resident on host or disk, or stopped being, as the slot
tiers' bookkeeping changes, taken in order through the manager; nothing kept unless asked."""

from conftest import ks

from kvtier.tier import ChangeKind, ResidencyChange
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.books.residency_log import ResidencyLog
from kvtier.tier.config import TierConfig
from kvtier.tier.jobs import Result
from kvtier.tier.keys import Medium
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.stores.disk.index import DiskTier

BS = 2
NBYTES = 100
STORED, REMOVED, FAILED = ChangeKind.STORED, ChangeKind.REMOVED, ChangeKind.FAILED
HOST, DISK = Medium.HOST, Medium.DISK


def toks(*ids: int) -> list[list[int]]:
    return [[i, i] for i in ids]


def changes(kind: ChangeKind, medium: Medium, *ids: int) -> list[ResidencyChange]:
    return [ResidencyChange(k, medium, kind) for k in ks(*ids)]


def manager(log: ResidencyLog | None, host_slots: int = 2, disk_slots: int = 0) -> TierManager:
    ids = job_ids()
    host = HostTier(host_slots, log=log)
    disk = [DiskTier(disk_slots, log=log)] if disk_slots else []
    cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0,
                      tier_gbps={"disk": 10.0})
    return TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(cal), NBYTES,
                       BelowHost(host, disk, NBYTES, ids), ids, log)


def run(m: TierManager, ok: bool = True) -> None:
    """Answer every job decided so far, as a worker would."""
    m.apply([Result.whole(j.id, j.num_blocks, ok, NBYTES * j.num_blocks, 1e-6)
             for j in m.take_jobs()])


def test_the_host_tier_logs_stores_failures_evictions_and_removals_in_order() -> None:
    # host of 2: store [1, 2] -> stored; store [3] evicts 1 (least recent), then fails ->
    # 1 removed, 3 failed (never resident); store [4] takes the slot 3 left -> stored;
    # remove [2, 9] -> 2 removed (9 was never there)
    log = ResidencyLog()
    host = HostTier(2, log=log)
    for ids, ok in (((1, 2), True), ((3,), False), ((4,), True)):
        prepared = host.prepare_store(ks(*ids), toks(*ids))
        assert prepared is not None
        host.complete_store(prepared.keys, ok)
    assert host.remove(ks(2, 9)) == 1
    assert log.take() == [*changes(STORED, HOST, 1, 2), *changes(REMOVED, HOST, 1),
                          *changes(FAILED, HOST, 3), *changes(STORED, HOST, 4),
                          *changes(REMOVED, HOST, 2)]
    assert log.take() == []  # taken once


def test_a_storing_key_is_not_resident_and_a_refused_store_changes_nothing() -> None:
    # host of 1: prepare [1] (storing, pinned) -> nothing yet; a store of [2] cannot evict a
    # pinned key -> refused, nothing logged; [1] lands -> stored
    log = ResidencyLog()
    host = HostTier(1, log=log)
    prepared = host.prepare_store(ks(1), toks(1))
    assert prepared is not None and log.take() == []
    assert host.prepare_store(ks(2), toks(2)) is None and log.take() == []
    host.complete_store(prepared.keys, True)
    assert log.take() == changes(STORED, HOST, 1)


def test_the_manager_hands_out_host_and_disk_changes_as_they_happen() -> None:
    # host 2 over disk 8: store [1, 2] -> host stored, then written on to disk -> disk stored;
    # store [3, 4] -> host evicts 1, 2 (the disk keeps them), stores 3, 4, writes them down
    m = manager(ResidencyLog(), host_slots=2, disk_slots=8)
    m.store([10, 11], ks(1, 2), toks(1, 2))
    run(m)
    assert m.take_residency_changes() == changes(STORED, HOST, 1, 2)
    run(m)  # the write on to disk lands
    assert m.take_residency_changes() == changes(STORED, DISK, 1, 2)
    m.store([12, 13], ks(3, 4), toks(3, 4))
    run(m)
    run(m)
    assert m.take_residency_changes() == [*changes(REMOVED, HOST, 1, 2),
                                          *changes(STORED, HOST, 3, 4),
                                          *changes(STORED, DISK, 3, 4)]


def test_blocks_adopted_from_disk_at_start_are_the_starting_state_not_changes() -> None:
    log = ResidencyLog()
    disk = DiskTier(4, log=log)
    assert disk.adopt([(0, ks(1)[0], [1, 1]), (1, ks(2)[0], [2, 2])]) == []
    assert disk.lookup(ks(1, 2)) == 2 and log.take() == []
    disk.remove(ks(1))  # a later change of an adopted block is a change like any other
    assert log.take() == changes(REMOVED, DISK, 1)


def test_a_manager_not_asked_for_the_log_keeps_nothing() -> None:
    for m in (manager(None), manager(ResidencyLog(enabled=False))):
        m.store([10, 11, 12], ks(1, 2, 3), toks(1, 2, 3))  # host of 2: refused
        m.store([10, 11], ks(1, 2), toks(1, 2))
        run(m)
        assert m.host.stats.stores == 2  # it did store them
        assert m.take_residency_changes() == []
