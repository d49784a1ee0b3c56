"""Host-memory tier bookkeeping: which key sits in which row of the pinned host pool."""

from __future__ import annotations

from kvtier.cache.block import Residency
from kvtier.tiers.slots import SlotTier


class HostTier(SlotTier):
    """Rows of the host pool (`transfer.host_memory.HostPool`), one block per row."""

    residency = Residency.HOST
    size_knob = "kv_offloading_size"
