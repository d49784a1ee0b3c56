"""What the tier answers a request's lookup (the blocks to load and where they came from),
and a prefetch (what it found, and what it is bringing up)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.load_policy import Decline
from kvtier.tier.planner import Decision


@dataclass(frozen=True)
class Match:
    """Where the blocks after the device prefix can come from, for one request."""

    load_keys: tuple[BlockKey, ...] = ()  # host blocks to load, in order
    restored_tokens: int = 0  # tokens those blocks cover
    decision: Decision | None = None
    fetched_from: Medium | None = None  # a fetch brought (some of) these blocks up to host
    fetching: bool = False  # not yet: a fetch below host is on its way (ask again after it)
    # tokens found (host or below) but recomputed, by reason
    declined_by: tuple[tuple[Decline, int], ...] = ()
    # the last load key holds part of a block (the tokens before a cache breakpoint inside
    # it): loaded into a block of the request's own, never shared as a full block
    partial: bool = False

    @property
    def declined_tokens(self) -> int:
        return sum(n for _, n in self.declined_by)

    @property
    def full_keys(self) -> tuple[BlockKey, ...]:
        """The loaded keys that name full blocks (what a block table may chain on)."""
        return self.load_keys[:-1] if self.partial else self.load_keys

    @property
    def source(self) -> Medium | None:
        """The medium the restored state comes from, if any is restored."""
        if not self.load_keys:
            return None
        return self.fetched_from or Medium.HOST


@dataclass(frozen=True)
class Prefetch:
    """What a prefetch found of a prefix expected back: blocks already on host, and blocks
    on their way up to host from the stores below (`media`, nearest first)."""

    host_blocks: int = 0
    fetching_blocks: int = 0
    media: tuple[Medium, ...] = ()
    limited: int = 0  # blocks below host left there: over the tenant's prefetch budget


NO_MATCH = Match()
FETCHING = Match(fetching=True)


def declines(*parts: tuple[Decline, int] | Counter[Decline]) -> tuple[tuple[Decline, int], ...]:
    """`Match.declined_by` from counters and (reason, tokens) pairs, added up per reason."""
    total: Counter[Decline] = Counter()
    for part in parts:
        total.update(part if isinstance(part, Counter) else {part[0]: part[1]})
    return tuple((r, n) for r, n in total.items() if n)
