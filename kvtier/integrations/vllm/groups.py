"""Which of vLLM's KV cache groups kvtier's connector can serve, decided at start by name.

One group is served: plain full attention (`FullAttentionSpec`, also with `sliding_window` or
`attention_chunk_size` set: that is how vLLM keeps a mixed model's window layers with its
hybrid allocator off, every block kept, so it is served like full attention), or sliding-window
attention (`SlidingWindowSpec`: vLLM drops a request's blocks once they leave the window, so
kvtier stores and restores only the window, `Window`). Everything else stops vLLM at start with
a message naming what was found, never served half: several groups (hybrid models under the
hybrid allocator), and the kinds of KV kvtier does not lay out (MLA's latent KV, Mamba state,
cross-attention). Pure Python over vLLM's objects' attributes: no vLLM import, so it is
tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

FULL = "FullAttentionSpec"  # exactly: its subclasses (MLA, sinks, ...) lay KV out otherwise
WINDOWED = "SlidingWindowSpec"  # exactly: SlidingWindowMLASpec is MLA
SERVED = (FULL, WINDOWED)
KNOWN = {  # what a refused kind holds, to say so
    "MLAAttentionSpec": "MLA's latent KV",
    "SlidingWindowMLASpec": "MLA's latent KV",
    "MambaSpec": "Mamba/SSM state",
    "CrossAttentionSpec": "cross-attention KV",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "ChunkedLocalAttentionSpec": "chunked local attention",
}
RUN_WITHOUT = "unset kv_transfer_config to serve this model without kvtier"


@dataclass(frozen=True)
class Window:
    """A sliding-window group's reach: the next token reads the last `tokens` tokens (and
    vLLM keeps `extra_retained` more), so a hit of n blocks needs only the blocks from
    `first_needed(n)` on; the ones before it are vLLM's null block."""

    tokens: int
    extra_retained: int = 0
    block_size: int = 1

    def first_needed(self, n_blocks: int) -> int:
        """The first block a request that has computed `n_blocks` whole blocks still reads
        (vLLM's `get_num_skipped_tokens`, in blocks)."""
        skipped = n_blocks * self.block_size - self.tokens + 1 - self.extra_retained
        return max(0, skipped) // self.block_size


@dataclass(frozen=True)
class ServedGroup:
    """The one KV cache group kvtier serves, and its window (None: every block is kept)."""

    group: Any
    window: Window | None = None

    @property
    def describe(self) -> str:
        """What the fingerprint names beyond the model's config: how blocks are kept."""
        w = self.window
        return "" if w is None else f"window={w.tokens}+{w.extra_retained}"


def servable_group(groups: Sequence[Any] | None) -> ServedGroup:
    """The one KV cache group kvtier serves; ConfigError naming what vLLM planned otherwise."""
    if not groups:
        raise ConfigError("vLLM planned no KV cache groups; kvtier's connector has nothing to "
                          "serve")
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier's connector serves models with one KV cache group for now; this one has "
            f"{len(groups)} ({', '.join(kinds)}) under vLLM's hybrid KV cache allocator: start "
            f"vLLM with --disable-hybrid-kv-cache-manager (kvtier then serves its window "
            f"layers as full attention), or {RUN_WITHOUT}")
    spec, kind = groups[0].kv_cache_spec, kinds[0]
    if kind not in SERVED:
        held = f" ({KNOWN[kind]})" if kind in KNOWN else ""
        raise ConfigError(f"kvtier's connector serves full and sliding-window attention; "
                          f"this model's KV is {kind}{held}; {RUN_WITHOUT}")
    if kind == FULL:
        return ServedGroup(groups[0])
    tokens = int(spec.sliding_window)
    if tokens < 1:
        raise ConfigError(f"vLLM planned a sliding window of {tokens} tokens; kvtier serves "
                          f"windows of at least one token; {RUN_WITHOUT}")
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return ServedGroup(groups[0], Window(tokens, extra, int(spec.block_size)))
