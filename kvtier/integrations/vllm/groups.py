"""Which of vLLM's KV cache groups kvtier's connector can serve, decided at start by name.

Plain full attention, one group, is served today. Everything else stops vLLM at start with a
message naming what was found, never served half: several groups (hybrid models under the
hybrid allocator), sliding windows (with the hybrid allocator off, vLLM keeps a mixed model's
window layers in one full-attention group with `sliding_window` set: that is refused too, so
turning the allocator off is no way round), and the kinds of KV kvtier does not lay out (MLA's
latent KV, Mamba state, cross-attention). Pure Python over vLLM's objects' attributes: no
vLLM import, so it is tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError

SERVED = "FullAttentionSpec"  # exactly: its subclasses (MLA, sinks, ...) lay KV out otherwise
KNOWN = {  # what a refused kind holds, to say so
    "MLAAttentionSpec": "MLA's latent KV",
    "MambaSpec": "Mamba/SSM state",
    "CrossAttentionSpec": "cross-attention KV",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SlidingWindowSpec": "sliding-window attention",
    "ChunkedLocalAttentionSpec": "chunked local attention",
}
RUN_WITHOUT = "unset kv_transfer_config to serve this model without kvtier"


def servable_group(groups: Sequence[Any] | None) -> Any:
    """The one KV cache group kvtier serves; ConfigError naming what vLLM planned otherwise."""
    if not groups:
        raise ConfigError("vLLM planned no KV cache groups; kvtier's connector has nothing to "
                          "serve")
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier's connector serves models with one KV cache group for now; this one has "
            f"{len(groups)} ({', '.join(kinds)}): hybrid and sliding-window models are not "
            f"supported yet; {RUN_WITHOUT}")
    spec, kind = groups[0].kv_cache_spec, kinds[0]
    if kind != SERVED:
        held = f" ({KNOWN[kind]})" if kind in KNOWN else ""
        raise ConfigError(f"kvtier's connector serves plain full attention ({SERVED}) for now; "
                          f"this model's KV is {kind}{held}; {RUN_WITHOUT}")
    for name in ("sliding_window", "attention_chunk_size"):
        value = getattr(spec, name, None)
        if value:
            raise ConfigError(f"kvtier's connector does not serve windowed attention yet "
                              f"({name}={value}); {RUN_WITHOUT}")
    return groups[0]
