"""What a client asks of its request's KV beyond the request, through an engine's per-request
params (vLLM's `kv_transfer_params`), answered in the params the request ends with:

  kvtier_retention_s: N        keep its full blocks N seconds (-> N granted, or
                               "refused:<reason>": invalid, disabled, over_max, quota, full,
                               not_stored)
  kvtier_expect_return_s: N    the session comes back after about N seconds: its prefix is
                               staged up into host shortly before (-> N, or "refused:...")

A value no client means (negative, zero, NaN, infinite, a bool, a string) is refused
("refused:invalid") and the request is served anyway. Staging happens in the engine's step:
an engine that steps only when it has work (vLLM) stages a due hint at its next step.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tier import BlockKey, TierManager

log = logging.getLogger(__name__)

RETENTION = "kvtier_retention_s"
EXPECT_RETURN = "kvtier_expect_return_s"
INVALID = "refused:invalid"
OVER_MAX = "refused:over_max"
NOT_STORED = "refused:not_stored"
LEAD_S = 1.0  # staged this long before the expected return (at most half the gap)
MAX_EXPECT_RETURN_S = 86400.0  # a session expected back later than a day is not staged
MAX_PENDING = 10_000  # hints kept at once; past this the soonest-due ones are kept


def seconds(value: object) -> float | None:
    """`value` as seconds a client can mean (a finite number > 0, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


@dataclass(order=True)
class _Return:
    """One session's prefix, due for staging at `due` (monotonic seconds)."""

    due: float
    order: int
    fetch_id: str = field(compare=False)
    keys: tuple[BlockKey, ...] = field(compare=False)
    chunks: tuple[tuple[int, ...], ...] = field(compare=False)


class KvHints:
    """Retention asked at a request's end, and expect-return hints staged when due, over
    one `TierManager`."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self._returns: list[_Return] = []  # a heap, soonest first
        self._order = itertools.count()
        self.staging: dict[str, frozenset[BlockKey]] = {}  # fetch id -> keys, until it lands
        self._warned: set[str] = set()  # the asks a bad value was logged for (once each)

    def answer(self, request_id: str, asks: Mapping[str, Any] | None, tenant: str,
               keys: Sequence[BlockKey], chunks: Sequence[Sequence[int]],
               now: float) -> dict[str, Any]:
        """The answers to a finished request's asks; `keys` (covering `chunks`) are its full
        blocks, handed to the tier already (stored, or still storing)."""
        if not isinstance(asks, Mapping):
            return {}
        out: dict[str, Any] = {}
        if RETENTION in asks:
            s = self._checked(RETENTION, asks[RETENTION])
            out[RETENTION] = (INVALID if s is None
                              else self.manager.retain(keys, tenant, s).value)
        if EXPECT_RETURN in asks:
            s = self._checked(EXPECT_RETURN, asks[EXPECT_RETURN])
            out[EXPECT_RETURN] = (INVALID if s is None else OVER_MAX if s > MAX_EXPECT_RETURN_S
                                  else NOT_STORED if not keys
                                  else self._expect(request_id, s, keys, chunks, now))
        return out

    def _checked(self, name: str, value: object) -> float | None:
        s = seconds(value)
        if s is None and name not in self._warned:
            self._warned.add(name)
            log.warning("kvtier: %s=%r in kv_transfer_params is not a finite number of seconds "
                        "> 0; answered %r (logged once)", name, value, INVALID)
        return s

    def _expect(self, request_id: str, after_s: float, keys: Sequence[BlockKey],
                chunks: Sequence[Sequence[int]], now: float) -> float:
        due = now + max(after_s - LEAD_S, after_s / 2)
        heapq.heappush(self._returns, _Return(
            due, next(self._order), f"expect-{request_id}", tuple(keys),
            tuple(tuple(c) for c in chunks)))
        if len(self._returns) > MAX_PENDING:
            self._returns = heapq.nsmallest(MAX_PENDING, self._returns)
        return after_s

    def stage(self, now: float) -> None:
        """Bring the due hints' prefixes up into host (a store's presence answer not in yet:
        asked again next step; a fetch for the same id still in flight: after it lands)."""
        retry = []
        while self._returns and self._returns[0].due <= now:
            hint = heapq.heappop(self._returns)
            if hint.fetch_id in self.staging:
                retry.append(hint)
                continue
            found = self.manager.prefetch(hint.fetch_id, hint.keys, hint.chunks)
            if found is None:
                retry.append(hint)
            elif found.fetching_blocks:  # its FetchDone comes back in a later step
                self.staging[hint.fetch_id] = frozenset(hint.keys)
            else:
                self.manager.finished(hint.fetch_id)
        for hint in retry:
            heapq.heappush(self._returns, hint)

    def landed(self, fetch_id: str) -> bool:
        """A FetchDone for `fetch_id`: whether it was a staging of ours (now forgotten)."""
        if fetch_id not in self.staging:
            return False
        del self.staging[fetch_id]
        self.manager.finished(fetch_id)
        return True

    def arriving(self, keys: Sequence[BlockKey]) -> bool:
        """Whether a staging in flight brings up one of `keys`: the session is back before
        its staging landed, and asks again next step rather than find those blocks busy."""
        return any(k in staged for staged in self.staging.values() for k in keys)

    def __len__(self) -> int:
        return len(self._returns)
