"""Sessions a client said will come back (`kv_expect_return_s`): when each is due, shortly
before the client returns, its prefix is staged up into host memory if it went below."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

LEAD_S = 1.0  # staged this long before the expected return (at most half the gap)
MAX_PENDING = 10_000  # hints kept at once; past this the soonest-due ones are kept


@dataclass(order=True)
class ExpectedReturn:
    """One session's prefix, due for staging at `due` (monotonic seconds)."""

    due: float
    order: int
    salt: str = field(compare=False)
    token_ids: tuple[int, ...] = field(compare=False)


class ExpectedReturns:
    """The hints not yet due, soonest first."""

    def __init__(self) -> None:
        self._heap: list[ExpectedReturn] = []
        self._order = itertools.count()
        self.dropped = 0  # hints not kept (MAX_PENDING reached)

    def add(self, now: float, after_s: float, salt: str, token_ids: list[int]) -> None:
        """The session of `token_ids` (under `salt`) comes back `after_s` from `now`."""
        due = now + max(after_s - LEAD_S, after_s / 2)
        heapq.heappush(self._heap, ExpectedReturn(due, next(self._order), salt,
                                                  tuple(token_ids)))
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
