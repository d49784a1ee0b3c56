"""Remote tier bookkeeping: a store shared by several processes, so presence is asked of it.

Nothing here is authoritative: another process may write or expire a key at any time, so
`lookup` asks the store (through the `exists` callable the engine injects: tiers never do
I/O) and a hit is only a hint until the fetched header, tokens and checksum verify.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.cache.block import BlockKey, Residency
from kvtier.tiers.base import TierStats

# keys -> one presence flag each; must not raise (an unreachable store answers all False)
ExistsFn = Callable[[Sequence[BlockKey]], list[bool]]


class RemoteTier:
    """Counters and in-flight writes of the shared store; presence comes from `exists`."""

    residency = Residency.REMOTE

    def __init__(self, exists: ExistsFn) -> None:
        self._exists = exists
        self._writing: set[BlockKey] = set()
        self._counts = TierStats()

    @property
    def stats(self) -> TierStats:
        s = self._counts
        return TierStats(s.lookups, s.hits, s.stores, s.store_failures, s.loads,
                         s.load_failures, 0, s.collisions, 0, 0, len(self._writing))

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys the store says it holds (tokens are checked on fetch)."""
        if not keys:
            return 0
        present = self._exists(keys)
        hits = 0
        for flag in present:
            if not flag:
                break
            hits += 1
        self._counts.lookups += min(len(keys), hits + 1)
        self._counts.hits += hits
        return hits

    def prepare_store(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """The keys not already being written by this process, marked in flight."""
        new = [k for k in dict.fromkeys(keys) if k not in self._writing]
        self._writing.update(new)
        return new

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None:
        for key in keys:
            self._writing.discard(key)
        if success:
            self._counts.stores += len(keys)
        else:
            self._counts.store_failures += len(keys)

    def complete_load(self, loaded: int, failed: int) -> None:
        self._counts.loads += loaded
        self._counts.load_failures += failed
