"""Where a request's earlier KV state lived when it was admitted: one vocabulary from the tier
to the server's `x-kvtier-residency` header, the metrics' labels and every report.

A `Medium` says where a block's bytes are; a `Residency` says where a request's prefix came
from, which adds "nowhere yet" (new) and "it existed, but was computed again" (recomputed).
"""

from __future__ import annotations

import enum

from kvtier.tier.keys import Medium


class Residency(str, enum.Enum):
    """Where a request's prior state lived; the value is the label clients see."""

    NEW = "new"  # no earlier state: computed from scratch
    RESIDENT = "resident"  # a device prefix hit
    HOST = "host"  # restored from host memory
    DISK = "disk"  # fetched up from disk to host, then restored
    SHARED = "remote"  # fetched up from a store instances share, then restored (label kept)
    RECOMPUTED = "recomputed"  # it existed (or was declined, or its load failed): computed again

    def __str__(self) -> str:  # "host" in headers and messages, not "Residency.HOST"
        return self.value

    @classmethod
    def from_medium(cls, medium: Medium) -> Residency:
        """The residency of state found on `medium` (on the device itself: resident; in a
        store below host: disk for a local one, remote for a shared one)."""
        if medium in _FROM_MEDIUM:
            return _FROM_MEDIUM[medium]
        return cls.SHARED if medium.shared else cls.DISK

    @property
    def restored(self) -> bool:
        """Brought back from a tier below the device (host, disk or remote)."""
        return self in _RESTORED


_FROM_MEDIUM = {
    Medium.DEVICE: Residency.RESIDENT,
    Medium.HOST: Residency.HOST,
}
_RESTORED = frozenset({Residency.HOST, Residency.DISK, Residency.SHARED})
