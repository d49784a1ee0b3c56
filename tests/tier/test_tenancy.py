"""Tenants in the slot tiers' books: fair eviction under quotas, retention deadlines that pin
blocks (and let the host spill them to a tier below), refusals by reason, counts per tenant,
bounded labels, and deadlines kept across a restart."""

import math
from pathlib import Path

import pytest
from conftest import ks
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.tier.books.tenancy as tenancy_module
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.policy import POLICIES
from kvtier.tier.books.retention_file import RetentionFile
from kvtier.tier.books.tenancy import Grant, Quotas, Refusal, Tenancy
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.stores.disk.index import DiskTier


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def put(tier: HostTier | DiskTier, tenant: str, *ids: int, spill=None) -> list[BlockKey]:
    """Store `ids` for `tenant`; the keys evicted to make room."""
    result = tier.prepare_store(ks(*ids), [[i] for i in ids], tenant, spill)
    assert result is not None, f"no room for {ids}"
    tier.complete_store(result.keys, True)
    return result.evicted


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_tenant_over_its_quota_loses_blocks_before_one_under_it(policy: str) -> None:
    tenancy = Tenancy(Quotas(default={"host": 2}))
    host = HostTier(6, policy, tenancy=tenancy)
    put(host, "victim", 1, 2)  # the oldest blocks, within quota
    put(host, "noisy", 10, 11, 12, 13)  # full; noisy holds 4 > 2
    evicted = put(host, "noisy", 14, 15)
    assert set(evicted) <= set(ks(10, 11, 12, 13)), "the victim's older blocks stay"
    assert host.lookup(ks(1, 2)) == 2
    counts = tenancy.counts
    assert counts["victim"].held["host"] == 2 and counts["noisy"].held["host"] == 4
    assert counts["noisy"].evictions["host"] == 2 and counts["victim"].evictions["host"] == 0
    host.check_invariants()


def test_a_tenant_storing_past_its_quota_makes_room_from_its_own_blocks(policy: str) -> None:
    tenancy = Tenancy(Quotas(default={"host": 3}))
    host = HostTier(8, policy, tenancy=tenancy)
    put(host, "victim", 1, 2)  # the oldest, within quota
    put(host, "noisy", 10, 11, 12, 13, 14, 15)  # full; noisy holds 6 > 3
    evicted = put(host, "noisy", 16, 17, 18, 19, 20)  # would hold 11: all five are its own
    assert set(evicted) <= set(ks(*range(10, 16))) and len(evicted) == 5
    assert host.lookup(ks(1, 2)) == 2 and not tenancy.over(Medium.HOST, "victim")
    host.check_invariants()


def test_without_quotas_eviction_is_the_plain_policy() -> None:
    tenancy = Tenancy()
    host = HostTier(2, "lru", tenancy=tenancy)
    put(host, "a", 1)
    put(host, "b", 2)
    assert put(host, "b", 3) == ks(1)  # least recent first, whoever owns it


def test_a_retained_block_is_never_evicted_before_its_deadline(policy: str) -> None:
    clock = Clock()
    tenancy = Tenancy(max_retention_s=3600, clock=clock)
    host = HostTier(3, policy, tenancy=tenancy)
    put(host, "victim", 1)
    grant = tenancy.retain(ks(1), "victim", 60)
    assert grant == Grant(60, blocks=1) and str(grant) == "60" and grant.value == 60
    put(host, "noisy", 2, 3)
    for i in range(4, 10):  # a flood: the retained block stays
        put(host, "noisy", i)
    assert host.lookup(ks(1)) == 1
    assert tenancy.counts["victim"].retained["host"] == 1
    # Full of the retained block and a batch of two: no room, nothing changes.
    assert host.prepare_store(ks(20, 21, 22), [[20], [21], [22]], "noisy") is None
    clock.now += 61  # expired: an ordinary block again
    assert not tenancy.retained(ks(1)[0])
    assert tenancy.counts["victim"].retained["host"] == 0
    assert ks(1)[0] in put(host, "noisy", 30, 31)
    host.check_invariants()


