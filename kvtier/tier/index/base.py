"""The protocol every tier below the device implements: bookkeeping only, never bytes.

Primitives, in the order a caller uses them:
  lookup(keys, tokens)          how many leading keys are present, complete and confirmed
  prepare_store(keys, tokens)   slots for the keys not yet present, pinned as "storing"
  complete_store(keys, ok)      storing -> visible to lookup, or forgotten (a failed store
                                is never a hit)
  prepare_load(keys)            slots of present keys, each pinned once more (a pin count)
  complete_load(keys, ok)       one pin off each
  touch(keys)                   a hit, for the eviction policy
  remove(keys)                  drop unpinned keys (e.g. verification failed)
Between prepare_* and complete_* a slot is pinned: never evicted, never handed out again.
Keys are opaque bytes of any length: content hashes, or per-request keys for a preempted
sequence's partial last block (b"swap:" + request id + index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.tier.keys import BlockKey, Medium


@dataclass(frozen=True)
class PrepareStoreResult:
    """What a store must copy: `keys[i]` goes to `slots[i]`; `evicted` made room for them."""

    keys: list[BlockKey]
    slots: list[int]
    evicted: list[BlockKey]


@dataclass
class IndexStats:
    """Counters (monotonic, in keys) and gauges a benchmark or /metrics reads."""

    lookups: int = 0  # keys examined by lookup (up to and including the first miss)
    hits: int = 0  # keys found complete and confirmed
    stores: int = 0  # keys whose store completed successfully
    store_failures: int = 0  # keys whose store failed and were forgotten
    loads: int = 0  # keys whose load completed successfully
    load_failures: int = 0  # keys whose load was reported failed
    evictions: int = 0  # keys evicted to make room for a store
    collisions: int = 0  # key matched but stored token ids did not (never served)
    used: int = 0  # gauge: slots holding a key (complete or storing)
    capacity: int = 0  # gauge: slots in the tier
    pinned: int = 0  # gauge: slots pinned by an in-flight store or load


class Tier(Protocol):
    """One storage level below the device: which key lives in which slot, and what is pinned."""

    @property
    def medium(self) -> Medium: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def stats(self) -> IndexStats: ...

    def lookup(
        self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]] | None = None
    ) -> int: ...

    def prepare_store(
        self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]]
    ) -> PrepareStoreResult | None: ...

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None: ...

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]: ...

    def complete_load(self, keys: Sequence[BlockKey], success: bool = True) -> None: ...

    def touch(self, keys: Sequence[BlockKey]) -> None: ...

    def remove(self, keys: Sequence[BlockKey]) -> int: ...
