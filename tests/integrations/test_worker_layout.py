"""What the connector's worker half accepts from `register_kv_caches`, without vLLM: vLLM's
LBHNC per-layer tensors in one allocation, and on CUDA one per layer; a permuted layout
(FlashAttention's default LBNHC), kernel blocks smaller than the scheduler's, another dtype
or separate allocations on CPU are refused with the fix in the message. The CUDA case runs
where a GPU is (and in scripts/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.worker_side import ExpectedLayout

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 8, 2, 16, 4
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
EXPECTED = ExpectedLayout(NAMES, BLOCKS, (HEADS, BS, 2 * DIM), torch.float32, 4)


def names(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(NAMES, tensors))


def test_one_allocation_of_lbhnc_layers_is_accepted_as_it_is() -> None:
    kv = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * DIM)
    layout = EXPECTED.check(names(list(kv)))
    assert (layout.num_layers, layout.num_blocks) == (LAYERS, BLOCKS)
    assert layout.layer_block_shape == (HEADS, BS, 2 * DIM)
    assert layout.layer_view(2).data_ptr() == kv[2].data_ptr()  # no copy: vLLM's own memory


def test_flash_attentions_default_layout_is_refused_naming_the_one_kvtier_knows() -> None:
    # LBNHC: the logical [B, H, N, 2D] shape over [B, N, H, 2D] memory (a transposed view)
    kv = torch.randn(LAYERS, BLOCKS, BS, HEADS, 2 * DIM).transpose(2, 3)
    with pytest.raises(ConfigError, match=r"contiguous=False.*LBHNC"):
        EXPECTED.check(names(list(kv)))


def test_kernel_blocks_smaller_than_the_schedulers_are_refused_with_the_fix() -> None:
    kv = torch.randn(LAYERS, 2 * BLOCKS, HEADS, BS // 2, 2 * DIM)  # each block split in two
    with pytest.raises(ConfigError, match=r"blocks of 8 tokens.*--block-size 8"):
        EXPECTED.check(names(list(kv)))


@pytest.mark.parametrize("bad", ["dtype", "layers", "allocations"])
def test_anything_else_is_refused(bad: str) -> None:
    kv = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * DIM)
    tensors = list(kv)
    if bad == "dtype":
        tensors = [t.to(torch.bfloat16) for t in tensors]
    elif bad == "layers":
        tensors = tensors[:-1]
    else:  # one allocation per layer: vLLM CPU never does that
        tensors = [t.clone() for t in tensors]
    with pytest.raises(ConfigError, match=r"bfloat16|layers|allocations"):
        EXPECTED.check(names(tensors))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_layers_allocated_one_by_one_are_accepted() -> None:
    tensors = [torch.randn(BLOCKS, HEADS, BS, 2 * DIM, device="cuda") for _ in range(LAYERS)]
    layout = EXPECTED.check(names(tensors))
    assert layout.is_cuda and layout.layer_view(1).data_ptr() == tensors[1].data_ptr()


def test_hybrid_groups_sharing_tensors_are_one_layout_over_the_distinct_ones() -> None:
    # vLLM's hybrid allocator: two groups of 3 layers; layer i of each group is one tensor
    kv = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * DIM)
    registered = {**names(list(kv)),
                  **{f"model.layers.{LAYERS + i}.self_attn.attn": kv[i] for i in range(LAYERS)}}
    layout = EXPECTED.check(registered)
    assert layout.num_layers == LAYERS  # each block's bytes once, not once per group
    foreign = {**registered, "model.layers.9.self_attn.attn": torch.randn(BLOCKS, HEADS, BS,
                                                                          2 * DIM)}
    with pytest.raises(ConfigError, match=r"layers\.9\.self_attn\.attn is not one of the shared"):
        EXPECTED.check(foreign)
    with pytest.raises(ConfigError, match=r"no KV tensor for model\.layers\.2"):
        EXPECTED.check({k: v for k, v in registered.items() if k != NAMES[2]})
