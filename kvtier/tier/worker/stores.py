"""The bytes side of a tier below host memory: one protocol, a disk file and Redis behind it.

`TierIO` (io.py) walks its stores by medium and owns what every store shares: the block
header, verification (`block_format.check`, with the store's MAC where it has one), fault
injection and the once-per-reason logging. A store only moves bytes:
  write(slots, headers, payloads) -> per block None or the error that kept it out
  reads(keys, rows, deadline) -> BlockReads  one job's reads (a shared store fetches them in
                                   batches, receiving payloads straight into the rows where
                                   it can, and stops at the fetch's deadline: the blocks not
                                   landed by then are StoreMiss(DEADLINE))
  discard(key, slot)               a block that failed verification is never read again
  flush() / close() / describe()
A new store is one more class with these methods (and a `SecondaryIndex` for its
bookkeeping, `index/base.py`), plus a line in `wiring.py`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import KvtierError
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.worker.block_format import (
    MAX_TOKENS,
    BlockHeader,
    Buffer,
    CorruptBlock,
    decode_whole_header,
    max_header_nbytes,
    pack,
    unpack,
)
from kvtier.tier.worker.remote_store import Landed
from kvtier.tier.worker.unavailable import RemoteDeadline, RemoteUnavailable

if TYPE_CHECKING:
    from kvtier.tier.worker.block_mac import BlockMac
    from kvtier.tier.worker.disk_store import DiskStore
    from kvtier.tier.worker.remote_store import KeyValueStore

# Redis round trips carry at most this many bytes: one huge MGET is slower to parse (measured
# 0.66 vs 1.0 GB/s for 64 vs 16 blocks of 737 KB) and a single stall past the socket timeout
# would cost the whole prefix instead of its tail.
REMOTE_BATCH_BYTES = 16 << 20
# A remote value at most this much longer than its host row lands in the row (its payload)
# and a header buffer; the largest header any block can carry.
REMOTE_HEADER_LIMIT = max_header_nbytes(MAX_TOKENS)


class StoreMiss(KvtierError):
    """A block the store could not hand over or take (absent, unreachable): a miss, never the
    block's fault, so nothing is discarded."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class BlockReads(Protocol):
    """One fetch job's reads from one store."""

    def ready(self, key: BlockKey) -> bool:
        """Whether verifying `key` costs no further round trip (after a failure, only such
        blocks are still checked, so every bad block leaves in one fetch)."""
        ...

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        """The block's header and payload (`out` itself where its bytes are already there or
        read into it, else a view to copy once verified; `out` is the row `reads` was given
        for `key`). Raises CorruptBlock, StoreMiss or OSError."""
        ...


class SecondaryStore(Protocol):
    """The bytes of whole blocks in one tier below host, by key (and slot where it has them)."""

    @property
    def medium(self) -> Medium: ...

    @property
    def mac(self) -> BlockMac | None:
        """Required of every block fetched from this store (None: the checksum only)."""
        ...

    @property
    def parallel_reads(self) -> bool:
        """Whether several threads may read (and verify) its blocks of one fetch at once."""
        ...

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]: ...

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> BlockReads:
        """One fetch job's reads of `keys`, into `rows` (one per key) where the store can;
        what it fetches ahead stops at `deadline` (`time.monotonic()`; None: none)."""
        ...

    def discard(self, key: BlockKey, slot: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class DiskBlocks:
    """A `DiskStore`'s slots, paced to `max_gbps` where the operator capped the disk."""

    medium = Medium.DISK
    mac = None  # 0600 file of the serving user: see io.py on why no MAC

    def __init__(self, store: DiskStore, max_gbps: float | None = None) -> None:
        self.store, self.max_gbps = store, max_gbps

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]:
        errors: list[OSError | StoreMiss | None] = []
        for slot, header, payload in zip(slots, headers, payloads):
            began = time.perf_counter()
            try:
                self.store.write(slot, header, payload)
            except OSError as e:
                errors.append(e)
                continue
            self._pace(len(payload), began)
            errors.append(None)
        return errors

    @property
    def parallel_reads(self) -> bool:
        return not self.max_gbps  # a capped disk is paced one read at a time

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> _DiskReads:
        return _DiskReads(self, deadline)  # every read is one local pread, into its row

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        began = time.perf_counter()
        header = self.store.read(slot, out)
        self._pace(len(out), began)
        return header, out

    def discard(self, key: BlockKey, slot: int) -> None:
        self.store.invalidate(slot)

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.store.path), "file_bytes": self.store.file_nbytes}

    def _pace(self, nbytes: int, began: float) -> None:
        """Hold disk I/O to `max_gbps` (sleeping releases the disk and the GIL)."""
        if self.max_gbps:
            left = nbytes / (self.max_gbps * 1e9) - (time.perf_counter() - began)
            if left > 0:
                time.sleep(left)


