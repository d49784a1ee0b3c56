"""The I/O thread lets a wake go first: a fetch queued while a long write-on runs is served
between two pieces of that write, not after all of it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvtier.tier import KVLayout, Medium
from kvtier.tier.io import thread as io
from kvtier.tier.io.block_format import BlockHeader, Buffer, pack, unpack
from kvtier.tier.io.store import StoreMiss
from kvtier.tier.io.thread import TierIO
from kvtier.tier.jobs import Job, Reason
from kvtier.tier.keys import hash_blocks
from kvtier.tier.link.host_pool import HostPool

NS = bytes(range(16))
BS = 4
TOKENS = list(range(100, 100 + 8 * BS))
KEYS = hash_blocks(NS, TOKENS, BS)
CHUNKS = [tuple(TOKENS[i * BS:(i + 1) * BS]) for i in range(len(KEYS))]
WRITE_S = 0.05  # each store.write call: a slow disk


class SlowStore:
    """A dict-backed store whose writes take WRITE_S a call and are recorded."""

    medium = Medium.REDIS
    mac = None

    def __init__(self) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.calls: list[int] = []  # blocks per write call
        self.writing = threading.Event()
        self.log: list[str] = []

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]:
        self.writing.set()
        self.calls.append(len(headers))
        time.sleep(WRITE_S)
        for h, p in zip(headers, payloads):
            self.blobs[h.key] = pack(h, p)
        self.log.append(f"write {len(headers)}")
        return [None] * len(headers)

    parallel_reads = True  # its blocks are in a dict: any thread may read them

    def reads(self, keys: Sequence[bytes], rows: Sequence[memoryview],
              deadline: float | None = None) -> SlowStore:
        self.log.append("fetch")
        return self

    def ready(self, key: bytes) -> bool:
        return key in self.blobs

    def read(self, key: bytes, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        return unpack(self.blobs[key])

    def discard(self, key: bytes, slot: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        return {}


def test_a_fetch_goes_between_two_pieces_of_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVLayout.from_contiguous(torch.randn(8, 2, BS, 2, 2, 8))
    host = HostPool.like(layout, 8)
    host.tensor.copy_(torch.randn_like(host.tensor))
    monkeypatch.setattr(io, "WRITE_PIECE_BYTES", host.slot_bytes)  # one block a piece
    store = SlowStore()
    tier = TierIO(host, NS, [store])
    try:
        # Two blocks are below already; six more go down in one write-on job.
        first = Job(1, Medium.HOST, Medium.REDIS, (0, 1), keys=tuple(KEYS[:2]),
                    tokens=tuple(CHUNKS[:2]), media=(Medium.REDIS,) * 2, below_slots=(-1, -1))
        tier.submit(first)
        tier.wait_any(5)
        store.writing.clear()
        expected = host.tensor[0:2].clone()
        write = Job(2, Medium.HOST, Medium.REDIS, (2, 3, 4, 5, 6, 7), keys=tuple(KEYS[2:]),
                    tokens=tuple(CHUNKS[2:]), media=(Medium.REDIS,) * 6,
                    below_slots=(-1,) * 6)
        tier.submit(write)
        assert store.writing.wait(5)
        began = time.perf_counter()
        fetch = Job(3, Medium.REDIS, Medium.HOST, (6, 7), keys=tuple(KEYS[:2]),
                    tokens=tuple(CHUNKS[:2]), media=(Medium.REDIS,) * 2, below_slots=(-1, -1))
        tier.submit(fetch)
        done: dict[int, Any] = {}
        while len(done) < 2:
            for result in tier.wait_any(5):
                done.setdefault(result.job_id, (result, time.perf_counter() - began))
    finally:
        tier.close()
    fetched, fetch_s = done[3]
    written, _ = done[2]
    assert fetched.ok == (True, True) and written.reasons == (Reason.OK,) * 6
    # served after one more piece of the write, not after all six
    assert store.log.index("fetch") < len(store.log) - 2, store.log
    assert fetch_s < 3 * WRITE_S
    assert store.calls[2:] == [1] * 6  # the write went down one block a piece
    assert torch.equal(host.tensor[6:8], expected)
    assert written.seconds < 6 * WRITE_S + 0.1  # the fetch's time is not the write's


def test_after_a_fetch_writes_wait_out_the_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The woken request's load and first token run with no write-on beside them."""
    layout = KVLayout.from_contiguous(torch.randn(8, 2, BS, 2, 2, 8))
    host = HostPool.like(layout, 8)
    monkeypatch.setattr(io, "WAKE_QUIET_S", 0.2)
    store = SlowStore()
    tier = TierIO(host, NS, [store])
    try:
        tier.submit(Job(1, Medium.HOST, Medium.REDIS, (0,), keys=(KEYS[0],),
                        tokens=(CHUNKS[0],), media=(Medium.REDIS,), below_slots=(-1,)))
        tier.wait_any(5)
        store.writing.clear()
        tier.submit(Job(2, Medium.REDIS, Medium.HOST, (1,), keys=(KEYS[0],),
                        tokens=(CHUNKS[0],), media=(Medium.REDIS,), below_slots=(-1,)))
        [fetched] = tier.wait_any(5)
        landed = time.perf_counter()
        tier.submit(Job(3, Medium.HOST, Medium.REDIS, (2,), keys=(KEYS[1],),
                        tokens=(CHUNKS[1],), media=(Medium.REDIS,), below_slots=(-1,)))
        assert store.writing.wait(5)
        began = time.perf_counter() - landed
        [written] = tier.wait_any(5)
    finally:
        tier.close()
    assert fetched.ok == (True,) and written.ok == (True,)
    assert began > 0.12  # it waited out (most of) the quiet time
    assert written.seconds < WRITE_S + 0.1  # and that wait is not its own time


