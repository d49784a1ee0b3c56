"""The bytes side of a tier below host memory: the protocol every store implements.

`TierIO` (thread.py) walks its stores by medium and owns what every store shares: the block
header, verification (`block_format.check`, with the store's MAC where it has one), fault
injection and the once-per-reason logging. A store only moves bytes:
  write(slots, headers, payloads) -> per block None or the error that kept it out
  renew(keys, keep_until)          a retention granted later: stored blocks kept that long
  reads(keys, rows, deadline) -> BlockReads  one job's reads (a shared store fetches them in
                                   batches, receiving payloads straight into the rows where
                                   it can, and stops at the fetch's deadline: the blocks not
                                   landed by then are StoreMiss(DEADLINE))
  discard(key, slot)               a block that failed verification is never read again
  flush() / close() / describe()
A store is a folder under `stores/` holding such a class, a `SecondaryIndex` for its
bookkeeping (`books/protocol.py`), and the `StoreKind` that opens both (`stores/kind.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.errors import KvtierError
from kvtier.tier.io.block_format import BlockHeader, Buffer
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey, Medium

if TYPE_CHECKING:
    from kvtier.tier.io.block_mac import BlockMac


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
              payloads: Sequence[memoryview], keep_until: Sequence[float] = ()
              ) -> list[OSError | StoreMiss | None]:
        """Store the blocks; `keep_until[i]`: block i's retention deadline (Unix time, 0:
        none), which a store that expires blocks by itself must not cut short."""
        ...

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        """Keep the stored `keys` at least until `keep_until[i]` (Unix time): a retention
        granted after they were written. An absent key stays absent; a store that expires
        nothing by itself has nothing to do."""
        ...

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> BlockReads:
        """One fetch job's reads of `keys`, into `rows` (one per key) where the store can;
        what it fetches ahead stops at `deadline` (`time.monotonic()`; None: none)."""
        ...

    def discard(self, key: BlockKey, slot: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


class DeadlineReads:
    """One fetch's reads from a store that reads a block at a time (a file, a row), each
    started only before the fetch's `deadline` (a read in progress then is not interrupted:
    a fetch ends at most one block's read past it)."""

    def __init__(self, read: Callable[[BlockKey, int, memoryview], tuple[BlockHeader, Buffer]],
                 deadline: float | None) -> None:
        self._read, self.deadline = read, deadline

    def ready(self, key: BlockKey) -> bool:
        return True  # every read is the store's own, at hand

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise StoreMiss(Reason.DEADLINE, "the fetch's deadline passed before its read")
        return self._read(key, slot, out)


def batches(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
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