def test_the_host_spills_a_retained_block_only_where_a_tier_below_keeps_it() -> None:
    tenancy = Tenancy(max_retention_s=3600)
    host = HostTier(10, "lru", tenancy=tenancy)
    put(host, "a", *range(1, 9))
    assert tenancy.retain(ks(*range(1, 9)), "a", 600).blocks == 8  # 80%: the most allowed
    put(host, "b", 9, 10)
    below = {ks(1)[0]}
    # Another tenant's store never pushes a's retained blocks off host, kept below or not.
    assert host.prepare_store(ks(20, 21, 22), [[20], [21], [22]], "b", below.__contains__) \
        is None
    # a's own store goes through the unretained first, then a's block that the disk keeps.
    assert put(host, "a", 20, 21, 22, spill=below.__contains__) == ks(9, 10, 1)
    assert tenancy.retained(ks(2)[0]) and host.lookup(ks(2)) == 1
    host.check_invariants()


def test_retention_refusals_say_why_and_are_counted() -> None:
    tenancy = Tenancy(Quotas(default={"host": 2}, named={"big": {"host": 10}}),
                      max_retention_s=100)
    host = HostTier(8, "lru", tenancy=tenancy)
    put(host, "a", 1, 2, 3)
    assert tenancy.retain(ks(1, 2, 3), "a", 50).refused is Refusal.QUOTA
    assert str(tenancy.retain(ks(1, 2, 3), "a", 50)) == "refused:quota"
    assert tenancy.retain(ks(1, 2), "a", 101).refused is Refusal.OVER_MAX
    assert tenancy.retain(ks(99), "a", 10).refused is Refusal.NOT_STORED
    for bad in (None, -1.0, 0.0, math.nan, math.inf):  # no duration a client means
        assert tenancy.retain(ks(1), "a", bad).refused is Refusal.INVALID
    assert tenancy.retain(ks(1, 2), "a", 10).refused is None  # within quota
    assert tenancy.retain(ks(3), "a", 10).refused is Refusal.QUOTA  # 3 > 2 retained
    put(host, "big", 4, 5, 6)
    assert tenancy.retain(ks(4, 5, 6), "big", 10).refused is None  # its own quota
    put(host, "big", 7, 8)  # 5 retained of 8 slots; 7 would pass the tier's 80%
    assert tenancy.retain(ks(7, 8), "big", 10).refused is Refusal.FULL
    assert tenancy.counts["big"].retention_refused == {"full": 1}
    refused = tenancy.counts["a"].retention_refused
    assert refused == {"quota": 3, "over_max": 1, "not_stored": 1, "invalid": 5}
    assert tenancy.counts["a"].retention_granted == 1
    off = Tenancy(max_retention_s=0)
    HostTier(2, tenancy=off).prepare_store(ks(1), [[1]], "a")
    assert off.retain(ks(1), "a", 5).refused is Refusal.DISABLED


def test_labels_are_bounded_the_rest_folded_into_other() -> None:
    tenancy = Tenancy()
    host = HostTier(20, "lru", tenancy=tenancy)
    for i, tenant in enumerate(["t0", "t1", "t2", "t3", ""]):
        put(host, tenant, *range(10 * i, 10 * i + (5 - i)))
    report = tenancy.report(2)
    assert list(report) == ["t0", "t1", "other"]
    assert report["other"].held["host"] == 3 + 2 + 1
    assert set(tenancy.report(9)) == {"t0", "t1", "t2", "t3", "default"}


