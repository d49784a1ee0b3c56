"""How many blocks each tenant's prefetches may bring up into host: a token bucket per
tenant, so a prefetch (a client's hint, nothing computed) cannot be a free host flush.

Unbounded, one client made 266-365 prefetch calls a second, read up to 7,950 blocks from disk
and pushed another tenant's session from host down to disk. Each tenant's bucket holds `share`
of the host's slots (half), refilled over `window_s` (10 s). A prefetch goes whole while its
tenant's bucket holds a block's worth, and may take it below empty (a session larger than the
bucket is still staged whole, on a small host too); the debt is paid back at the refill rate
before the next one goes, so a loop is cut to that rate, and each block it asked for while
the bucket was empty is counted (the tenant's `prefetch_limited`), never fetched.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PREFETCH_SHARE = 0.5  # of the host's slots, one tenant's bucket
PREFETCH_WINDOW_S = 10.0  # a bucket refills whole in this long
MAX_BUCKETS = 4096  # tenants remembered; past it the least recently seen (the fullest) go


class PrefetchBudget:
    """Blocks each tenant may still prefetch now (`allowed`), spent as fetches start."""

    def __init__(self, host_slots: int, share: float = MAX_PREFETCH_SHARE,
                 window_s: float = PREFETCH_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = max(1.0, share * host_slots)
        self.rate = self.capacity / window_s  # blocks a second
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, at

    def allows(self, tenant: str) -> bool:
        """Whether `tenant` may prefetch now (its bucket holds a block's worth)."""
        return self._level(tenant) >= 1.0

    def spend(self, tenant: str, blocks: int) -> None:
        """`blocks` of `tenant`'s prefetch started up (the bucket may go below empty, as
        far as one bucket: a debt paid back before the next)."""
        level = max(-self.capacity, self._level(tenant) - blocks)
        self._buckets[tenant] = (level, self.clock())
        self._buckets.move_to_end(tenant)
        while len(self._buckets) > MAX_BUCKETS:  # a full bucket says nothing: forget it
            self._buckets.popitem(last=False)

    def _level(self, tenant: str) -> float:
        level, at = self._buckets.get(tenant, (self.capacity, 0.0))
        return min(self.capacity, level + (self.clock() - at) * self.rate)
