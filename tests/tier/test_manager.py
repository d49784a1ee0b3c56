"""TierManager scenarios with tiny numbers, no model and no torch: a fake device pool is a
list of ints, and the "worker" is the test itself, answering each job with a Result."""

import subprocess
import sys
import threading
import time

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import FETCHING, NO_MATCH, RequestOutcome, TierManager, job_ids
from kvtier.tier.books.presence import SharedBooks, SharedPresence
from kvtier.tier.config import TierConfig
from kvtier.tier.jobs import FetchDone, Job, LoadDone, Miss, Reason, Result, StoreDone
from kvtier.tier.keys import Medium, hash_blocks
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.stores.disk.index import DiskTier

BS = 4  # tokens per block
NBYTES = 1000  # bytes of one block across the host link
FAST = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)
SLOW = Calibration(link_gbps=1e-9, transfer_overhead_s=0.0, prefill_tokens_per_s=1e9)
TOKENS = list(range(100, 124))  # 6 blocks of 4
KEYS = hash_blocks(b"\x00" * 16, TOKENS, BS)
CHUNKS = [TOKENS[i * BS:(i + 1) * BS] for i in range(len(KEYS))]


def manager(slots: int = 2, calibration: Calibration = FAST, below: bool = False,
            exists=None, **knobs) -> TierManager:
    ids = job_ids()
    host = HostTier(slots)
    tiers = [DiskTier(8)] if below else []
    if below and exists is not None:
        tiers.append(SharedBooks(SharedPresence(exists)))
    deep = BelowHost(host, tiers, NBYTES, ids)
    cal = Calibration(calibration.link_gbps, calibration.transfer_overhead_s,
                      calibration.prefill_tokens_per_s, tier_gbps={"disk": 10.0, "remote": 10.0})
    return TierManager(TierConfig.of(kv_offloading_size=1, **knobs), BS, host, Planner(cal),
                       NBYTES, deep, ids)


def run(m: TierManager, ok: bool = True, fail_at: int | None = None) -> list:
    """Answer every job the manager has decided, as a worker would; the events."""
    results = []
    for job in m.take_jobs():
        flags = [ok and (fail_at is None or i < fail_at) for i in range(job.num_blocks)]
        reasons = ["" if f else ("checksum" if i == fail_at else "skipped")
                   for i, f in enumerate(flags)]
        results.append(Result(job.id, tuple(flags), tuple(reasons), NBYTES * sum(flags), 1e-6))
    return m.apply(results)


def test_store_then_match_then_load() -> None:
    # capacity 2: store [0, 1] from device blocks [7, 8]; match [0, 1, 2] -> load [0, 1]
    m = manager()
    assert m.store([7, 8], KEYS[:2], CHUNKS[:2]) == (7, 8)
    [done] = run(m)
    assert done == StoreDone(done.job_id, (7, 8), True)
    match = m.match("r", KEYS[:3], CHUNKS[:3])
    assert match is not None and match.load_keys == tuple(KEYS[:2])
    assert match.restored_tokens == 2 * BS and match.source is Medium.HOST
    job = m.allocated("r", match, [3, 4])
    [job_spec] = m.take_jobs()
    assert job_spec.id == job and job_spec.src is Medium.HOST and job_spec.dst is Medium.DEVICE
    assert job_spec.device_blocks == (3, 4)
    assert m.host.stats.pinned == 2  # pinned until the load's result
    [loaded] = m.apply([Result.whole(job, 2, True, 2 * NBYTES, 1e-6)])
    assert isinstance(loaded, LoadDone) and loaded.success and loaded.request_id == "r"
    assert m.host.stats.pinned == 0 and m.stats.loaded_blocks == 2


def test_a_full_pinned_host_refuses_a_store_and_nothing_changes() -> None:
    # capacity 2: store [0, 1] (still in flight, pinned); store [2] -> refused
    m = manager()
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    assert m.store([3], KEYS[2:3], CHUNKS[2:3]) is None
    assert m.stats.store_refused == 1
    run(m)
    assert m.host_hits(KEYS[:2], CHUNKS[:2]) == 2


