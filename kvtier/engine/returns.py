"""Sessions a client said will come back (`kv_expect_return_s`): from shortly before the
client returns until it does, the session's prefix is checked every RECHECK_S and whatever of
it went below host meanwhile is staged back up (a burst of other traffic right before the
return can push it down again)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

LEAD_S = 1.0  # watched from this long before the expected return (at most half the gap)
RECHECK_S = 0.25  # how often a watched session is checked
LATE_SHARE = 0.5  # a session late by up to this share of its gap (<= MAX_LATE_S) is watched
MAX_LATE_S = 60.0
MAX_PENDING = 10_000  # hints kept at once; past this the soonest-due ones are kept


@dataclass(order=True)
class ExpectedReturn:
    """One session's prefix, due for staging at `due` (monotonic seconds)."""

    due: float
    order: int
    until: float = field(compare=False)  # the expected return, and some: watched no longer
    salt: str = field(compare=False)
    token_ids: tuple[int, ...] = field(compare=False)


class ExpectedReturns:
    """The hints not yet due, soonest first."""

    def __init__(self) -> None:
        self._heap: list[ExpectedReturn] = []
        self._order = itertools.count()
        self.dropped = 0  # hints not kept (MAX_PENDING reached)

    def add(self, now: float, after_s: float, salt: str, token_ids: Sequence[int]) -> None:
        """The session of `token_ids` (under `salt`) comes back `after_s` from `now`."""
        due = now + max(after_s - LEAD_S, after_s / 2)
        until = now + after_s + min(LATE_SHARE * after_s, MAX_LATE_S)
        self._push(ExpectedReturn(due, next(self._order), until, salt, tuple(token_ids)))

    def again(self, hint: ExpectedReturn, now: float, after_s: float = RECHECK_S) -> None:
        """Check `hint` again `after_s` from now, unless its session is due back by then."""
        if now + after_s < hint.until:
            self._push(ExpectedReturn(now + after_s, next(self._order), hint.until, hint.salt,
                                      hint.token_ids))

    def _push(self, hint: ExpectedReturn) -> None:
        heapq.heappush(self._heap, hint)
        if len(self._heap) > MAX_PENDING:
            self._heap = heapq.nsmallest(MAX_PENDING, self._heap)
            self.dropped += 1

    def due(self, now: float) -> list[ExpectedReturn]:
        """The hints whose time has come, taken out."""
        out = []
        while self._heap and self._heap[0].due <= now:
            out.append(heapq.heappop(self._heap))
        return out

    def __len__(self) -> int:
        return len(self._heap)
