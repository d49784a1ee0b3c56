"""Which of vLLM's KV cache groups kvtier's connector can serve, decided at start by name.

Served: full attention (`FullAttentionSpec`, also with `sliding_window` or
`attention_chunk_size` set: that is how vLLM keeps a mixed model's window layers with its
hybrid allocator off, every block kept, so it is served like full attention) and
sliding-window attention (`SlidingWindowSpec`: vLLM drops a request's blocks once they leave
the window, so kvtier stores and restores only the window, `Window`), one group or several
(vLLM's hybrid allocator: each group its own block table over one pool whose per-layer
tensors the groups share, so every group's block has the same shape). Everything else stops
vLLM at start with a message naming what was found, never served half: the kinds of KV kvtier
does not lay out (MLA's latent KV, Mamba state, cross-attention), and groups whose blocks
differ in shape. Pure Python over vLLM's objects' attributes: no vLLM import, so it is tested
without vLLM.
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
    """A KV cache group kvtier serves, and its window (None: every block is kept)."""

    group: Any
    window: Window | None = None

    @property
    def describe(self) -> str:
        """What the fingerprint names of it: its kind, how its blocks are kept, its layers."""
        w = self.window
        kept = "all" if w is None else f"window={w.tokens}+{w.extra_retained}"
        kind = type(self.group.kv_cache_spec).__name__
        return f"{kind}:{kept}:{','.join(self.group.layer_names)}"


def servable_groups(groups: Sequence[Any] | None) -> tuple[ServedGroup, ...]:
    """The KV cache groups kvtier serves; ConfigError naming what vLLM planned otherwise."""
    if not groups:
        raise ConfigError("vLLM planned no KV cache groups; kvtier's connector has nothing to "
                          "serve")
    served = tuple(_served(g) for g in groups)
    shapes = {_block_shape(g.kv_cache_spec) for g in groups}
    if len(shapes) != 1:
        raise ConfigError(
            f"kvtier's connector serves KV cache groups whose blocks have one shape; this "
            f"model's groups have {len(shapes)} ({'; '.join(map(str, sorted(shapes, key=str)))}): "
            f"start vLLM with --disable-hybrid-kv-cache-manager, or {RUN_WITHOUT}")
    return served


def _block_shape(spec: Any) -> tuple[Any, ...]:
    """(block size, KV heads, head sizes, dtype): what one block of one layer holds."""
    return (int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size),
            int(getattr(spec, "head_size_v", None) or spec.head_size), str(spec.dtype))


def _served(group: Any) -> ServedGroup:
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    if kind not in SERVED:
        held = f" ({KNOWN[kind]})" if kind in KNOWN else ""
        raise ConfigError(f"kvtier's connector serves full and sliding-window attention; "
                          f"this model's KV cache group of {len(group.layer_names)} layer(s) "
                          f"({', '.join(group.layer_names[:3])}) is {kind}{held}; "
                          f"{RUN_WITHOUT}")
    if kind == FULL:
        return ServedGroup(group)
    tokens = int(spec.sliding_window)
    if tokens < 1:
        raise ConfigError(f"vLLM planned a sliding window of {tokens} tokens; kvtier serves "
                          f"windows of at least one token; {RUN_WITHOUT}")
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return ServedGroup(group, Window(tokens, extra, int(spec.block_size)))


def where_expected(block_ids: Sequence[Sequence[int]], d: int,
                   need: Sequence[tuple[int, int]]) -> bool:
    """Whether vLLM allocated real blocks for all of `need` ((group, block) after its own hit
    of `d` blocks), and its null block for the window blocks before them that a hit skips."""
    if any(not block_ids[g][i] for g, i in need):
        return False
    firsts: dict[int, int] = {}
    for g, i in need:
        firsts[g] = min(firsts.get(g, i), i)
    return all(not any(block_ids[g][d:first]) for g, first in firsts.items())
