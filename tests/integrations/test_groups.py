"""Which KV cache groups the vLLM connector serves, decided at start by the spec's class
name: plain full attention in one group; everything else refused by name (no vLLM needed:
the check reads only attributes, so vLLM's classes are stood in for by ones of the same
names)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.groups import servable_group


@dataclass
class FullAttentionSpec:
    num_kv_heads: int = 2
    head_size: int = 8
    dtype: str = "float32"
    block_size: int = 16
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(FullAttentionSpec):
    pass


class MambaSpec:
    pass


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: tuple[str, ...] = ("model.layers.0.self_attn.attn",)


def test_one_plain_full_attention_group_is_served() -> None:
    group = Group(FullAttentionSpec())
    assert servable_group([group]) is group


@pytest.mark.parametrize(("groups", "message"), [
    ([], "no KV cache groups"),
    (None, "no KV cache groups"),
    ([Group(FullAttentionSpec()), Group(SlidingWindowSpec(sliding_window=4))],
     "has 2 (FullAttentionSpec, SlidingWindowSpec)"),
    ([Group(MLAAttentionSpec())], "this model's KV is MLAAttentionSpec (MLA's latent KV)"),
    ([Group(MambaSpec())], "this model's KV is MambaSpec (Mamba/SSM state)"),
    ([Group(SlidingWindowSpec(sliding_window=4))], "SlidingWindowSpec (sliding-window"),
    # the hybrid allocator off: a mixed model's window layers as full attention with a window
    ([Group(FullAttentionSpec(sliding_window=512))], "windowed attention yet (sliding_window=512)"),
    ([Group(FullAttentionSpec(attention_chunk_size=64))], "(attention_chunk_size=64)"),
])
def test_every_other_kind_stops_at_start_with_what_was_found(groups: list | None,
                                                            message: str) -> None:
    with pytest.raises(ConfigError) as e:
        servable_group(groups)
    assert message in str(e.value)
    if groups:
        assert "unset kv_transfer_config" in str(e.value)
