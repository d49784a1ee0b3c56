"""Host-memory tier bookkeeping: which key sits in which row of the pinned host pool."""

from __future__ import annotations

from kvtier.tier.books.slots import SlotTier
from kvtier.tier.keys import Medium


class HostTier(SlotTier):
    """Rows of the host pool (`link/host_pool.HostPool`), one block per row."""

    medium = Medium.HOST
    size_knob = "kv_offloading_size"
