"""The simulation's KV pools (the device's and the host tier's): whole sessions in recency
order, bounded by bytes or by a count of sessions, evicted least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class SessionLru:
    """Sessions' KV bytes in recency order, bounded by bytes or by a count of sessions."""

    def __init__(self, capacity_bytes: float, max_sessions: int | None = None) -> None:
        self.capacity, self.max_sessions = capacity_bytes, max_sessions
        self.items: OrderedDict[Hashable, int] = OrderedDict()
        self.used = 0

    def put(self, key: Hashable, nbytes: int) -> None:
        """Insert as most recent (the key must not be present)."""
        self.items[key] = nbytes
        self.used += nbytes

    def pop(self, key: Hashable) -> int:
        nbytes = self.items.pop(key)
        self.used -= nbytes
        return nbytes

    def fits(self, nbytes: int) -> bool:
        if self.max_sessions is not None:
            return len(self.items) + 1 <= self.max_sessions
        return self.used + nbytes <= self.capacity

    def room_beside(self, nbytes: int, busy: set[Hashable]) -> bool:
        """Whether `nbytes` fits beside the busy sessions once every idle one is evicted."""
        if self.max_sessions is not None:
            return sum(k in busy for k in self.items) + 1 <= self.max_sessions
        return sum(size for k, size in self.items.items() if k in busy) + nbytes \
            <= self.capacity

    def victims(self, nbytes: int, busy: set[Hashable]) -> list[Hashable]:
        """Idle sessions to drop, least recent first, until `nbytes` fits (or none are left)."""
        chosen: list[Hashable] = []
        used, count = self.used, len(self.items)
        for key, size in self.items.items():
            if self.max_sessions is not None:
                if count + 1 <= self.max_sessions:
                    break
            elif used + nbytes <= self.capacity:
                break
            if key not in busy:
                chosen.append(key)
                used, count = used - size, count - 1
        return chosen