def test_eviction_takes_the_least_recently_used() -> None:
    # capacity 2: store [0, 1]; touch [0] by a load; store [2] -> evicts [1]
    m = manager()
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    run(m)
    match = m.match("r", KEYS[:1], CHUNKS[:1])
    m.allocated("r", match, [5])
    run(m)
    m.store([3], [KEYS[2]], [CHUNKS[2]])
    run(m)
    assert m.holds(KEYS[0]) and not m.holds(KEYS[1]) and m.holds(KEYS[2])


def test_a_failed_store_is_never_a_hit_and_a_failed_load_unpins() -> None:
    m = manager()
    m.store([1], KEYS[:1], CHUNKS[:1])
    [done] = run(m, ok=False)
    assert not done.success and m.stats.failed_stores == 1
    assert m.host_hits(KEYS[:1], CHUNKS[:1]) == 0
    m.store([1], KEYS[:1], CHUNKS[:1])
    run(m)
    match = m.match("r", KEYS[:1], CHUNKS[:1])
    m.allocated("r", match, [2])
    [loaded] = run(m, ok=False)
    assert isinstance(loaded, LoadDone) and not loaded.success
    assert m.host.stats.pinned == 0 and m.stats.failed_loads == 1
    assert m.host_hits(KEYS[:1], CHUNKS[:1]) == 1  # the stored bytes are as they were


def test_other_tokens_under_the_same_key_are_not_a_hit() -> None:
    m = manager()
    m.store([1], KEYS[:1], CHUNKS[:1])
    run(m)
    assert m.match("r", KEYS[:1], [[9, 9, 9, 9]]).load_keys == ()


def test_the_planner_declines_a_restore_slower_than_recompute() -> None:
    m = manager(calibration=SLOW)
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    run(m)
    match = m.match("r", KEYS[:2], CHUNKS[:2])
    assert match.load_keys == () and match.declined_tokens == 2 * BS
    assert match.decision is not None and match.decision.choice == "recompute"


def test_max_load_tokens_caps_the_restore() -> None:
    m = manager(slots=4, max_load_tokens=BS)
    m.store([1, 2, 3], KEYS[:3], CHUNKS[:3])
    run(m)
    assert m.match("r", KEYS[:3], CHUNKS[:3]).load_keys == (KEYS[0],)


def test_write_down_to_disk_then_fetch_up_then_load() -> None:
    # host 2 over disk 8: store [0, 1] -> written on to disk; evict both from host by
    # storing [2, 3]; match [0, 1] -> fetch from disk; fetched -> load from host
    m = manager(below=True)
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    run(m)  # the store lands; its write to disk is queued
    [write] = m.take_jobs()
    assert (write.src, write.dst) == (Medium.HOST, Medium.DISK) and write.keys == tuple(KEYS[:2])
    m.apply([Result(write.id, (True, True), ("", ""), 2 * NBYTES, 1e-6)])
    assert m.host.stats.loads == 0  # the write's pins are holds, never counted as loads
    m.store([3, 4], KEYS[2:4], CHUNKS[2:4])
    run(m)
    run(m)  # and their writes down
    assert m.host_hits(KEYS[:1], CHUNKS[:1]) == 0 and m.holds(KEYS[0])  # on disk only
    assert m.match("r", KEYS[:2], CHUNKS[:2]) is FETCHING  # the fetch started: not yet
    [fetch] = m.take_jobs()
    assert fetch.keys == tuple(KEYS[:2]) and fetch.media == (Medium.DISK,) * 2
    assert m.match("r", KEYS[:2], CHUNKS[:2]) is FETCHING  # still on its way: never twice
    [fetched] = m.apply([Result(fetch.id, (True, True), ("", ""), 2 * NBYTES, 1e-6)])
    assert fetched == FetchDone("r", 2, Medium.DISK, 0, predicted_s=fetched.predicted_s,
                                seconds=fetched.seconds, finished_at=fetched.finished_at)
    assert fetched.predicted_s is not None and fetched.predicted_s > 0  # scored on landing
    again = m.match("r", KEYS[:2], CHUNKS[:2])
    assert again.load_keys == tuple(KEYS[:2]) and again.source is Medium.DISK
    m.allocated("r", again, [5, 6])
    [loaded] = run(m)
    assert loaded.success
    assert m.outcome("r") == RequestOutcome(restored_tokens=2 * BS, nbytes=2 * NBYTES,
                                            source=Medium.DISK, seconds=loaded.seconds)
    m.finished("r")
    assert m.outcome("r") == RequestOutcome()  # forgotten with the request
    assert m.host.stats.pinned == 0 and m.below.tier(Medium.DISK).stats.pinned == 0


