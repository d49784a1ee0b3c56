"""Where an admitted sequence's KV will come from: device prefix, the tier, or compute.

`plan_admission` finds the device prefix, then asks the tier (`match`) to continue the
chain in host memory and below, with the planner's verdict per sequence; where the chain
stops, a cache breakpoint's part of the next block may end it exactly at the breakpoint.
Where the prefix goes on below host (disk, remote), the tier fetches it up to host first
(the match says FETCHING); the request is planned again once the fetch lands. None: the
tier's answer is pending (ask next step). Pure bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.kv_cache import CachedPrefix, KVCacheManager
from kvtier.sequence import Sequence
from kvtier.tier import NO_MATCH, BlockKey, Match, Residency, is_swap_key

if TYPE_CHECKING:
    from kvtier.engine.engine_tier import EngineTier


@dataclass(frozen=True)
class AdmissionPlan:
    prefix: CachedPrefix  # device blocks to share
    start: int  # tokens with KV once any load lands; compute starts here
    match: Match = NO_MATCH  # what the tier has beyond the device prefix
    declined_tokens: int = 0  # found below the device, but computed again
    swap_state_done: bool = False  # the swapped state is consumed (loaded, or given up)

    @property
    def load_keys(self) -> tuple[BlockKey, ...]:
        return self.match.load_keys

    @property
    def restored_tokens(self) -> int:
        return self.match.restored_tokens

    @property
    def content_keys(self) -> list[BlockKey]:
        """Loaded keys that name full blocks (a swapped partial block is not shareable, nor
        a breakpoint's part of a block: the request writes the rest of it)."""
        return [k for k in self.match.full_keys if not is_swap_key(k)]

    @property
    def residency(self) -> Residency:
        source = self.match.source  # the tier's medium, if it restores anything
        if source is not None:
            return Residency.from_medium(source)
        if self.prefix.num_tokens:
            return Residency.RESIDENT
        return Residency.RECOMPUTED if self.declined_tokens else Residency.NEW


def plan_admission(seq: Sequence, kv: KVCacheManager, namespace: BlockKey,
                   tier: EngineTier, block_size: int, compute_ahead: int = 0
                   ) -> AdmissionPlan | None:
    """`compute_ahead`: prompt tokens admitted before `seq` and not yet computed."""
    prefix = kv.find_cached_prefix(namespace, seq.token_ids)
    d = len(prefix.block_ids)
    swapped = seq.swapped
    parent: BlockKey | None = None  # a swapped sequence's own state has no breakpoint parts
    tail: list[int] = []
    if swapped is not None:
        keys, tokens = swapped.keys[d:], swapped.tokens[d:]
    else:
        keys, tokens = prefix.keys[d:], prefix.chunks[d:]
        parent = prefix.keys[d - 1] if d else namespace
        tail = seq.token_ids[len(prefix.keys) * block_size : seq.num_tokens - 1]
    match = tier.match(seq.request_id, keys, tokens, preempted=swapped is not None,
                       compute_ahead=compute_ahead, parent=parent, tail=tail)
    if match is None:
        return None
    done = swapped is not None
    if match.fetching:  # the tier is bringing the prefix up from below host
        return AdmissionPlan(prefix, prefix.num_tokens, match)
    if match.load_keys:
        return AdmissionPlan(prefix, prefix.num_tokens + match.restored_tokens, match,
                             match.declined_tokens, swap_state_done=done)
    lost = max(0, swapped.num_computed - prefix.num_tokens) if swapped is not None else 0
    return AdmissionPlan(prefix, prefix.num_tokens, match, lost + match.declined_tokens,
                         swap_state_done=done)


