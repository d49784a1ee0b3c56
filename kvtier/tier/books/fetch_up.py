"""What of a prefix below host comes up into host, and whether: for a waiting request (if
reading it beats recomputing it, given what the load would queue behind) or for a client's
prefetch, always within the deadline's cap at the predicted rate and the host's room."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.prefetch_budget import PrefetchBudget
from kvtier.tier.books.state import RequestState
from kvtier.tier.config import TierConfig
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.load_policy import Ahead, Decline, LoadPolicy
from kvtier.tier.match import Prefetch
from kvtier.tier.planner import Planner

AheadOf = Callable[[str], Ahead]  # what a fetch from the tier named would queue behind


class FetchUp:
    """The manager's fetches from the tiers below host, over its planner and those tiers."""

    def __init__(self, config: TierConfig, planner: Planner, below: BelowHost,
                 load_policy: LoadPolicy, block_size: int, block_bytes: int,
                 budget: PrefetchBudget) -> None:
        self.config, self.planner, self.below = config, planner, below
        self.load_policy = load_policy
        self.budget = budget  # what each tenant's prefetches may still bring up
        self.block_size = block_size
        self.block_bytes = block_bytes  # bytes of one block across the host link

    def for_request(self, request_id: str, state: RequestState, keys: Sequence[BlockKey],
                    tokens: Sequence[Sequence[int]], media: list[Medium], ahead: AheadOf
                    ) -> bool:
        """Start bringing the leading `media` blocks up to host if reading them beats
        recomputing them; False if not worth it or the host has no room (those tokens are
        then recomputed, and counted so when the request is admitted)."""
        n = self.within_deadline(media)
        state.declined[Decline.DEADLINE] += (len(media) - n) * self.block_size
        if n == 0:
            return False
        via = self.below.deepest(media[:n]).value
        _, reason = self.load_policy.decide(self.planner, n * self.block_size,
                                            n * self.block_bytes, ahead(via), via,
                                            via_nbytes=n * self.below.block_bytes)
        if reason is not None:
            state.declined[reason] += n * self.block_size
            return False
        if self.start(request_id, keys[:n], tokens[:n], media[:n]):
            state.fetching = True
            return True
        state.declined[Decline.NO_ROOM] += n * self.block_size
        return False

    def prefetch(self, request_id: str, keys: Sequence[BlockKey],
                 tokens: Sequence[Sequence[int]], hits: int, tenant: str = ""
                 ) -> Prefetch | None:
        """Bring what of the prefix lies below host (after the host's `hits`) up now, no
        restore decision yet, if `tenant`'s prefetch budget allows (else it is all `limited`,
        counted for the tenant). None: a store's answer is pending."""
        if hits == len(keys) or not self.below:
            return Prefetch(hits)
        media = self.below.hits(keys[hits:], tokens[hits:], self.planner.slow_tiers())
        if media is None:
            return None
        n = self.within_deadline(media)
        limited = 0 if self.budget.allows(tenant) else n
        n -= limited
        counts = self.below.host.tenancy.counts_of(tenant)
        counts.prefetch_limited += limited
        if n and self.start(request_id, keys[hits:hits + n], tokens[hits:hits + n],
                            media[:n]):
            self.budget.spend(tenant, n)
            counts.prefetched += n
            return Prefetch(hits, n, tuple(dict.fromkeys(media[:n])), limited)
        return Prefetch(hits, limited=limited)

    def within_deadline(self, media: Sequence[Medium]) -> int:
        """How many of the leading blocks on `media` one fetch brings within the deadline's
        cap at the predicted rate (the rest is recomputed)."""
        return min(len(media), self.planner.blocks_within(
            self.below.deepest(media).value, self.below.block_bytes,
            self.config.fetch_deadline_s)) if media else 0

    def start(self, request_id: str, keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], media: Sequence[Medium]) -> bool:
        """Start bringing `keys` (on `media`) up into host for `request_id`, its deadline
        from the planner's prediction; False if the host had no room."""
        via = self.below.deepest(media).value
        return self.below.fetch(request_id, keys, tokens, media,
                                lambda k: self.planner.fetch_s(via, k * self.below.block_bytes),
                                self.config.fetch_deadline_s)
