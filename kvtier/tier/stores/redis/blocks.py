"""The shared store's bytes: a key-value store's keys (one server or a cluster), batched into
bounded round trips, every block signed with the deployment's MAC where it has a secret."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tier.io.block_format import (
    MAX_TOKENS,
    BlockHeader,
    Buffer,
    CorruptBlock,
    decode_whole_header,
    max_header_nbytes,
    pack,
    unpack,
)
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.io.store import StoreMiss, batches
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.stores.redis.kv import KeyValueStore, Landed
from kvtier.tier.stores.redis.unavailable import RemoteDeadline, RemoteUnavailable

# Redis round trips carry at most this many bytes: one huge MGET is slower to parse (measured
# 0.66 vs 1.0 GB/s for 64 vs 16 blocks of 737 KB) and a single stall past the socket timeout
# would cost the whole prefix instead of its tail.
REMOTE_BATCH_BYTES = 16 << 20
# A remote value at most this much longer than its host row lands in the row (its payload)
# and a header buffer; the largest header any block can carry.
REMOTE_HEADER_LIMIT = max_header_nbytes(MAX_TOKENS)
RENEW_BATCH_KEYS = 1024  # PEXPIREs per round trip when a retention renews stored blocks


class RedisBlocks:
    """A remote store's keys (one server or a cluster), batched into bounded round trips;
    every block signed with `mac` when the deployment has a secret."""

    medium = Medium.REDIS
    parallel_reads = True  # a fetch's bytes are in memory before its blocks are verified

    def __init__(self, store: KeyValueStore, mac: BlockMac | None, slot_bytes: int) -> None:
        self.store, self.mac, self.slot_bytes = store, mac, slot_bytes

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview], keep_until: Sequence[float] = ()
              ) -> list[OSError | StoreMiss | None]:
        """`keep_until`: retention deadlines, which the store's TTL never cuts short."""
        items = [(h.key, pack(h, p, self.mac)) for h, p in zip(headers, payloads)]
        keep = list(keep_until) or [0.0] * len(items)
        return per_item(batches([len(p) for p in payloads], REMOTE_BATCH_BYTES), len(items),
                        lambda lo, hi: self.store.put_many(items[lo:hi], keep[lo:hi]))

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        """The keys' TTLs stretched to their deadlines, in bounded round trips."""
        return per_item(batches([1] * len(keys), RENEW_BATCH_KEYS), len(keys),
                        lambda lo, hi: self.store.keep_many(keys[lo:hi], keep_until[lo:hi]))

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> _RemoteReads:
        blobs: dict[BlockKey, bytes | Landed | None] = {}
        errors: dict[BlockKey, RemoteUnavailable] = {}
        error = RemoteUnavailable("")
        for lo, hi in batches([self.slot_bytes] * len(keys), REMOTE_BATCH_BYTES):
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
        """Delete the key; a Redis that does not answer is a StoreMiss (UNAVAILABLE): a
        purge says so, a bad block stays there and is checked (and refused) again."""
        try:
            self.store.delete_many([key])
        except RemoteUnavailable as e:
            raise StoreMiss(Reason.UNAVAILABLE, str(e)) from None

    def flush(self) -> None:
        """Nothing to sync: Redis owns its durability."""

    def close(self) -> None:
        self.store.close()

    def describe(self) -> dict[str, Any]:
        return self.store.describe()


def per_item(ranges: Sequence[tuple[int, int]], n: int,
             call: Callable[[int, int], Sequence[RemoteUnavailable | None]]
             ) -> list[OSError | StoreMiss | None]:
    """Per item of `n`, None or why the store did not take it: `call(lo, hi)` answers each
    range per item (a cluster: one shard's keys only), and a range the store could not take
    at all fails it and every later one."""
    errors: list[OSError | StoreMiss | None] = [None] * n
    for lo, hi in ranges:
        try:
            outcomes = call(lo, hi)
        except RemoteUnavailable as e:
            errors[lo:] = [StoreMiss(e.reason, str(e))] * (n - lo)
            break
        for i, failed in enumerate(outcomes, lo):
            if failed is not None:
                errors[i] = StoreMiss(failed.reason, str(failed))
    return errors


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
