"""Sessions a client said will come back (`kv_expect_return_s`, vLLM's
`kvtier_expect_return_s`): from shortly before the return until a little after it, the
session's prefix is checked every RECHECK_S and whatever of it went below host meanwhile is
fetched back up (a burst of other traffic right before the return can push it down again).
The same for every client: it calls `TierManager.stage_returns(now)` on each step.

A staging's fetch runs under its own id (`expect-<request>`); its FetchDone is the manager's
to consume, and a request whose prefix is still being staged is told to ask again next step
(`arriving`) rather than find those blocks busy.

Bounded for a shared server: each tenant keeps at most MAX_PENDING_PER_TENANT hints (past
it, or past MAX_PENDING in all, a new one is refused "full": before, the soonest-due 10,000
were kept, so one tenant's flood of hints dropped another's, and each new hint cost 41-70 ms
of re-selection), a step checks at most MAX_CHECKS_PER_STEP due hints (the rest wait a
step), and a staging is a prefetch of its tenant's, within its prefetch budget.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.tier.books.tenancy import Grant, Refusal
from kvtier.tier.keys import BlockKey
from kvtier.tier.match import Prefetch

LEAD_S = 1.0  # watched from this long before the expected return (at most half the gap)
RECHECK_S = 0.25  # how often a watched session is checked
RETRY_S = 0.05  # a store's presence answer pending: asked again this soon
LATE_SHARE = 0.5  # a session late by up to this share of its gap (<= MAX_LATE_S) is watched
MAX_LATE_S = 60.0
MAX_EXPECT_RETURN_S = 86400.0  # a session expected back later than a day is not staged
MAX_PENDING = 10_000  # hints kept at once, all tenants; past this a new one is refused
MAX_PENDING_PER_TENANT = 1_000  # one tenant's hints kept at once
MAX_CHECKS_PER_STEP = 64  # due hints checked in one step; the rest wait for the next

Stage = Callable[[str, Sequence[BlockKey], Sequence[Sequence[int]], str], Prefetch | None]


@dataclass(order=True)
class ExpectedReturn:
    """One session's prefix, next checked at `due` (monotonic seconds)."""

    due: float
    order: int
    until: float = field(compare=False)  # the expected return, and some: watched no longer
    fetch_id: str = field(compare=False)
    keys: tuple[BlockKey, ...] = field(compare=False)
    chunks: tuple[tuple[int, ...], ...] = field(compare=False)
    tenant: str = field(default="", compare=False)


class ExpectedReturns:
    """The sessions watched, soonest first, and the stagings in flight."""

    def __init__(self) -> None:
        self._heap: list[ExpectedReturn] = []
        self._order = itertools.count()
        self.staging: dict[str, frozenset[BlockKey]] = {}  # fetch id -> keys, until it lands
        self._per_tenant: Counter[str] = Counter()  # hints kept, by tenant

    def expect(self, request_id: str, keys: Sequence[BlockKey],
               chunks: Sequence[Sequence[int]], after_s: float, now: float,
               tenant: str = "") -> Grant:
        """`request_id`'s session (its full blocks `keys`, covering `chunks`, `tenant`'s)
        comes back `after_s` from `now` (checked by the caller: finite, > 0)."""
        if after_s > MAX_EXPECT_RETURN_S:
            return Grant(refused=Refusal.OVER_MAX)
        if not keys:
            return Grant(refused=Refusal.NOT_STORED)
        if (len(self._heap) >= MAX_PENDING
                or self._per_tenant[tenant] >= MAX_PENDING_PER_TENANT):
            return Grant(refused=Refusal.FULL)
        due = now + max(after_s - LEAD_S, after_s / 2)
        until = now + after_s + min(LATE_SHARE * after_s, MAX_LATE_S)
        self._per_tenant[tenant] += 1
        heapq.heappush(self._heap, ExpectedReturn(
            due, next(self._order), until, f"expect-{request_id}", tuple(keys),
            tuple(tuple(c) for c in chunks), tenant))
        return Grant(after_s, blocks=len(keys))

    def stage(self, now: float, prefetch: Stage) -> None:
        """Check the sessions due: `prefetch` brings what of each went below host up (None:
        a store's answer pending); each is checked again until its return."""
        for _ in range(MAX_CHECKS_PER_STEP):
            if not self._heap or self._heap[0].due > now:
                return
            hint = heapq.heappop(self._heap)
            if hint.fetch_id in self.staging:  # the last check's fetch has not landed
                self._again(hint, now, RECHECK_S)
                continue
            found = prefetch(hint.fetch_id, hint.keys, hint.chunks, hint.tenant)
            if found is not None and found.fetching_blocks:
                self.staging[hint.fetch_id] = frozenset(hint.keys)
            self._again(hint, now, RETRY_S if found is None else RECHECK_S)

    def landed(self, fetch_id: str) -> bool:
        """A FetchDone for `fetch_id`: whether it was a staging (now forgotten)."""
        return self.staging.pop(fetch_id, None) is not None

    def arriving(self, keys: Sequence[BlockKey]) -> bool:
        """Whether a staging in flight brings up one of `keys`."""
        return bool(self.staging) and any(k in staged for staged in self.staging.values()
                                           for k in keys)

    def _again(self, hint: ExpectedReturn, now: float, after_s: float) -> None:
        """Check `hint` again `after_s` from now, unless its watch ends by then."""
        if now + after_s < hint.until:
            heapq.heappush(self._heap, ExpectedReturn(
                now + after_s, next(self._order), hint.until, hint.fetch_id, hint.keys,
                hint.chunks, hint.tenant))
            return
        self._per_tenant[hint.tenant] -= 1
        if not self._per_tenant[hint.tenant]:
            del self._per_tenant[hint.tenant]

    def __len__(self) -> int:
        return len(self._heap)
