"""vLLM's side of kvtier's KV events (`events.py`): a block's identity read from the live
request, as vLLM's block pool puts it in its own GPU `BlockStored` (so a router matches kvtier's
copy to vLLM's), and `KVEvents` over vLLM's event classes, built only when vLLM publishes KV
events (`--kv-events-config` with `enable_kv_cache_events`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvtier.integrations.kit.events import BlockOrigin, KVEvents
from kvtier.tier import Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# The tiers kvtier publishes, by vLLM's names; the remote tier is shared by every instance on
# it, so none may claim its blocks as its own.
PUBLISHED = {Medium.HOST: MEDIUM_CPU, Medium.DISK: MEDIUM_STORAGE}


class RequestOrigins:
    """A live request's blocks as vLLM publishes them, by (request id, group, block index)."""

    def __init__(self, live: Callable[[str], Request | None], block_size: int,
                 hash_block_size: int, groups: Sequence[tuple[str, int | None]]) -> None:
        """`live`: the connector's requests still in vLLM's hands; `hash_block_size`: the
        tokens of each of `request.block_hashes` (vLLM's block size unless it hashes finer);
        `groups`: each KV cache group's kind and window, as vLLM's events name them."""
        self._live = live
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.groups = tuple(groups)

    def __call__(self, request_id: str, group: int, index: int) -> BlockOrigin | None:
        """Block `index` of the request in KV cache `group`; None when the request is gone or
        vLLM has no hash for that block."""
        request = self._live(request_id)
        if request is None or not 0 <= group < len(self.groups):
            return None
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                      self.block_size)
        start, end = index * self.block_size, (index + 1) * self.block_size
        if not 0 <= index < len(hashes) or end > len(request.all_token_ids):
            return None
        block_hash = hashes[index]
        parent = hashes[index - 1] if index else None
        if block_hash is None or (index and parent is None):
            return None
        extra, _ = generate_block_hash_extra_keys(request, start, end, 0)  # no multimodal
        lora = request.lora_request
        kind, window = self.groups[group]
        return BlockOrigin(
            block_hash=maybe_convert_block_hash(block_hash),
            parent_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=tuple(request.all_token_ids[start:end]), group_idx=group,
            spec_kind=kind, sliding_window=window,
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=(to_event_extra_keys([extra]) or [None])[0],
            session_id=request.session_id)


def kv_events(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
              live: Callable[[str], Request | None], block_size: int) -> KVEvents | None:
    """The scheduler's translator of kvtier's residency into vLLM's KV events; None when vLLM
    publishes none (then nothing is recorded at all)."""
    config = vllm_config.kv_events_config
    if config is None or not config.enable_kv_cache_events:
        return None
    hash_block_size = int(kv_cache_config.hash_block_size or block_size)
    groups = [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
               get_kv_cache_spec_sliding_window(g.kv_cache_spec))
              for g in kv_cache_config.kv_cache_groups]
    return KVEvents(RequestOrigins(live, block_size, hash_block_size, groups), block_size,
                    PUBLISHED, BlockStored, BlockRemoved, AllBlocksCleared)
