"""Where an admitted sequence's KV will come from: device prefix, host tier, or compute.

`plan_admission` continues the device prefix lookup into the host tier and asks the planner
whether loading the host blocks beats recomputing them, per sequence. Where the prefix goes
on below host (disk, remote), the plan is a fetch up to host first; the request is planned
again once the fetch lands. Pure bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.cache.block import BlockKey
from kvtier.cache.kv_cache import CachedPrefix, KVCacheManager
from kvtier.offload import SWAP_PREFIX, HostOffload
from kvtier.planner import Decision
from kvtier.sequence import Sequence, SwapState


@dataclass(frozen=True)
class AdmissionPlan:
    prefix: CachedPrefix  # device blocks to share
    start: int  # tokens with KV once any load lands; compute starts here
    load_keys: list[BlockKey] = field(default_factory=list)  # host blocks to load, in order
    restored_tokens: int = 0
    declined_tokens: int = 0  # on host, but the planner chose to recompute them
    decision: Decision | None = None
    swap_state_done: bool = False  # the swapped state is consumed (loaded, or given up)
    fetch_keys: list[BlockKey] = field(default_factory=list)  # below host: bring up first
    fetch_tokens: list[tuple[int, ...]] = field(default_factory=list)
    fetch_tiers: list[str] = field(default_factory=list)

    @property
    def content_keys(self) -> list[BlockKey]:
        """Loaded keys that name full blocks (a swapped partial block is not shareable)."""
        return [k for k in self.load_keys if not k.startswith(SWAP_PREFIX)]

    @property
    def residency(self) -> str:
        if self.load_keys:
            return "host"
        if self.prefix.num_tokens:
            return "resident"
        return "recomputed" if self.declined_tokens else "new"


def plan_admission(
    seq: Sequence, kv: KVCacheManager, namespace: BlockKey, offload: HostOffload | None,
    block_size: int,
) -> AdmissionPlan:
    prefix = kv.find_cached_prefix(namespace, seq.token_ids)
    if offload is None:
        return AdmissionPlan(prefix, prefix.num_tokens)
    d = len(prefix.block_ids)
    swapped = seq.swapped
    if swapped is not None:
        keys, tokens = swapped.keys[d:], swapped.tokens[d:]
    else:
        keys, tokens = prefix.keys[d:], prefix.chunks[d:]
    hits = offload.host_hits(keys, tokens)
    cap = offload.config.max_load_tokens
    if cap is not None:
        hits = min(hits, cap // block_size)
    fetch = _plan_fetch(seq, offload, keys[hits:], tokens[hits:], block_size, cap, hits)
    if fetch is not None:
        return AdmissionPlan(prefix, prefix.num_tokens, decision=fetch[0], fetch_keys=fetch[1],
                             fetch_tokens=fetch[2], fetch_tiers=fetch[3])
    plan = _plan_host(prefix, swapped, keys, hits, block_size, offload)
    # State below host that was declined, or failed to come up, is computed again too.
    extra = seq.deep_declined_tokens
    return replace(plan, declined_tokens=plan.declined_tokens + extra) if extra else plan


def _plan_host(prefix: CachedPrefix, swapped: SwapState | None, keys: list[BlockKey],
               hits: int, block_size: int, offload: HostOffload) -> AdmissionPlan:
    """Restore the `hits` leading host blocks, or recompute them, as the planner says."""
    d = len(prefix.block_ids)
    done = swapped is not None
    if hits == 0:
        lost = swapped.num_computed - prefix.num_tokens if swapped else 0
        return AdmissionPlan(prefix, prefix.num_tokens, declined_tokens=max(0, lost),
                             swap_state_done=done)
    whole = swapped is not None and d + hits == len(swapped.keys)
    restored = (swapped.num_computed if whole else (d + hits) * block_size) - prefix.num_tokens
    mode = "swap" if swapped is not None else "auto"  # a swap was already judged worth it
    decision = offload.planner.decide(restored, hits * offload.block_bytes, mode)
    if decision.choice == "recompute":
        return AdmissionPlan(prefix, prefix.num_tokens, declined_tokens=restored,
                             decision=decision, swap_state_done=done)
    return AdmissionPlan(prefix, prefix.num_tokens + restored, list(keys[:hits]), restored,
                         decision=decision, swap_state_done=done)


def _plan_fetch(seq: Sequence, offload: HostOffload, keys: list[BlockKey],
                tokens: list[tuple[int, ...]] | list[list[int]], block_size: int,
                cap: int | None, host_hits: int
                ) -> tuple[Decision, list[BlockKey], list[tuple[int, ...]], list[str]] | None:
    """Blocks of the prefix found below host that are worth bringing up, if any."""
    deep = offload.deep
    if deep is None or seq.swapped is not None or seq.deep_checked or not keys:
        return None
    seq.deep_checked = True
    tiers = deep.hits(keys, tokens)
    if cap is not None:
        tiers = tiers[: max(0, cap // block_size - host_hits)]
    if not tiers:
        return None
    n = len(tiers)
    via = "remote" if "remote" in tiers else "disk"
    decision = offload.planner.decide(n * block_size, n * offload.block_bytes, "auto", via,
                                      via_nbytes=n * deep.block_bytes)
    if decision.choice == "recompute":
        seq.deep_declined_tokens = n * block_size
        return None
    return decision, list(keys[:n]), [tuple(t) for t in tokens[:n]], tiers
