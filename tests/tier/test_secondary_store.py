"""A tier below host is one class: a store kept in a dict, written to the tier's two
protocols (`SecondaryIndex` for the bookkeeping, `SecondaryStore` for the bytes), serves a
wake byte for byte, has a damaged block refused and dropped, and keeps blocks a later
retention asks it to, with no change to the tier."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtier.tier import Calibration, KVLayout, Medium, Planner, TierConfig, TierManager
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import FETCHING, job_ids
from kvtier.tier.books.protocol import PrepareStoreResult
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.io.block_format import BlockHeader, Buffer, CorruptBlock, pack, unpack
from kvtier.tier.io.store import StoreMiss
from kvtier.tier.io.thread import TierIO
from kvtier.tier.jobs import FetchDone, LoadDone, Miss, Reason
from kvtier.tier.keys import BlockKey, hash_blocks
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.transfer import TransferEngine
from kvtier.tier.report import IndexStats
from kvtier.tier.worker import TierWorker

NS = bytes(range(16))
BS, BLOCKS = 4, 8
TOKENS = list(range(300, 300 + 3 * BS))
KEYS = hash_blocks(NS, TOKENS, BS)
CHUNKS = [TOKENS[i * BS:(i + 1) * BS] for i in range(len(KEYS))]


class DictTier:
    """A shared store in a dict: both sides of one tier below host, in one class."""

    medium = Medium.REDIS
    local = False
    expires = False
    pending = False
    answered_absent = 0
    unusable_at_start: dict[str, int] = {}  # noqa: RUF012 (a test's fake)
    mac = None

    def __init__(self) -> None:
        self.blobs: dict[BlockKey, bytes] = {}
        self.stats = IndexStats()

    # SecondaryIndex ----------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], token_chunks: Any = None) -> int:
        n = next((i for i, k in enumerate(keys) if k not in self.blobs), len(keys))
        self.stats.hits += n
        return n

    def wait(self, timeout: float) -> None: ...

    def close(self) -> None: ...

    def prepare_store(self, keys: Sequence[BlockKey], token_chunks: Any) -> PrepareStoreResult:
        return PrepareStoreResult(list(keys), [-1] * len(keys), [])

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None:
        self.stats.stores += len(keys) if success else 0

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        return [-1] * len(keys)

    def complete_fetch(self, keys: Sequence[BlockKey], served: int,
                       dropped: Sequence[BlockKey], success: bool) -> None:
        self.stats.loads += served
        self.stats.load_failures += len(dropped)

    # SecondaryStore ----------------------------------------------------------------------
    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]:
        for h, p in zip(headers, payloads):
            self.blobs[h.key] = pack(h, p)
        return [None] * len(headers)

    parallel_reads = True  # its blocks are in a dict: any thread may read them

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> DictTier:
        return self

    def ready(self, key: BlockKey) -> bool:
        return key in self.blobs

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        if key not in self.blobs:
            raise StoreMiss(Reason.MISSING, "absent")
        try:
            return unpack(self.blobs[key])
        except ValueError as e:
            raise CorruptBlock(Reason.SIZE, str(e)) from None

    def discard(self, key: BlockKey, slot: int) -> None:
        self.blobs.pop(key, None)

    def flush(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        return {"blocks": len(self.blobs)}


def tier(store: DictTier, tenancy: Tenancy | None = None
         ) -> tuple[TierManager, TierWorker, torch.Tensor]:
    """A manager and a worker over a 3-slot host pool with `store` below it, assembled from
    the tier's parts as `builder.py` does."""
    kv = torch.randn(BLOCKS, 2, BS, 2, 2, 8)
    layout = KVLayout.from_contiguous(kv)
    host = HostPool.like(layout, 3)
    worker = TierWorker(host, TransferEngine(layout, host), TierIO(host, NS, [store]))
    ids = job_ids()
    index = HostTier(host.num_slots, tenancy=tenancy)
    cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=1.0,
                      tier_gbps={Medium.REDIS.value: 10.0})
    manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, index, Planner(cal),
                          layout.block_nbytes, BelowHost(index, [store], host.slot_bytes, ids),
                          ids)
    return manager, worker, kv


def settle(manager: TierManager, worker: TierWorker) -> list:
    """Run every job to its end; the events."""
    events = []
    while True:
        for job in manager.take_jobs():
            worker.submit(job)
        if not worker.busy:
            return events
        events += manager.apply(worker.wait_any())


def wake(manager: TierManager, worker: TierWorker, request: str, blocks: list[int]) -> list:
    """Match, fetch up from the store, match again, load into `blocks`: the events."""
    assert manager.match(request, KEYS, CHUNKS) is FETCHING  # the tier started the fetch
    events = settle(manager, worker)
    again = manager.match(request, KEYS, CHUNKS)
    assert again is not None
    if again.load_keys:
        manager.allocated(request, again, blocks[:len(again.load_keys)])
    return events + settle(manager, worker)