def test_a_corrupt_block_ends_the_fetched_prefix_and_is_dropped() -> None:
    m = manager(below=True, slots=4)
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    run(m)
    run(m)
    m.host.remove(KEYS[:2])  # host lost them: only the disk has them
    assert m.match("r", KEYS[:2], CHUNKS[:2]) is FETCHING
    [fetched] = run(m, fail_at=1)  # block 1 fails its checksum
    assert fetched.fetched == 1 and fetched.missed == 1
    assert m.below.stats.misses == {Miss(Medium.DISK, Reason.CHECKSUM): 1}
    assert m.below.tier(Medium.DISK).lookup([KEYS[1]]) == 0  # never a hit again
    again = m.match("r", KEYS[:2], CHUNKS[:2])
    assert again.load_keys == (KEYS[0],) and again.declined_tokens == BS


def test_remote_presence_is_asked_off_the_thread_and_the_request_asks_again() -> None:
    # the store answers only when the test lets it: the first match says "ask again"
    gate = threading.Event()

    def exists(keys):
        gate.wait(5)
        return [True] * len(keys)

    m = manager(below=True, exists=exists)
    assert m.match("r", KEYS[:2], CHUNKS[:2]) is None
    assert m.busy  # a presence answer is awaited
    gate.set()
    m.below.wait_presence(timeout=5)
    assert m.match("r", KEYS[:2], CHUNKS[:2]) is FETCHING
    [fetch] = m.take_jobs()
    assert fetch.media == (Medium.REDIS,) * 2 and fetch.src is Medium.REDIS
    m.close()


def test_an_unreachable_store_answers_absent() -> None:
    def exists(keys):
        raise ConnectionError("down")

    m = manager(below=True, exists=exists)
    first = m.match("r", KEYS[:1], CHUNKS[:1])  # answered within the first ask's short wait,
    if first is None:  # or on a loaded machine the next time
        m.below.wait_presence(timeout=5)
        first = m.match("r", KEYS[:1], CHUNKS[:1])
    assert first == NO_MATCH and m.take_jobs() == []
    assert m.report().below.lookups_answered_absent == 1
    m.close()


def test_a_presence_answer_that_comes_within_the_inline_wait_is_given_at_once() -> None:
    presence = SharedPresence(lambda keys: [True] * len(keys), inline_wait_s=10.0)
    assert presence.ask(KEYS[:3]) == [True, True, True]  # no "ask again": no extra step
    assert not presence.pending
    presence.close()


def test_a_slow_store_costs_one_inline_wait_not_one_per_request() -> None:
    gate = threading.Event()

    def exists(keys):
        gate.wait(5)
        return [True] * len(keys)

    presence = SharedPresence(exists, inline_wait_s=0.1)
    t = time.monotonic()
    assert presence.ask(KEYS[:1]) is None  # waited 100 ms, then "ask again"
    for i in range(1, 6):  # five more requests arrive: none of them waits
        assert presence.ask(KEYS[i:i + 1]) is None
    assert time.monotonic() - t < 0.4  # one wait, not six (0.6 s)
    gate.set()
    presence.wait(timeout=5)
    assert presence.ask(KEYS[:1]) == [True]  # the answer is kept for the next ask
    presence.close()


def test_jobs_share_one_id_space() -> None:
    m = manager(below=True, slots=4)
    m.store([1], KEYS[:1], CHUNKS[:1])
    run(m)
    m.store([2], KEYS[1:2], CHUNKS[1:2])
    jobs: list[Job] = m.take_jobs()
    assert len({j.id for j in jobs}) == len(jobs) == 2  # a write below and a store