class _DiskReads:
    """One fetch's disk reads, each started only before the fetch's `deadline` (a read in
    progress then is not interrupted: a fetch ends at most one block's read past it)."""

    def __init__(self, blocks: DiskBlocks, deadline: float | None) -> None:
        self.blocks, self.deadline = blocks, deadline

    def ready(self, key: BlockKey) -> bool:
        return True

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise StoreMiss(Reason.DEADLINE, "the fetch's deadline passed before its read")
        return self.blocks.read(key, slot, out)


class RemoteBlocks:
    """A remote store's keys (one server or a cluster), batched into bounded round trips;
    every block signed with `mac` when the deployment has a secret."""

    medium = Medium.REMOTE
    parallel_reads = True  # a fetch's bytes are in memory before its blocks are verified

    def __init__(self, store: KeyValueStore, mac: BlockMac | None, slot_bytes: int) -> None:
        self.store, self.mac, self.slot_bytes = store, mac, slot_bytes

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview]) -> list[OSError | StoreMiss | None]:
        items = [(h.key, pack(h, p, self.mac)) for h, p in zip(headers, payloads)]
        errors: list[OSError | StoreMiss | None] = [None] * len(items)
        for lo, hi in batches([len(p) for p in payloads]):
            try:
                outcomes = self.store.put_many(items[lo:hi])
            except RemoteUnavailable as e:  # this batch and every later one: not stored
                errors[lo:] = [StoreMiss(e.reason, str(e))] * (len(items) - lo)
                break
            for i, failed in enumerate(outcomes, lo):  # a cluster: one shard's keys only
                if failed is not None:
                    errors[i] = StoreMiss(failed.reason, str(failed))
        return errors

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> _RemoteReads:
        blobs: dict[BlockKey, bytes | Landed | None] = {}
        errors: dict[BlockKey, RemoteUnavailable] = {}
        error = RemoteUnavailable("")
        for lo, hi in batches([self.slot_bytes] * len(keys)):
            if deadline is not None and time.monotonic() >= deadline:
                error = RemoteDeadline("the fetch's deadline passed before its batch was sent")
                break
            try:
                values = self.store.get_many_into(keys[lo:hi], rows[lo:hi],
                                                  REMOTE_HEADER_LIMIT, deadline)
            except RemoteUnavailable as e:
                error = e
                break  # the leading batches still serve; the rest misses for e's reason
            for key, value in zip(keys[lo:hi], values):
                if isinstance(value, RemoteUnavailable):  # one shard's, or past the deadline
                    errors[key] = value
                else:
                    blobs[key] = value
        return _RemoteReads(blobs, errors, error)

    def discard(self, key: BlockKey, slot: int) -> None:
        # If Redis is down, the block stays wrong there and is checked (and refused) again.
        with contextlib.suppress(RemoteUnavailable):
            self.store.delete_many([key])

    def flush(self) -> None:
        """Nothing to sync: Redis owns its durability."""

    def close(self) -> None:
        self.store.close()

    def describe(self) -> dict[str, Any]:
        return self.store.describe()


class _RemoteReads:
    """One job's blocks as the batches returned them (absent where a batch or a shard
    failed, or the deadline passed: `errors` says why per key, `error` for the batches
    never sent)."""

    def __init__(self, blobs: dict[BlockKey, bytes | Landed | None],
                 errors: dict[BlockKey, RemoteUnavailable], error: RemoteUnavailable) -> None:
        self.blobs, self.errors, self.error = blobs, errors, error

    def ready(self, key: BlockKey) -> bool:
        return self.blobs.get(key) is not None

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        if key not in self.blobs:
            error = self.errors.get(key, self.error)
            raise StoreMiss(error.reason, str(error))
        blob = self.blobs[key]
        if blob is None:  # expired, evicted by Redis, or deleted since the lookup
            raise StoreMiss(Reason.MISSING, "absent")
        if isinstance(blob, Landed):  # the payload is in `out` already
            return decode_whole_header(blob.header), out
        try:
            return unpack(blob)
        except ValueError as e:
            raise CorruptBlock(Reason.SIZE, str(e)) from None


def batches(sizes: Sequence[int], limit: int = REMOTE_BATCH_BYTES) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of consecutive items, each at most `limit` bytes (or one item
    where a single one is larger)."""
    out: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, size in enumerate(sizes):
        if i > lo and total + size > limit:
            out.append((lo, i))
            lo, total = i, 0
        total += size
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out
