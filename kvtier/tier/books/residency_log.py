"""Which blocks became resident on a slot tier (host, disk), and which stopped being: for a
client that tells others where its blocks live (vLLM's KV events, read by prefix-aware routers).

  record(medium, kind, keys)     the slot tiers, as their bookkeeping changes
  take() -> [ResidencyChange]    every change since the last take, in the order it happened
A tier built without asking for the log gets one that records nothing (`ResidencyLog(False)`):
no change is kept, so a client that publishes nothing pays nothing. Blocks a disk tier adopts
at start are the state it was built with, not changes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tier.keys import BlockKey, Medium


class ChangeKind(str, enum.Enum):
    """What happened to one key on one medium; the value is a label for logs."""

    STORED = "stored"  # its store completed: resident, visible to lookup
    REMOVED = "removed"  # it was resident and is not any more: evicted, or removed
    FAILED = "failed"  # its store failed: it never became resident (nothing to withdraw)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ResidencyChange:
    """`key` became resident on `medium`, or stopped being (`kind`)."""

    key: BlockKey
    medium: Medium
    kind: ChangeKind


class ResidencyLog:
    """Residency changes of the slot tiers that share it, in order, until taken."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: records nothing (a client that asked for no log)
        self._changes: list[ResidencyChange] = []

    def record(self, medium: Medium, kind: ChangeKind, keys: Sequence[BlockKey]) -> None:
        if self.enabled:
            self._changes.extend(ResidencyChange(key, medium, kind) for key in keys)

    def take(self) -> list[ResidencyChange]:
        """The changes since the last take, oldest first."""
        changes, self._changes = self._changes, []
        return changes