def test_the_bookkeeping_imports_no_torch() -> None:
    code = ("import sys, kvtier.tier.books.manager, kvtier.tier.books.below, "
            "kvtier.tier.books.presence, kvtier.tier.stores.disk.index, "
            "kvtier.tier.layout, kvtier.tier.jobs; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_failed_load_is_in_the_requests_outcome_as_a_miss() -> None:
    m = manager()
    m.store([7, 8], KEYS[:2], CHUNKS[:2])
    run(m)
    match = m.match("r", KEYS[:2], CHUNKS[:2])
    m.allocated("r", match, [5, 6])
    assert m.outcome("r").restored_tokens == 2 * BS and m.outcome("r").source is Medium.HOST
    [failed] = run(m, ok=False)
    assert not failed.success
    outcome = m.outcome("r")
    assert outcome.failed and outcome.restored_tokens == 0 and outcome.seconds == 1e-6
    assert outcome.nbytes == 0


def test_a_swap_in_is_counted_apart_from_a_restore() -> None:
    m = manager()
    m.store([7, 8], KEYS[:2], CHUNKS[:2])
    run(m)
    m.allocated("r", m.match("r", KEYS[:1], CHUNKS[:1]), [5])
    m.allocated("r", m.match("r", KEYS[1:2], CHUNKS[1:2]), [6], swap_in=True)
    run(m)
    o = m.outcome("r")
    assert (o.restored_tokens, o.swapped_in_tokens, o.nbytes) == (BS, BS, 2 * NBYTES)


def _fetch_in_flight(m: TierManager, rid: str) -> Job:
    """Blocks 0, 1 on disk only; `rid` matches them and its fetch is started, not landed."""
    m.store([1, 2], KEYS[:2], CHUNKS[:2])
    run(m)
    run(m)  # the writes down land
    m.host.remove(KEYS[:2])
    assert m.match(rid, KEYS[:2], CHUNKS[:2]) is FETCHING
    [fetch] = m.take_jobs()
    return fetch


def test_a_fetch_that_lands_after_its_request_left_pins_nothing() -> None:
    # host 4 over disk 8: "r" starts a fetch of [0, 1]; it is aborted (finished) before the
    # fetch lands -> the blocks land as ordinary host blocks, pinned by nobody
    m = manager(below=True, slots=4)
    fetch = _fetch_in_flight(m, "r")
    m.finished("r")  # abort, client disconnect, timeout: the request is gone
    assert m.host.stats.pinned == 2  # the fetch's own slots, until it lands
    m.apply([Result(fetch.id, (True, True), ("", ""), 2 * NBYTES, 1e-6)])
    assert m.host.stats.pinned == 0 and m.below.pinned_for_requests == 0
    assert m.host_hits(KEYS[:2], CHUNKS[:2]) == 2  # still useful to the next request
    m.store([3, 4, 5, 6], KEYS[2:6], CHUNKS[2:6])  # and evictable: the host makes room
    run(m)
    run(m)  # their writes down land (a write holds its rows while it reads them)
    assert m.host_hits(KEYS[:2], CHUNKS[:2]) == 0 and m.host.stats.pinned == 0


def test_a_failed_fetch_after_its_request_left_pins_nothing() -> None:
    m = manager(below=True, slots=4)
    fetch = _fetch_in_flight(m, "r")
    m.finished("r")
    m.apply([Result(fetch.id, (False, False), ("unavailable", "skipped"), 0, 0.5)])
    assert m.host.stats.pinned == 0 and m.below.pinned_for_requests == 0
    assert m.below.tier(Medium.DISK).stats.pinned == 0


def test_six_aborted_wakes_leave_no_pinned_slot() -> None:
    # the hostile operator's case: wake after wake aborted while its fetch is in flight
    m = manager(below=True, slots=4)
    for i in range(6):
        rid = f"r{i}"
        fetch = _fetch_in_flight(m, rid)
        m.finished(rid)
        m.apply([Result(fetch.id, (True, True), ("", ""), 2 * NBYTES, 1e-6)])
    assert m.host.stats.pinned == 0 and m.below.pinned_for_requests == 0


def test_a_request_that_stays_keeps_its_fetched_blocks_pinned_until_admitted() -> None:
    m = manager(below=True, slots=4)
    fetch = _fetch_in_flight(m, "r")
    m.apply([Result(fetch.id, (True, True), ("", ""), 2 * NBYTES, 1e-6)])
    assert m.below.pinned_for_requests == 2  # waiting for device room: not evicted meanwhile
    m.finished("r")  # left before admission: released
    assert m.below.pinned_for_requests == 0 and m.host.stats.pinned == 0
