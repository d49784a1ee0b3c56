"""Bytes between host-pool rows and the tiers below host memory (a disk file, Redis).

Primitives:
  submit(job)                  a write (host rows -> tier) or a fetch (tier -> host rows)
  poll() -> [Result]           jobs finished since the last poll; never blocks
  wait_any()                   block until a job finishes
  close()                      stop the thread; unfinished jobs fail (and count as misses)
One I/O thread, fetches first (a request waits on them). Every fetched block is checked on
this thread before its row is handed back: header, fingerprint, key, token ids and payload
checksum (`block_format.check`), and for Redis under a secret its MAC (`block_mac.py`). A
block that fails is invalidated where it lives (the disk slot's header is wiped, the Redis
key deleted) so it is never read again. After a failure nothing of that prefix is served
(a prefix cannot skip a block), but its remaining blocks are still verified (disk blocks
read, Redis blocks already in this job's MGETs: no extra round trip), so every bad one
leaves its tier in one fetch: a forged prefix is deleted whole, not a block per wake.
I/O errors and an unreachable Redis are failures of the job's keys, never exceptions out
of this thread. Every reason is a bounded `Reason`; the text of an error (strerror, an
exception) is logged once per tier and reason, never a label.

Only the remote tier carries a MAC. Whoever can write a shared Redis is another party; the
disk tier's slot file is 0600 in a 0700 directory owned by the serving user, so whoever can
write it is that user or root, who could equally replace the weights or the code. A MAC
there would stop no one new, and would cost the disk wake path a keyed hash at ~5 GB/s
instead of xxh3 at ~23 GB/s (benchmarks/block_mac.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.tier.jobs import Job, Reason, Result
from kvtier.tier.keys import Medium
from kvtier.tier.worker.block_format import (
    BlockHeader,
    CorruptBlock,
    check,
    copy_into,
    pack,
    payload_checksum,
    tensor_bytes,
    unpack,
)
from kvtier.tier.worker.disk_store import DiskStore
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.unavailable import RemoteUnavailable

if TYPE_CHECKING:
    from kvtier.tier.worker.block_mac import BlockMac
    from kvtier.tier.worker.redis_store import RedisStore

log = logging.getLogger(__name__)

DISK, REMOTE = Medium.DISK, Medium.REMOTE
# Redis round trips carry at most this many bytes: one huge MGET is slower to parse (measured
# 0.66 vs 1.0 GB/s for 64 vs 16 blocks of 737 KB) and a single stall past the socket timeout
# would cost the whole prefix instead of its tail.
REMOTE_BATCH_BYTES = 16 << 20

_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

# A fault hook for tests: (job, key index) -> a reason to fail that key, or None. A fetch
# fails with that `Reason`; a write raises it as an OSError's text.
TierFault = Callable[[Job, int], Reason | str | None]


class TierIO:
    """Runs tier jobs on one thread against a `DiskStore` and/or a `RedisStore`; `mac`
    signs every block written to the remote tier and is required of every one fetched."""

    def __init__(self, host: HostPool, namespace: bytes, disk: DiskStore | None = None,
                 remote: RedisStore | None = None, disk_max_gbps: float | None = None,
                 mac: BlockMac | None = None) -> None:
        self.host, self.namespace = host, namespace
        self.disk, self.remote, self.mac = disk, remote, mac
        self.encoding = host.encoding  # a row's bytes go down as they are: encoded or not
        self.disk_max_gbps = disk_max_gbps
        self.fault: TierFault | None = None
        self._logged: set[tuple[Medium, Reason]] = set()  # touched by the I/O thread only
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._done: dict[int, Result] = {}
        self._order: dict[int, int] = {}  # job id -> submission order, for delivery
        self._submitted = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (its id is the caller's); fetches go ahead of background writes."""
        with self._cond:
            if self._closing:
                raise RuntimeError("tier I/O is closed")
            self._order[job.id] = self._submitted
            self._submitted += 1
            if job.dst is Medium.HOST:  # a fetch: a request waits on it
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._order)

    def poll(self) -> list[Result]:
        with self._cond:
            done = sorted(self._done.values(), key=lambda r: self._order[r.job_id])
            for r in done:
                del self._order[r.job_id]
            self._done.clear()
            return done

    def wait_any(self, timeout: float | None = None) -> list[Result]:
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
                job = self._queue.popleft()
                n = len(job.keys)
                self._done[job.id] = Result(job.id, (False,) * n, (Reason.CLOSED,) * n, 0, 0)

    def _run(self) -> None:
        torch.set_num_threads(1)  # compute keeps its OpenMP team to itself (worker/link.py)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and nothing left that a shutdown waits on
                    return
                job = self._queue.popleft()
            start = time.perf_counter()
            try:
                ok, reasons, nbytes = (self._write(job) if job.src is Medium.HOST
                                       else self._fetch(job))
            except Exception as e:  # never let one job take the thread down
                n = len(job.keys)
                tier = job.src if job.dst is Medium.HOST else job.dst
                reason = self._note(tier, Reason.ERROR, f"{type(e).__name__}: {e}")
                ok, reasons, nbytes = [False] * n, [reason] * n, 0
            result = Result(job.id, tuple(ok), tuple(reasons), nbytes,
                            time.perf_counter() - start)
            with self._cond:
                self._done[job.id] = result
                self._cond.notify_all()

    def _note(self, tier: Medium, reason: Reason, detail: str) -> Reason:
        """`reason`, its `detail` logged the first time this tier fails this way (the label
        stays bounded; the text is still seen once)."""
        if (tier, reason) not in self._logged:
            self._logged.add((tier, reason))
            log.warning("kvtier %s tier: %s (%s); logged once per tier and reason",
                        tier.value, reason.value, detail)
        return reason

    def _os_error(self, tier: Medium, e: OSError) -> Reason:
        """A failed medium: full (ENOSPC, EDQUOT) or any other I/O error."""
        return self._note(tier, Reason.NO_SPACE if e.errno in _NO_SPACE else Reason.IO, str(e))

    # -- writes -------------------------------------------------------------------------

    def _header(self, key: bytes, tokens: Sequence[int], payload: memoryview) -> BlockHeader:
        return BlockHeader(self.namespace, key, tuple(tokens), len(payload),
                           payload_checksum(payload), self.encoding)

    def _write(self, job: Job) -> tuple[list[bool], list[Reason], int]:
        n = len(job.keys)
        ok, reasons = [False] * n, [Reason.IO] * n
        rows = [tensor_bytes(self.host.tensor[s]) for s in job.host_slots]
        if job.dst is REMOTE:
            assert self.remote is not None
            items = [(k, pack(self._header(k, t, row), row, self.mac))
                     for k, t, row in zip(job.keys, job.tokens, rows)]
            nbytes = 0
            for lo, hi in _batches([len(row) for row in rows]):
                try:
                    self.remote.put_many(items[lo:hi])
                except RemoteUnavailable as e:
                    reasons[lo:] = [self._note(REMOTE, Reason.UNAVAILABLE, str(e))] * (n - lo)
                    break
                ok[lo:hi], reasons[lo:hi] = [True] * (hi - lo), [Reason.OK] * (hi - lo)
                nbytes += sum(len(row) for row in rows[lo:hi])
            return ok, reasons, nbytes
        assert self.disk is not None
        nbytes = 0
        for i, (key, tokens, row, slot) in enumerate(
                zip(job.keys, job.tokens, rows, job.disk_slots)):
            fault = self.fault(job, i) if self.fault is not None else None
            try:
                if fault is not None:
                    raise OSError(str(fault))
                began = time.perf_counter()
                self.disk.write(slot, self._header(key, tokens, row), row)
                self._pace(len(row), began)
            except OSError as e:
                reasons[i] = self._os_error(DISK, e)
                continue
            ok[i], reasons[i] = True, Reason.OK
            nbytes += len(row)
        return ok, reasons, nbytes

    # -- fetches ------------------------------------------------------------------------

    def _fetch(self, job: Job) -> tuple[list[bool], list[Reason], int]:
        n = len(job.keys)
        ok, reasons = [False] * n, [Reason.SKIPPED] * n
        blobs = self._remote_blobs(job)
        nbytes = 0
        failed = False  # after a failure no block counts (a prefix cannot skip a block)
        for i, (key, tokens, slot, tier) in enumerate(
                zip(job.keys, job.tokens, job.host_slots, job.media)):
            if failed and tier != DISK and blobs.get(key) is None:
                continue  # not fetched (or absent): nothing of it to verify, SKIPPED
            row = self.host.tensor[slot]
            fault = self.fault(job, i) if self.fault is not None else None
            reason = Reason(fault) if fault is not None else None
            if reason is None:
                reason = (self._read_disk(key, tokens, job.disk_slots[i], row) if tier == DISK
                          else self._read_remote(key, tokens, blobs, row))
            if reason is not None:
                reasons[i], failed = reason, True  # a bad disk block after it: its own reason
            elif not failed:
                ok[i], reasons[i] = True, Reason.OK
                nbytes += self.host.slot_bytes  # as stored: a host row, 8-bit where it is
        return ok, reasons, nbytes

    def _read_disk(self, key: bytes, tokens: Sequence[int], slot: int, row: torch.Tensor
                   ) -> Reason | None:
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
            return self._os_error(DISK, e)  # the medium failed, not the block: keep the slot
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

    def _remote_blobs(self, job: Job) -> dict[bytes, bytes | None]:
        keys = [k for k, t in zip(job.keys, job.media) if t == REMOTE]
        if not keys:
            return {}
        assert self.remote is not None
        size = self.host.slot_bytes
        blobs: dict[bytes, bytes | None] = {}
        for lo, hi in _batches([size] * len(keys)):
            try:
                blobs.update(zip(keys[lo:hi], self.remote.get_many(keys[lo:hi])))
            except RemoteUnavailable as e:
                self._note(REMOTE, Reason.UNAVAILABLE, str(e))
                break  # the leading batches still serve; the rest is UNAVAILABLE
        return blobs

    def _read_remote(self, key: bytes, tokens: Sequence[int], blobs: dict[bytes, bytes | None],
                     row: torch.Tensor) -> Reason | None:
        if key not in blobs:
            return Reason.UNAVAILABLE  # its batch failed: logged by _remote_blobs
        blob = blobs[key]
        if blob is None:
            return Reason.MISSING  # expired, evicted by Redis, or deleted since the lookup
        try:
            header, payload = unpack(blob)
            reason = check(header, namespace=self.namespace, key=key, tokens=tokens,
                           payload=payload, mac=self.mac)
            if reason is None:
                copy_into(row, payload)
                return None
        except CorruptBlock as e:
            reason = e.reason
        except ValueError:
            reason = Reason.SIZE
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
