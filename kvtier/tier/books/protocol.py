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

`SecondaryIndex` is the same contract seen from the tiers below host (a disk file's slots, a
shared store's presence): `BelowHost` walks a list of them in order, and a new store is one
more implementation (its bytes side is `io/store.py`'s `SecondaryStore`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import IndexStats


@dataclass(frozen=True)
class PrepareStoreResult:
    """What a store must copy: `keys[i]` goes to `slots[i]`; `evicted` made room for them."""

    keys: list[BlockKey]
    slots: list[int]
    evicted: list[BlockKey]


class SlotIndex(Protocol):
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


class SecondaryIndex(Protocol):
    """The bookkeeping of one tier below host memory, as `BelowHost` walks them in order.

    A slotless store (a shared key-value store) answers -1 for every slot; a store that
    asks someone else for presence answers None from `lookup` until the answer is in."""

    @property
    def medium(self) -> Medium: ...

    @property
    def stats(self) -> IndexStats: ...

    @property
    def local(self) -> bool:
        """Whether a hit is known here without asking anyone (a local disk index): such a
        tier is what `write_down_host` fills before a restart."""
        ...

    @property
    def expires(self) -> bool:
        """Whether the store drops blocks by itself (a TTL): a retention granted after a
        block went down is sent on to it (`BelowHost.renew`)."""
        ...

    @property
    def pending(self) -> bool:
        """A presence question asked and not yet answered."""
        ...

    @property
    def answered_absent(self) -> int:
        """Presence questions answered "absent" because the store failed."""
        ...

    @property
    def unusable_at_start(self) -> Mapping[str, int]:
        """Blocks found at start that this process will not serve, by reason."""
        ...

    def lookup(self, keys: Sequence[BlockKey],
               token_chunks: Sequence[Sequence[int]] | None = None) -> int | None: ...

    def wait(self, timeout: float) -> None:
        """Block until the questions asked are answered (or `timeout`)."""
        ...

    def close(self) -> None:
        """Stop whatever the index runs of its own (a presence thread)."""
        ...

    def prepare_store(self, keys: Sequence[BlockKey], token_chunks: Sequence[Sequence[int]]
                      ) -> PrepareStoreResult | None: ...

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None: ...

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]: ...

    def complete_fetch(self, keys: Sequence[BlockKey], served: int,
                       dropped: Sequence[BlockKey], success: bool) -> None:
        """A fetch of `keys` from this tier ended: `served` of them reached a request,
        `dropped` failed verification or I/O (never a hit again), `success`: the whole
        fetch (every tier's blocks) verified."""
        ...
