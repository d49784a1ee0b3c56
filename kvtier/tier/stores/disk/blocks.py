"""The disk tier's bytes: a `DiskStore`'s slots, paced where the operator capped the disk."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.tier.io.block_format import BlockHeader, Buffer
from kvtier.tier.io.store import DeadlineReads, StoreMiss
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.stores.disk.file import DiskStore


class DiskBlocks:
    """A `DiskStore`'s slots, paced to `max_gbps` where the operator capped the disk."""

    medium = Medium.DISK
    mac = None  # 0600 file of the serving user: see io/thread.py on why no MAC

    def __init__(self, store: DiskStore, max_gbps: float | None = None) -> None:
        self.store, self.max_gbps = store, max_gbps

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview], keep_until: Sequence[float] = ()
              ) -> list[OSError | StoreMiss | None]:
        # keep_until: the disk's books keep retention (retention.json)
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

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        return [None] * len(keys)  # nothing here expires by itself: the books keep retention

    @property
    def parallel_reads(self) -> bool:
        return not self.max_gbps  # a capped disk is paced one read at a time

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> DeadlineReads:
        return DeadlineReads(self.read, deadline)  # every read is one local pread, into its row

    def read(self, key: BlockKey, slot: int, out: memoryview) -> tuple[BlockHeader, Buffer]:
        began = time.perf_counter()
        header = self.store.read(slot, out)
        self._pace(len(out), began)
        return header, out

    def discard(self, key: BlockKey, slot: int) -> None:
        self.store.erase(slot)  # the bytes, not only the header: a purge is provable

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
