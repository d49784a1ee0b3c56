"""The device block pool: reference counts, an LRU free queue, and the prefix index.

Primitives: `allocate(n)`, `free(ids)`, `lookup(keys, tokens)`, `touch(ids)`, `register(...)`;
for the tier below: `cached_free(limit, idle_before)` (the next eviction candidates) and
`uncache(ids)` (forget free blocks' keys once their bytes are safe elsewhere).
A free block whose key is still in the index keeps its bytes until `allocate` reuses it
(least recently freed first), so a finished prefix stays a cache hit for as long as possible.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tier import BlockKey


@dataclass
class PoolStats:
    """Counters a benchmark or /metrics reads; all monotonically increasing."""

    lookups: int = 0  # blocks asked for
    hits: int = 0  # blocks found and confirmed by token ids
    key_collisions: int = 0  # key matched but tokens did not (never served)
    evictions: int = 0  # cached free blocks whose bytes were reused


class BlockPool:
    """Physical device blocks 0..num_blocks-1 and who holds them."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.index: dict[BlockKey, int] = {}
        # Blocks with ref_cnt 0, least recently freed first; dict order is the LRU order.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.freed_at = [0.0] * num_blocks  # monotonic time each block last became free
        self.stats = PoolStats()

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with ref_cnt 1, or None (and nothing taken) if fewer than n are free."""
        if n > len(self.free_queue):
            return None
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            ids.append(block_id)
        # Any free block serves any position: ascending ids make consecutive blocks one copy.
        return sorted(ids)

    def allocate_run(self, n: int) -> list[int] | None:
        """n consecutive free blocks, so a restore lands as one large copy instead of many
        small ones; the window that evicts the fewest cached blocks wins. None if no run of
        n free blocks exists (then `allocate` serves it, scattered)."""
        if n < 2 or n > len(self.free_queue):
            return self.allocate(n) if 0 < n <= len(self.free_queue) else ([] if n == 0 else None)
        busy = keyed = 0
        best: tuple[int, int] | None = None  # (evictions, start)
        for end in range(self.num_blocks):
            busy += self.ref_cnt[end] > 0
            keyed += self.ref_cnt[end] == 0 and self.key[end] is not None
            start = end - n + 1
            if start > 0:
                gone = start - 1
                busy -= self.ref_cnt[gone] > 0
                keyed -= self.ref_cnt[gone] == 0 and self.key[gone] is not None
            if start >= 0 and busy == 0 and (best is None or keyed < best[0]):
                best = (keyed, start)
                if keyed == 0:
                    break
        if best is None:
            return None
        ids = list(range(best[1], best[1] + n))
        for block_id in ids:
            del self.free_queue[block_id]
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
        return ids

    def free(self, block_ids: Sequence[int], evict_first: bool = False) -> None:
        """Drop one reference each; pass blocks tail first so a prefix outlives its suffix.

        `evict_first` queues blocks that reach zero at the eviction end, in the given order
        (their bytes are safe in a lower tier, so they are the cheapest to lose).
        """
        now = time.monotonic()
        # At the eviction end, the first id must end up first: queue them last to first.
        for block_id in reversed(block_ids) if evict_first else block_ids:
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.freed_at[block_id] = now
                if self.key[block_id] is None or evict_first:
                    # Nothing worth keeping: reuse it before any cached block.
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None

    def lookup(self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]]) -> list[int]:
        """The longest run of leading blocks that are cached, confirmed token by token.

        Takes no reference: call `touch` on the result before anything else can allocate.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for key, tokens in zip(keys, token_chunks):
            self.stats.lookups += 1
            block_id = self.index.get(key)
            if block_id is None:
                break
            if self.tokens[block_id] != tuple(tokens):
                self.stats.key_collisions += 1
                break
            hits.append(block_id)
        self.stats.hits += len(hits)
        return hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by `lookup` (reviving free ones)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def register(self, block_id: int, key: BlockKey, tokens: Sequence[int]) -> bool:
        """Publish a full block under its key; False if another block already holds that key."""
        if not self.enable_prefix_caching or key in self.index:
            return False
        assert self.key[block_id] is None, f"block {block_id} is already registered"
        self.index[key] = block_id
        self.key[block_id] = key
        self.tokens[block_id] = tuple(tokens)
        return True

    def cached_free(self, limit: int, idle_before: float | None = None) -> list[int]:
        """Free blocks still holding a prefix, next to be evicted first (at most `limit`);
        with `idle_before`, only those free since before that monotonic time."""
        found: list[int] = []
        for block_id in self.free_queue:
            if len(found) >= limit:
                break
            if self.key[block_id] is None:
                continue
            if idle_before is not None and self.freed_at[block_id] >= idle_before:
                continue
            found.append(block_id)
        return found

    def num_free_uncached(self) -> int:
        """Free blocks holding nothing worth keeping: `allocate` takes these first."""
        return sum(1 for b in self.free_queue if self.key[b] is None)

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forget free blocks' keys (their bytes live on in a lower tier); they are reused
        first, in the given order, so a later allocation gets them as one ascending run."""
        for block_id in reversed(block_ids):
            assert self.ref_cnt[block_id] == 0, f"block {block_id} is in use"
            self._evict(block_id)
            self.stats.evictions -= 1  # a demotion, not an eviction under pressure
            self.free_queue.move_to_end(block_id, last=False)

    def purge(self, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """Forget the free blocks cached under `keys` (reused first, like `uncache`); a
        block a request holds keeps its key. (Dropped, kept in use.)"""
        held = [self.index[k] for k in dict.fromkeys(keys) if k in self.index]
        free = [b for b in held if self.ref_cnt[b] == 0]
        self.uncache(free)
        return len(free), len(held) - len(free)

    def _evict(self, block_id: int) -> None:
        key = self.key[block_id]
        if key is not None:
            del self.index[key]
            self.key[block_id] = None
            self.tokens[block_id] = None
            self.stats.evictions += 1

    def check_invariants(self) -> None:
        """Internal consistency, for tests: every block is either referenced or free, once."""
        for block_id in range(self.num_blocks):
            in_queue = block_id in self.free_queue
            assert (self.ref_cnt[block_id] == 0) == in_queue, f"block {block_id} accounting"
        for key, block_id in self.index.items():
            assert self.key[block_id] == key