class HungStore(SlowStore):
    """A store whose writes do not return until released: a hung mount, a peer that never
    answers. The I/O thread is held inside its call."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]:
        self.writing.set()
        self.release.wait(30)
        return [None] * len(headers)


@pytest.mark.parametrize("wait", ["wait_any", "wait_fetches", "poll"])
def test_a_fetch_queued_behind_a_hung_call_fails_at_its_deadline(wait: str) -> None:
    """The deadline bounds the thread too: a fetch that never started because a store call
    has not returned is a DEADLINE miss at its deadline, delivered by the caller's wait."""
    layout = KVLayout.from_contiguous(torch.randn(8, 2, BS, 2, 2, 8))
    host = HostPool.like(layout, 8)
    store = HungStore()
    tier = TierIO(host, NS, [store])
    try:
        tier.submit(Job(1, Medium.HOST, Medium.REDIS, (0,), keys=(KEYS[0],),
                        tokens=(CHUNKS[0],), media=(Medium.REDIS,), below_slots=(-1,)))
        assert store.writing.wait(5)
        began = time.monotonic()
        tier.submit(Job(2, Medium.REDIS, Medium.HOST, (1, 2), keys=tuple(KEYS[:2]),
                        tokens=tuple(CHUNKS[:2]), media=(Medium.REDIS,) * 2,
                        below_slots=(-1, -1), budget_s=0.2))
        results = []
        while not results and time.monotonic() - began < 5:
            results = (tier.wait_any(5) if wait == "wait_any" else
                       tier.wait_fetches(5) if wait == "wait_fetches" else tier.poll())
            if wait == "poll" and not results:
                time.sleep(0.01)
        waited = time.monotonic() - began
        assert [r.job_id for r in results] == [2]
        assert results[0].ok == (False, False)
        assert results[0].reasons == (Reason.DEADLINE,) * 2
        assert 0.2 <= waited < 1.0
        assert tier.busy  # the hung write is still owed its result
    finally:
        store.release.set()
        tier.close()
    assert store.log == []  # the expired fetch never reached the store
