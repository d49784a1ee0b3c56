"""The scheduler side's per-request state, and the one step of a request vLLM schedules."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.integrations.kit.wake_timeline import WakeTimeline
from kvtier.tier import NO_MATCH, BlockKey, Match


@dataclass(frozen=True)
class Scheduled:
    """One request in this step: its blocks so far (one list per KV cache group) and tokens
    computed once it has run."""

    request_id: str
    block_ids: Sequence[Sequence[int]]
    computed_after: int


def group_key(key: BlockKey, tag: bytes) -> BlockKey:
    """Block `key`'s name in one KV cache group ("" for a model with one group: its key)."""
    return key if not tag else hashlib.blake2b(key + tag, digest_size=16).digest()


@dataclass
class RequestState:
    """The connector's own state of one request: its token chain and keys, what the last
    lookup offered vLLM, and what was stored and restored for it."""

    tokens: Sequence[int]  # the live token ids (prompt and output so far)
    namespace: BlockKey
    prompt_len: int  # a window group stores the window before the prompt's hit boundary
    tenant: str = ""  # whose its stored blocks are (vLLM: its cache_salt)
    keys: list[BlockKey] = field(default_factory=list)  # the chain, group-free
    group_keys: list[list[BlockKey]] = field(default_factory=list)  # per group, as far
    stored: int = 0  # leading full blocks handed to the tier (stored, or loaded from it)
    match: Match = NO_MATCH
    local_blocks: int = 0  # vLLM's own prefix hit when `match` was made
    need: list[tuple[int, int]] = field(default_factory=list)  # (group, block) `match` loads
    offered: int = 0  # tokens `match` let vLLM skip computing (from its own hit on)
    load_async: bool = False  # `match`'s load runs beside the steps of others (vLLM waits)
    load_failed: bool = False  # a load of ours failed: never offered again (vLLM would ask
    # again after an asynchronous one, and a load that keeps failing would loop forever)
    looked_up: int = 0  # tokens after vLLM's own prefix hit that the last lookup asked for
    counted: bool = False  # its lookup is in the counters (once, however often vLLM asks)
    restored: int = 0  # tokens vLLM skipped computing because a load of ours landed
    computed: int = 0  # tokens vLLM had computed once admitted (its last step's count)
    stale: bool = False  # alive at a cache reset: its KV may be the old weights'
    timeline: WakeTimeline = field(default_factory=WakeTimeline.start)  # from the first ask
