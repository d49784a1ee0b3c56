"""What the tier answers a request's lookup: the blocks to load and where they came from."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.planner import Decision


@dataclass(frozen=True)
class Match:
    """Where the blocks after the device prefix can come from, for one request."""

    load_keys: tuple[BlockKey, ...] = ()  # host blocks to load, in order
    restored_tokens: int = 0  # tokens those blocks cover
    declined_tokens: int = 0  # found (host or below) but the planner chose to recompute
    decision: Decision | None = None
    fetched_from: Medium | None = None  # a fetch brought (some of) these blocks up to host
    fetching: bool = False  # not yet: a fetch below host is on its way (ask again after it)

    @property
    def residency(self) -> Medium | None:
        """Where the restored state came from, if any is restored."""
        if not self.load_keys:
            return None
        return self.fetched_from or Medium.HOST


NO_MATCH = Match()
FETCHING = Match(fetching=True)
