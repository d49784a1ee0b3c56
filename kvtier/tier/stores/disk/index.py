"""Disk tier bookkeeping: which key sits in which slot of the disk file, across restarts.

A new process rebuilds this index from the headers a previous process left on disk
(`adopt`), so a conversation written down before a restart is found again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

from kvtier.tier.books.residency_log import ResidencyLog
from kvtier.tier.books.slots import SlotTier, _Entry
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.keys import BlockKey, Medium


class DiskTier(SlotTier):
    """Slots of the disk tier's preallocated file (`file.DiskStore`)."""

    medium = Medium.DISK
    size_knob = "disk_kv_size"

    def __init__(self, num_slots: int, policy: str = "lru",
                 unusable_at_start: Mapping[str, int] | None = None,
                 log: ResidencyLog | None = None, tenancy: Tenancy | None = None) -> None:
        """`unusable_at_start`: blocks the file held that this process cannot serve, by
        reason (another fingerprint, a header that does not decode): counted as misses."""
        super().__init__(num_slots, policy, log, tenancy)
        self.unusable_at_start: Counter[str] = Counter(unusable_at_start or {})

    local = True  # its index is the truth: no one else writes the file
    expires = False  # its books keep retention (retention.json)
    pending = False
    answered_absent = 0

    def wait(self, timeout: float) -> None:
        """Nothing to wait for: every answer is local."""

    def close(self) -> None:
        """Nothing runs here: the file is the worker's to close."""

    def complete_fetch(self, keys: Sequence[BlockKey], served: int,
                       dropped: Sequence[BlockKey], success: bool) -> None:
        self.complete_load(keys, success)
        self.remove(dropped)  # failed verification or I/O: never a hit again

    def adopt(self, found: Iterable[tuple[int, BlockKey, Sequence[int]]]) -> list[int]:
        """Register the complete blocks found on disk at start, oldest first for the policy.

        Returns the slots not adopted (out of range, taken twice, or a key seen twice: the
        first one wins), which the caller should invalidate. Only valid on an empty tier.
        Adopted blocks are the state the tier starts in, not residency changes: none is logged.
        """
        assert not self._entries, "adopt rebuilds the index of a tier that holds nothing yet"
        rejected: list[int] = []
        taken: set[int] = set()
        for slot, key, tokens in found:
            if not 0 <= slot < self.num_slots or slot in taken or key in self._entries:
                rejected.append(slot)
                continue
            taken.add(slot)
            self._entries[key] = _Entry(slot, tuple(tokens))
            self.policy.insert(key)
            self.tenancy.entered(self.medium, [key])  # its owner and retention, if saved
        self._free = deque(s for s in self._free if s not in taken)
        return rejected