def test_a_store_of_one_class_serves_a_wake_byte_for_byte() -> None:
    store = DictTier()
    manager, worker, kv = tier(store)
    source = kv.clone()
    assert manager.store([0, 1, 2], KEYS, CHUNKS) == (0, 1, 2)
    settle(manager, worker)  # host, then written on down to the store
    assert sorted(store.blobs) == sorted(KEYS)
    worker.host.tensor.zero_()  # the host copy is gone: only the store has the bytes
    manager.host.remove(KEYS)
    events = wake(manager, worker, "r", [5, 6, 7])
    fetched = [e for e in events if isinstance(e, FetchDone)]
    loaded = [e for e in events if isinstance(e, LoadDone)]
    assert fetched[0].fetched == 3 and fetched[0].source is Medium.REDIS
    assert loaded[0].success and loaded[0].num_blocks == 3
    assert torch.equal(kv[5:8], source[0:3])
    report = manager.report().below
    assert report is not None and report.fetched_blocks == {"remote": 3}
    assert worker.report().stores == {"remote": {"blocks": 3}}
    worker.close()


def test_a_damaged_block_in_that_store_ends_the_prefix_and_leaves_it() -> None:
    store = DictTier()
    manager, worker, _ = tier(store)
    manager.store([0, 1, 2], KEYS, CHUNKS)
    settle(manager, worker)
    blob = bytearray(store.blobs[KEYS[1]])
    blob[-1] ^= 0xFF  # one payload bit of the second block
    store.blobs[KEYS[1]] = bytes(blob)
    manager.host.remove(KEYS)
    events = wake(manager, worker, "r", [5, 6, 7])
    [fetched] = [e for e in events if isinstance(e, FetchDone)]
    assert (fetched.fetched, fetched.missed) == (1, 2)
    assert manager.report().below.misses == {Miss(Medium.REDIS, Reason.CHECKSUM): 1}
    assert KEYS[1] not in store.blobs and KEYS[2] in store.blobs  # the bad one left, alone
    worker.close()


class ExpiringTier(DictTier):
    """A store that expires blocks by itself (a TTL): it records what it is told to keep,
    and cannot be reached for the keys in `unreachable`."""

    expires = True

    def __init__(self, unreachable: Sequence[BlockKey] = ()) -> None:
        super().__init__()
        self.unreachable = set(unreachable)
        self.kept: dict[BlockKey, float] = {}

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        out: list[OSError | StoreMiss | None] = []
        for key, until in zip(keys, keep_until):
            if key in self.unreachable:
                out.append(StoreMiss(Reason.UNAVAILABLE, "down"))
            else:
                self.kept[key] = until
                out.append(None)
        return out


def retaining_tier(store: DictTier) -> tuple[TierManager, TierWorker]:
    """`tier(store)` with retention allowed up to an hour (of at most 80% of its 3 slots)."""
    manager, worker, _ = tier(store, Tenancy(max_retention_s=3600.0))
    return manager, worker


def test_a_later_retention_reaches_a_store_that_expires_blocks() -> None:
    """Blocks written before their retention was granted are renewed in the store (the
    deadline travels as a job of no bytes); a store that keeps everything is never asked."""
    store = ExpiringTier()
    manager, worker = retaining_tier(store)
    manager.store([0, 1, 2], KEYS, CHUNKS, tenant="t")
    settle(manager, worker)
    assert sorted(store.blobs) == sorted(KEYS) and not store.kept
    before = time.time()
    grant = manager.retain(KEYS[:2], "t", 600.0)
    assert grant.refused is None and grant.blocks == 2
    settle(manager, worker)
    assert sorted(store.kept) == sorted(KEYS[:2])
    assert all(before + 600 <= until <= time.time() + 600 for until in store.kept.values())
    report = manager.report().below
    assert report is not None and report.renewed_blocks == {"remote": 2}
    assert not report.renew_failures
    worker.close()

    plain = DictTier()  # expires nothing: a retention sends it nothing
    manager, worker = retaining_tier(plain)
    manager.store([0, 1, 2], KEYS, CHUNKS, tenant="t")
    settle(manager, worker)
    assert manager.retain(KEYS[:2], "t", 600.0).refused is None
    assert not manager.take_jobs()
    worker.close()


def test_a_renewal_the_store_cannot_take_is_counted_and_the_retention_stands() -> None:
    store = ExpiringTier(unreachable=KEYS[1:2])
    manager, worker = retaining_tier(store)
    manager.store([0, 1, 2], KEYS, CHUNKS, tenant="t")
    settle(manager, worker)
    assert manager.retain(KEYS[:2], "t", 600.0).refused is None
    settle(manager, worker)
    assert list(store.kept) == [KEYS[0]]
    report = manager.report().below
    assert report is not None and report.renewed_blocks == {"remote": 1}
    assert report.renew_failures == {"remote": 1}
    assert manager.host.tenancy.retained(KEYS[1])  # host keeps its promise regardless
    assert manager.retain(KEYS[:2], "t", 60.0).refused is None  # and the tier goes on
    worker.close()
