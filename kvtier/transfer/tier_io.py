"""Bytes between host-pool rows and the tiers below host memory (a disk file, Redis).

Primitives:
  submit(spec) -> job id       a write (host rows -> tier) or a fetch (tier -> host rows)
  poll() -> [TierIOResult]     jobs finished since the last poll; never blocks
  wait(job_id) / wait_any()    block until a job (the oldest one) finishes
  close()                      stop the thread; unfinished jobs fail (and count as misses)
One I/O thread, fetches first (a request waits on them). Every fetched block is checked on
this thread before its row is handed back: header, fingerprint, key, token ids and payload
checksum (`block_format.check`). A block that fails is invalidated where it lives (the
disk slot's header is wiped, the Redis key deleted) so it is never read again, and the
rest of that prefix is not read at all. I/O errors and an unreachable Redis are failures
of the job's keys, never exceptions out of this thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.transfer.block_format import (
    BlockHeader,
    CorruptBlock,
    check,
    copy_into,
    pack,
    payload_checksum,
    tensor_bytes,
    unpack,
)
from kvtier.transfer.disk_store import DiskStore
from kvtier.transfer.host_memory import HostPool
from kvtier.transfer.redis_store import RedisStore, RemoteUnavailable

DISK, REMOTE = "disk", "remote"
# Redis round trips carry at most this many bytes: one huge MGET is slower to parse (measured
# 0.66 vs 1.0 GB/s for 64 vs 16 blocks of 737 KB) and a single stall past the socket timeout
# would cost the whole prefix instead of its tail.
REMOTE_BATCH_BYTES = 16 << 20
SKIPPED = "skipped"  # not read: an earlier block of the same prefix failed


@dataclass(frozen=True)
class TierIOSpec:
    kind: str  # "write" | "fetch"
    keys: tuple[bytes, ...]
    tokens: tuple[tuple[int, ...], ...]
    host_slots: tuple[int, ...]
    tiers: tuple[str, ...]  # per key: "disk" | "remote"
    disk_slots: tuple[int, ...]  # per key; -1 for remote


@dataclass(frozen=True)
class TierIOResult:
    job_id: int
    ok: tuple[bool, ...]
    reasons: tuple[str, ...]
    nbytes: int
    seconds: float


# A fault hook for tests: (spec, key index) -> a reason to fail that key, or None.
TierFault = Callable[[TierIOSpec, int], str | None]


class TierIO:
    """Runs tier jobs on one thread against a `DiskStore` and/or a `RedisStore`."""

    def __init__(self, host: HostPool, namespace: bytes, disk: DiskStore | None = None,
                 remote: RedisStore | None = None, disk_max_gbps: float | None = None) -> None:
        self.host, self.namespace = host, namespace
        self.disk, self.remote = disk, remote
        self.encoding = host.encoding  # a row's bytes go down as they are: encoded or not
        self.disk_max_gbps = disk_max_gbps
        self.fault: TierFault | None = None
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, TierIOSpec]] = deque()
        self._done: dict[int, TierIOResult] = {}
        self._next_id = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-io", daemon=True)
        self._thread.start()

    def submit(self, spec: TierIOSpec) -> int:
        with self._cond:
            if self._closing:
                raise RuntimeError("tier I/O is closed")
            job_id = self._next_id
            self._next_id += 1
            if spec.kind == "fetch":  # a request waits on it: ahead of background writes
                self._queue.appendleft((job_id, spec))
            else:
                self._queue.append((job_id, spec))
            self._cond.notify_all()
            return job_id

    def poll(self) -> list[TierIOResult]:
        with self._cond:
            done = sorted(self._done.values(), key=lambda r: r.job_id)
            self._done.clear()
            return done

    def wait_any(self, timeout: float | None = None) -> list[TierIOResult]:
        """Block until at least one job has finished (or `timeout`); deliver all finished."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._done) or self._closing, timeout)
        return self.poll()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        with self._cond:  # whatever never ran fails: its keys become misses
            while self._queue:
                job_id, spec = self._queue.popleft()
                n = len(spec.keys)
                self._done[job_id] = TierIOResult(job_id, (False,) * n, ("closed",) * n, 0, 0)

    def _run(self) -> None:
        torch.set_num_threads(1)  # compute keeps its OpenMP team to itself (transfer.engine)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and nothing left that a shutdown waits on
                    return
                job_id, spec = self._queue.popleft()
            start = time.perf_counter()
            try:
                ok, reasons, nbytes = (self._write(spec) if spec.kind == "write"
                                       else self._fetch(spec))
            except Exception as e:  # never let one job take the thread down
                n = len(spec.keys)
                ok, reasons, nbytes = [False] * n, [f"error:{type(e).__name__}"] * n, 0
            result = TierIOResult(job_id, tuple(ok), tuple(reasons), nbytes,
                                  time.perf_counter() - start)
            with self._cond:
                self._done[job_id] = result
                self._cond.notify_all()

    # -- writes -------------------------------------------------------------------------

    def _header(self, key: bytes, tokens: Sequence[int], payload: memoryview) -> BlockHeader:
        return BlockHeader(self.namespace, key, tuple(tokens), len(payload),
                           payload_checksum(payload), self.encoding)

    def _write(self, spec: TierIOSpec) -> tuple[list[bool], list[str], int]:
        n = len(spec.keys)
        ok, reasons = [False] * n, ["io"] * n
        rows = [tensor_bytes(self.host.tensor[s]) for s in spec.host_slots]
        if spec.tiers and spec.tiers[0] == REMOTE:
            assert self.remote is not None
            items = [(k, pack(self._header(k, t, row), row))
                     for k, t, row in zip(spec.keys, spec.tokens, rows)]
            nbytes = 0
            for lo, hi in _batches([len(row) for row in rows]):
                try:
                    self.remote.put_many(items[lo:hi])
                except RemoteUnavailable:
                    reasons[lo:] = ["unavailable"] * (n - lo)
                    break
                ok[lo:hi], reasons[lo:hi] = [True] * (hi - lo), [""] * (hi - lo)
                nbytes += sum(len(row) for row in rows[lo:hi])
            return ok, reasons, nbytes
        assert self.disk is not None
        nbytes = 0
        for i, (key, tokens, row, slot) in enumerate(
                zip(spec.keys, spec.tokens, rows, spec.disk_slots)):
            fault = self.fault(spec, i) if self.fault is not None else None
            try:
                if fault is not None:
                    raise OSError(fault)
                began = time.perf_counter()
                self.disk.write(slot, self._header(key, tokens, row), row)
                self._pace(len(row), began)
            except OSError as e:
                reasons[i] = f"io:{e.strerror or e}" if e.strerror else f"io:{e}"
                continue
            ok[i], reasons[i] = True, ""
            nbytes += len(row)
        return ok, reasons, nbytes

    # -- fetches ------------------------------------------------------------------------

    def _fetch(self, spec: TierIOSpec) -> tuple[list[bool], list[str], int]:
        n = len(spec.keys)
        ok, reasons = [False] * n, [SKIPPED] * n
        blobs = self._remote_blobs(spec)
        nbytes = 0
        for i, (key, tokens, slot, tier) in enumerate(
                zip(spec.keys, spec.tokens, spec.host_slots, spec.tiers)):
            row = self.host.tensor[slot]
            reason = self.fault(spec, i) if self.fault is not None else None
            if reason is None:
                reason = (self._read_disk(key, tokens, spec.disk_slots[i], row) if tier == DISK
                          else self._read_remote(key, tokens, blobs, row))
            if reason is not None:
                reasons[i] = reason
                break  # a prefix cannot skip a block: the rest is recomputed anyway
            ok[i], reasons[i] = True, ""
            nbytes += self.host.slot_bytes  # as stored: a host row, 8-bit where it is
        return ok, reasons, nbytes


    def _read_disk(self, key: bytes, tokens: Sequence[int], slot: int, row: torch.Tensor
                   ) -> str | None:
        assert self.disk is not None
        out = tensor_bytes(row)
        try:
            began = time.perf_counter()
            header = self.disk.read(slot, out)
            self._pace(len(out), began)
            reason = check(header, namespace=self.namespace, key=key, tokens=tokens,
                           payload=out)
        except CorruptBlock as e:
            reason = e.reason
        except OSError as e:
            return f"io:{e.strerror or e}"  # the medium failed, not the block: keep the slot
        if reason is not None:
            # If even this fails, the index drops the slot anyway and a restart re-verifies it.
            with contextlib.suppress(OSError):
                self.disk.invalidate(slot)
        return reason

    def _pace(self, nbytes: int, began: float) -> None:
        """Hold disk I/O to `disk_max_gbps` (sleeping releases the disk and the GIL)."""
        if self.disk_max_gbps:
            left = nbytes / (self.disk_max_gbps * 1e9) - (time.perf_counter() - began)
            if left > 0:
                time.sleep(left)

    def _remote_blobs(self, spec: TierIOSpec) -> dict[bytes, bytes | None]:
        keys = [k for k, t in zip(spec.keys, spec.tiers) if t == REMOTE]
        if not keys:
            return {}
        assert self.remote is not None
        size = self.host.slot_bytes
        blobs: dict[bytes, bytes | None] = {}
        for lo, hi in _batches([size] * len(keys)):
            try:
                blobs.update(zip(keys[lo:hi], self.remote.get_many(keys[lo:hi])))
            except RemoteUnavailable:
                break  # the leading batches still serve; the rest is "unavailable"
        return blobs

    def _read_remote(self, key: bytes, tokens: Sequence[int], blobs: dict[bytes, bytes | None],
                     row: torch.Tensor) -> str | None:
        if key not in blobs:
            return "unavailable"
        blob = blobs[key]
        if blob is None:
            return "missing"  # expired, evicted by Redis, or deleted since the lookup
        try:
            header, payload = unpack(blob)
            reason = check(header, namespace=self.namespace, key=key, tokens=tokens,
                           payload=payload)
            if reason is None:
                copy_into(row, payload)
                return None
        except CorruptBlock as e:
            reason = e.reason
        except ValueError:
            reason = "size"
        assert self.remote is not None
        # If Redis is down, the block stays wrong there and is checked (and refused) again.
        with contextlib.suppress(RemoteUnavailable):
            self.remote.delete_many([key])
        return reason


def _batches(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of consecutive items, each at most REMOTE_BATCH_BYTES (or one
    item where a single one is larger)."""
    out: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, size in enumerate(sizes):
        if i > lo and total + size > REMOTE_BATCH_BYTES:
            out.append((lo, i))
            lo, total = i, 0
        total += size
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out