def test_a_restart_keeps_unexpired_retention(tmp_path: Path) -> None:
    clock = Clock()
    first = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    host, disk = HostTier(4, tenancy=first), DiskTier(4, tenancy=first)
    put(host, "a", 1, 2, 3)
    disk_result = disk.prepare_store(ks(1, 2, 3), [[1], [2], [3]])
    assert disk_result is not None
    disk.complete_store(disk_result.keys, True)
    assert first.retain(ks(1), "a", 600).blocks == 1
    assert first.retain(ks(2), "a", 5).blocks == 1
    first.save()
    clock.now += 10  # key 2's retention has expired by the restart
    second = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    disk2 = DiskTier(4, tenancy=second)
    disk2.adopt([(0, ks(1)[0], [1]), (1, ks(2)[0], [2]), (2, ks(3)[0], [3])])
    assert second.retained(ks(1)[0]) and second.owner(ks(1)[0]) == "a"
    assert not second.retained(ks(2)[0]) and not second.retained(ks(3)[0])
    assert second.counts["a"].retained["disk"] == 1
    assert disk2.prepare_store(ks(7, 8, 9, 10), [[7], [8], [9], [10]]) is None
    assert disk2.prepare_store(ks(7, 8, 9), [[7], [8], [9]]) is not None


@pytest.mark.parametrize("max_s, kept_s", [(3600, 600), (60, 60), (0, None)])
def test_saved_retention_is_bounded_by_the_knobs_in_force_at_the_restart(
        tmp_path: Path, max_s: float, kept_s: float | None) -> None:
    # A day's retention is saved; the operator restarts with kv_retention_max_s lowered to
    # a minute, or to 0 (retention off): the block comes back retained at most that long.
    clock = Clock()
    first = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    put(DiskTier(4, tenancy=first), "a", 1)
    assert first.retain(ks(1), "a", 600).blocks == 1
    first.save()
    second = Tenancy(max_retention_s=max_s, file=RetentionFile(tmp_path), clock=clock)
    DiskTier(4, tenancy=second).adopt([(0, ks(1)[0], [1])])
    assert second.owner(ks(1)[0]) == "a"  # its owner either way
    assert second.counts["a"].retained["disk"] == (0 if kept_s is None else 1)
    clock.now += (kept_s or 0) - 1
    assert second.retained(ks(1)[0]) == (kept_s is not None)
    clock.now += 2
    assert not second.retained(ks(1)[0])


def test_a_damaged_retention_file_is_logged_and_ignored(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    (tmp_path / "retention.json").write_text("{not json")
    tenancy = Tenancy(max_retention_s=60, file=RetentionFile(tmp_path))
    assert not tenancy.any_retained
    assert "cannot be read" in caplog.text


def test_a_block_that_leaves_every_tier_is_forgotten() -> None:
    tenancy = Tenancy()
    host = HostTier(2, tenancy=tenancy)
    put(host, "a", 1)
    host.remove(ks(1))
    assert tenancy.owner(ks(1)[0]) == "" and tenancy.counts["a"].held["host"] == 0
    result = host.prepare_store(ks(2), [[2]], "a")
    assert result is not None
    host.complete_store(result.keys, False)  # a failed store holds nothing
    assert tenancy.counts["a"].held["host"] == 0


def test_made_up_tenants_cannot_grow_the_books_without_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenancy_module, "MAX_TENANTS", 8)
    tenancy = Tenancy(max_retention_s=60)
    host = HostTier(4, tenancy=tenancy)
    put(host, "kept", 1)
    for i in range(100):  # a client that makes up a salt per request, every one refused
        assert tenancy.retain(ks(50 + i), f"salt-{i}", 5).refused is Refusal.NOT_STORED
    assert len(tenancy.counts) <= 8 and "kept" in tenancy.counts
    report = tenancy.report(4)
    assert report["other"].retention_refused["not_stored"] + sum(
        c.retention_refused["not_stored"] for t, c in report.items() if t != "other") == 100


