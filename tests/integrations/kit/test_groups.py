"""Which KV cache groups the vLLM connector serves, decided at start by the spec's class
name: one group of full or sliding-window attention; everything else refused by name (no
vLLM needed:
the check reads only attributes, so vLLM's classes are stood in for by ones of the same
names)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.kit.groups import servable_groups


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


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    extra_retained_tokens: int = 0


class MambaSpec:
    pass


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: tuple[str, ...] = ("model.layers.0.self_attn.attn",)


def test_one_full_attention_group_is_served_with_every_block_kept() -> None:
    group = Group(FullAttentionSpec())
    [served] = servable_groups([group])
    assert served.group is group and served.window is None
    # the hybrid allocator off: a mixed model's window layers as full attention with a window,
    # every block kept by vLLM, so served as full attention
    for spec in (FullAttentionSpec(sliding_window=512), FullAttentionSpec(attention_chunk_size=64)):
        assert servable_groups([Group(spec)])[0].window is None


def test_a_sliding_window_group_is_served_within_its_window() -> None:
    [served] = servable_groups([Group(SlidingWindowSpec(sliding_window=64, block_size=32,
                                                        extra_retained_tokens=0))])
    w = served.window
    assert w is not None
    assert served.describe == "SlidingWindowSpec:window=64+0:model.layers.0.self_attn.attn"
    # vLLM's get_num_skipped_tokens(n * 32) // 32: a hit of 10 blocks reads blocks 8 and 9
    assert [w.first_needed(n) for n in (0, 1, 2, 3, 10)] == [0, 0, 0, 1, 8]
    kept = servable_groups([Group(SlidingWindowSpec(sliding_window=64, block_size=32,
                                                    extra_retained_tokens=32))])[0].window
    assert kept is not None and kept.first_needed(10) == 7


@pytest.mark.parametrize(("groups", "message"), [
    ([], "no KV cache groups"),
    (None, "no KV cache groups"),
    ([Group(FullAttentionSpec()), Group(SlidingWindowSpec(sliding_window=4, head_size=16))],
     "whose blocks have one shape; this model's groups have 2"),
    ([Group(MLAAttentionSpec())], "is MLAAttentionSpec (MLA's latent KV)"),
    ([Group(FullAttentionSpec()), Group(MambaSpec())], "is MambaSpec (Mamba/SSM state)"),
    ([Group(SlidingWindowSpec(sliding_window=0))], "a sliding window of 0 tokens"),
])
def test_every_other_kind_stops_at_start_with_what_was_found(groups: list | None,
                                                            message: str) -> None:
    with pytest.raises(ConfigError) as e:
        servable_groups(groups)
    assert message in str(e.value)
    if groups:
        assert "unset kv_transfer_config" in str(e.value)


def test_hybrid_groups_of_one_block_shape_are_served_each_with_its_window() -> None:
    full = Group(FullAttentionSpec(block_size=32), ("model.layers.5.self_attn.attn",))
    windows = [Group(SlidingWindowSpec(sliding_window=64, block_size=32),
                     (f"model.layers.{i}.self_attn.attn",)) for i in range(5)]
    served = servable_groups([full, *windows])
    assert [s.window is None for s in served] == [True] + [False] * 5
    assert len({s.describe for s in served}) == 6  # each group named apart in the fingerprint
