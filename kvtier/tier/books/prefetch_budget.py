"""How many blocks each tenant's prefetches may bring up into host: a token bucket per
tenant, so a prefetch (a client's hint, nothing computed) cannot be a free host flush.

Unbounded, one client made 266-365 prefetch calls a second, read up to 7,950 blocks from disk
and pushed another tenant's session from host down to disk. Each tenant may bring up at most
`share` of the host's slots at once (half), refilled over `window_s` (10 s): a session's
return is one prefetch, inside it; a loop of them is cut to that rate, and each block it
asked for past the rate is counted (the tenant's `prefetch_limited`), never fetched.
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

    def allowed(self, tenant: str) -> int:
        """Whole blocks `tenant` may prefetch now."""
        return int(self._level(tenant))

    def spend(self, tenant: str, blocks: int) -> None:
        """`blocks` of `tenant`'s prefetch started up."""
        self._buckets[tenant] = (max(0.0, self._level(tenant) - blocks), self.clock())
        self._buckets.move_to_end(tenant)
        while len(self._buckets) > MAX_BUCKETS:  # a full bucket says nothing: forget it
            self._buckets.popitem(last=False)

    def _level(self, tenant: str) -> float:
        level, at = self._buckets.get(tenant, (self.capacity, 0.0))
        return min(self.capacity, level + (self.clock() - at) * self.rate)