def test_renewing_a_block_again_and_again_keeps_the_deadline_heap_bounded() -> None:
    # One retained block renewed by 5,000 requests (each asking 600 s from its own now): the
    # books keep one live deadline, and the heap of them stays within its bound instead of
    # growing an entry per renewal (issue 42, item 8: 32 -> 432 entries over 200 requests).
    clock = Clock()
    tenancy = Tenancy(max_retention_s=3600, clock=clock)
    put(HostTier(4, tenancy=tenancy), "a", 1)
    for _ in range(5000):
        clock.now += 0.01
        assert tenancy.retain(ks(1), "a", 600).blocks == 1
    assert len(tenancy._deadlines) <= 2 * 1 + tenancy_module.HEAP_SLACK
    assert tenancy.deadline(ks(1)[0]) == clock.now + 600
    assert tenancy.counts["a"].retained["host"] == 1
    clock.now += 600.5
    assert not tenancy.retained(ks(1)[0]) and tenancy.counts["a"].retained["host"] == 0


def test_a_grant_appends_its_blocks_and_a_crash_keeps_every_grant(tmp_path: Path) -> None:
    """A grant costs its own blocks: it is appended to the log, the snapshot untouched (it
    was rewritten whole, every retained block, on every grant). A process that dies without
    a snapshot still hands every grant to the next one; a torn last line is skipped."""
    clock = Clock()
    first = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    disk = DiskTier(64, tenancy=first)
    put(disk, "a", *range(40))
    for i in range(40):
        assert first.retain(ks(i), "a", 600 + i).blocks == 1
    assert not (tmp_path / "retention.json").exists()  # no snapshot was written
    log = tmp_path / "retention.0.log"
    assert len(log.read_text().splitlines()) == 40
    with log.open("a") as f:
        f.write('["00ff", "a", 12')  # the process died mid-append
    second = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    DiskTier(64, tenancy=second).adopt([(i, ks(i)[0], [i]) for i in range(40)])
    assert second.counts["a"].retained["disk"] == 40
    assert second.deadline(ks(39)[0]) == clock.now + 639


def test_the_log_is_compacted_and_an_old_log_never_replays_over_a_newer_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenancy_module, "HEAP_SLACK", 4)
    clock = Clock()
    file = RetentionFile(tmp_path)
    first = Tenancy(max_retention_s=3600, file=file, clock=clock)
    put(DiskTier(8, tenancy=first), "a", 1, 2)
    for _ in range(12):  # renewals of two blocks: the log passes 2 x 2 + 4 lines
        first.retain(ks(1, 2), "a", 600)
        clock.now += 1
    assert file.generation >= 1 and file.logged <= 2 * 2 + 4  # compacted, log bounded
    first.release_all()  # a reset ends them: a snapshot with none
    # a crash just after that snapshot, before the log it replaced went away
    (tmp_path / f"retention.{file.generation - 1}.log").write_text(
        f'["{ks(1)[0].hex()}", "a", {clock.now + 600}]\n')
    second = Tenancy(max_retention_s=3600, file=RetentionFile(tmp_path), clock=clock)
    DiskTier(8, tenancy=second).adopt([(0, ks(1)[0], [1]), (1, ks(2)[0], [2])])
    assert not second.any_retained


