"""Tiny random Hugging Face models for the connector's deployment tests (tensor parallel,
sliding windows, hybrid KV groups): seconds to start under vLLM CPU instead of SmolLM2's
tens. Written by the vLLM environment's python (it has transformers):

    .venv-vllm/bin/python tests/integrations/tiny_models.py KIND DIR

Random weights at the default scale give attention so flat that a tiny model's output hardly
depends on its context, which would make an exactness test pass for the wrong reason: the
weights are drawn wider (`INIT_STD`) and the tests check that an early token changes the
output. KIND: llama (4 query, 2 KV heads: one per rank under tensor parallel 2), mistral
(llama with `sliding_window`), gemma3 (Gemma 3 text: sliding-window layers interleaved with
full-attention ones, so vLLM's hybrid allocator plans several KV cache groups), mamba (SSM
state, no attention: what kvtier refuses by name).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

VOCAB = 512  # prompts draw token ids below this
HEAD_DIM = 64  # a head size vLLM's CPU attention supports
INIT_STD = 0.25
BLOCK_SIZE = 32  # vLLM's CPU attention pages in multiples of 32 tokens
WINDOW = 64  # tokens a sliding-window layer sees: two blocks
KV_HEADS = {"llama": 2, "mistral": 2, "gemma3": 1}
LAYERS = {"llama": 2, "mistral": 2, "gemma3": 6}  # (mamba has no KV: sized as llama)


def kv_bytes_per_block(kind: str, tensor_parallel_size: int = 1) -> int:
    """One block's KV in float32 over all layers, on one rank (vLLM's pool is sized by it)."""
    heads = max(1, KV_HEADS[kind] // tensor_parallel_size)
    return LAYERS[kind] * heads * BLOCK_SIZE * 2 * HEAD_DIM * 4


def config(kind: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        head_dim=HEAD_DIM, max_position_embeddings=4096, initializer_range=INIT_STD,
        tie_word_embeddings=True, torch_dtype="float32")
    if kind == "llama":
        return tf.LlamaConfig(num_hidden_layers=LAYERS[kind], num_key_value_heads=KV_HEADS[kind],
                              **common)
    if kind == "mistral":
        return tf.MistralConfig(num_hidden_layers=LAYERS[kind],
                                num_key_value_heads=KV_HEADS[kind], sliding_window=WINDOW,
                                **common)
    if kind == "gemma3":
        # layers 0-4 windowed, layer 5 global (Gemma 3's pattern of 6); untied, since its
        # scaled embedding tied to the head answers one token whatever the context
        return tf.Gemma3TextConfig(num_hidden_layers=LAYERS[kind],
                                   num_key_value_heads=KV_HEADS[kind],
                                   sliding_window=WINDOW, sliding_window_pattern=6,
                                   query_pre_attn_scalar=HEAD_DIM,
                                   **{**common, "tie_word_embeddings": False})
    if kind == "mamba":
        return tf.MambaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2,
                              state_size=16, torch_dtype="float32")
    raise SystemExit(f"unknown tiny model kind {kind!r}: llama, mistral, gemma3 or mamba")


def write(kind: str, directory: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = config(kind)
    model = tf.Gemma3ForCausalLM(cfg) if kind == "gemma3" \
        else tf.AutoModelForCausalLM.from_config(cfg)
    if kind == "gemma3":
        with torch.no_grad():  # Gemma's norms start at a flat 1: drawn, so context shows
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 1.0)
    model.to(torch.float32).save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    write(sys.argv[1], Path(sys.argv[2]))
