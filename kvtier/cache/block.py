"""Where a logical block's authoritative bytes live (block keys are the tier's: `tier.keys`)."""

from __future__ import annotations

import enum


class Residency(enum.Enum):
    """Where the authoritative bytes of one logical block are right now."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"
    IN_FLIGHT = "in_flight"
    NONE = "none"  # nowhere: must be recomputed