@pytest.mark.parametrize("case", ["one retained block", "a tenant over its quota"])
def test_an_eviction_looks_at_a_few_keys_however_large_the_tier(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What can go is counted from the retained keys and the tenants' counts, never by a
    walk over every slot (10,000 looks a store before, on the scheduler's thread;
    benchmarks/eviction_books.py times it at 100,000 slots)."""
    quotas = Quotas(default={"host": 2_500}) if "quota" in case else None
    tenancy = Tenancy(quotas, max_retention_s=3600)
    host = HostTier(10_000, tenancy=tenancy)

    def store(tenant: str, ids: range) -> list[BlockKey]:
        keys = [i.to_bytes(16, "little") for i in ids]
        result = host.prepare_store(keys, [[i] for i in ids], tenant)
        assert result is not None
        host.complete_store(result.keys, True)
        return result.evicted
    for lo in range(0, 10_000, 100):
        store("noisy", range(lo, lo + 100))
    if "retained" in case:
        assert tenancy.retain([(9_999).to_bytes(16, "little")], "noisy", 600).blocks == 1
    looks = 0
    pinned = host._pinned

    def counted(key: BlockKey) -> bool:
        nonlocal looks
        looks += 1
        return pinned(key)
    monkeypatch.setattr(host, "_pinned", counted)
    evicted = store("new", range(20_000, 20_016))
    assert evicted == [i.to_bytes(16, "little") for i in range(16)]  # the policy's order
    assert looks < 100, looks
    host.check_invariants()


@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 40), min_size=1,
                                                          max_size=6),
                          st.sampled_from(["store", "retain", "load", "done"])),
                min_size=1, max_size=60),
       st.booleans())
@settings(max_examples=150, deadline=None)
def test_counted_room_and_victims_agree_with_a_walk_over_every_slot(
        ops: list[tuple[str, list[int], str]], quota: bool) -> None:
    """The counts eviction now works from give what a walk over every slot gives: the room
    a store of each tenant could get, a store refused exactly when too few can go, and no
    victim pinned, in the batch, or another tenant's retained block."""
    tenancy = Tenancy(Quotas(default={"host": 4}) if quota else None, max_retention_s=3600)
    host = HostTier(12, tenancy=tenancy)

    def spill(key: BlockKey) -> bool:  # the tier below keeps the even keys
        return key[0] % 2 == 0
    loads: list[list[BlockKey]] = []

    def walk(tenant: str, batch: set[BlockKey]) -> int:
        return sum(1 for key in host.complete_keys() + list(host._storing)
                   if not host._pinned(key) and key not in batch and not (
                       tenancy.retained(key) and (tenancy.owner(key) != tenant
                                                  or not spill(key))))
    for tenant, ids, op in ops:
        keys = ks(*ids)
        for t in "abc":
            assert host.room(t, spill) == walk(t, set()) + len(host._free)
        if op == "store":
            new = {key for key in keys if key not in host._entries}
            can = walk(tenant, set(keys)) + len(host._free) >= len(new)
            result = host.prepare_store(keys, [[i] for i in ids], tenant, spill)
            assert (result is not None) == can
            if result is not None:
                for key in result.evicted:
                    assert key not in keys
                    assert not (tenancy.retained(key) and tenancy.owner(key) != tenant)
                host.complete_store(result.keys, True)
        elif op == "retain":
            tenancy.retain(keys, tenant, 600)
        elif op == "load":
            present = [key for key in dict.fromkeys(keys) if host.lookup([key]) == 1]
            host.prepare_load(present)
            loads.append(present)
        elif loads:
            host.complete_load(loads.pop(0))
        host.check_invariants()


@pytest.mark.parametrize("limit", ["share", "quota"])
def test_a_retained_block_entering_a_full_tier_is_held_there_as_an_ordinary_one(
        limit: str) -> None:
    """The retained share and the owner's quota are checked in the tier a retained block
    enters (a spill, a write-through), not only where it sat when granted: past them it is
    held as an ordinary block, another tenant's store can take its slot, and the host must
    keep its own copy (the disk does not keep the retention)."""
    quotas = Quotas(default={"disk": 3}) if limit == "quota" else None
    tenancy = Tenancy(quotas, max_retention_s=3600)
    host, disk = HostTier(10, tenancy=tenancy), DiskTier(5, tenancy=tenancy)
    put(host, "m", *range(1, 9))
    assert tenancy.retain(ks(*range(1, 9)), "m", 600).refused is None  # 8 of 10 on host
    for i in range(1, 6):  # written down to disk one by one, as the host spills them
        put(disk, "", i)
    kept = 3 if limit == "quota" else 4  # 80% of 5 slots, or the disk quota
    assert tenancy.counts["m"].retained["disk"] == kept
    assert [tenancy.kept_on(Medium.DISK, k) for k in ks(*range(1, 6))] == [
        True] * kept + [False] * (5 - kept)
    evicted = put(disk, "v", 20)  # another tenant's block reaches the disk
    assert evicted == ks(kept + 1) and tenancy.counts["v"].held["disk"] == 1
    disk.check_invariants()
