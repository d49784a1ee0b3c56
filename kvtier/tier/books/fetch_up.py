"""What of a prefix comes back and how, decided in one call (`FetchUp.plan`): of what the
tiers hold after the device's prefix (leading blocks in host memory, then blocks below host),
how many blocks come up from which tier within the deadline's cap at the predicted rate,
whether that fetch beats recomputing them given what it would queue behind, and otherwise
whether the host's blocks are loaded or recomputed, each recompute with its reason; and a
client's prefetch, bounded the same way and by the host's room."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.prefetch_budget import PrefetchBudget
from kvtier.tier.config import TierConfig
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.load_policy import Ahead, Decline, LoadPolicy
from kvtier.tier.match import Prefetch
from kvtier.tier.planner import Decision, Planner

AheadOf = Callable[[str | None], Ahead]  # what a load (None) or a fetch from a tier queues behind


@dataclass(frozen=True)
class FetchPlan:
    """The whole verdict on a prefix found after the device's, for one request."""

    fetch: int = 0  # blocks below host to bring up first (the request asks again after)
    via: Medium | None = None  # the deepest tier the fetch reads from
    # tokens found but recomputed, and why: past the deadline's cap, or a fetch not worth it
    declined: tuple[tuple[Decline, int], ...] = ()
    load: bool = False  # when nothing is fetched: the host's blocks are loaded now
    decision: Decision | None = None  # the host load's verdict, scored against the load
    load_declined: Decline | None = None  # why the host's blocks are recomputed instead


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

    def plan(self, host_blocks: int, host_tokens: int, below: Sequence[Medium],
             ahead: AheadOf, preempted: bool = False) -> FetchPlan:
        """The verdict on a prefix whose first `host_blocks` blocks (`host_tokens` tokens)
        are in host memory and whose next blocks lie below host on `below`: fetch the
        leading ones the deadline's cap allows if reading them beats recomputing them (what
        the fetch and then the load would queue behind counted); else load or recompute the
        host's blocks. A preempted request's own state was already judged worth its swap."""
        declined: list[tuple[Decline, int]] = []
        n = self.within_deadline(below)
        if len(below) > n:
            declined.append((Decline.DEADLINE, (len(below) - n) * self.block_size))
        if n:
            via = self.below.deepest(below[:n])
            _, reason = self.load_policy.decide(
                self.planner, n * self.block_size, n * self.block_bytes, ahead(via.value),
                via.value, via_nbytes=n * self.below.block_bytes)
            if reason is None:
                return FetchPlan(n, via, tuple(declined))
            declined.append((reason, n * self.block_size))
        if host_blocks == 0:
            return FetchPlan(declined=tuple(declined))
        nbytes = host_blocks * self.block_bytes
        if preempted:
            return FetchPlan(declined=tuple(declined), load=True,
                             decision=self.planner.decide(host_tokens, nbytes, "swap"))
        decision, reason = self.load_policy.decide(self.planner, host_tokens, nbytes,
                                                   ahead(None))
        return FetchPlan(declined=tuple(declined), load=reason is None, decision=decision,
                         load_declined=reason)

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
