"""Tiny random-weight models that need no download, for tests, demos and CPU benchmarks.

Primitives: `PRESETS` (name -> ModelSpec), `load_preset(name)` (deterministic weights from a
fixed seed, a byte-level tokenizer in which any text round-trips, a ChatML template).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from types import MappingProxyType

import tokenizers
import torch
from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers.models import BPE

from kvtier.errors import ModelLoadError
from kvtier.model.loaded import LoadedModel
from kvtier.model.spec import ModelSpec
from kvtier.model.tokenizer import Tokenizer, byte_alphabet

SEED = 1234
VOCAB_SIZE = 384  # 256 byte tokens + specials, padded with reserved tokens
SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tiny(architecture: str, name: str) -> ModelSpec:
    return ModelSpec(
        architecture=architecture,
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=architecture == "qwen2",
        name=name,
    )


PRESETS: Mapping[str, ModelSpec] = MappingProxyType({
    "tiny": _tiny("llama", "tiny"),
    "tiny-qwen2": _tiny("qwen2", "tiny-qwen2"),
})


def load_preset(name: str) -> LoadedModel:
    """The named preset; the same name always gives bit-identical weights."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset '{name}'; choose one of {', '.join(sorted(PRESETS))}")
    spec = PRESETS[name]
    digest = hashlib.blake2b(f"{name}|{SEED}|{spec.describe()}".encode(), digest_size=16)
    return LoadedModel(
        spec=spec,
        weights=random_weights(spec, SEED),
        tokenizer=byte_tokenizer(),
        weights_digest=digest.hexdigest(),
        source=name,
    )


def random_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 weights: N(0, 0.02) matrices and biases, norms 1 + N(0, 0.02)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        weights[p + "input_layernorm.weight"] = 1 + normal(h)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            weights[f"{p}self_attn.{proj}.weight"] = normal(rows, h)
            if spec.attention_bias:
                weights[f"{p}self_attn.{proj}.bias"] = normal(rows)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q)
        weights[p + "post_attention_layernorm.weight"] = 1 + normal(h)
        weights[p + "mlp.gate_proj.weight"] = normal(i, h)
        weights[p + "mlp.up_proj.weight"] = normal(i, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, i)
    weights["model.norm.weight"] = 1 + normal(h)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h)
    return weights


def byte_tokenizer() -> Tokenizer:
    """One token per byte (id = byte value), then <s>, </s>, <|im_start|>, <|im_end|>, reserved."""
    alphabet = byte_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    backend = tokenizers.Tokenizer(BPE(vocab, [], continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{n}|>" for n in range(VOCAB_SIZE - 256 - len(SPECIALS))]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *reserved)]
    )
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    return Tokenizer(
        backend=backend,
        bos_token_id=ids["<s>"],
        eos_token_ids=(ids["</s>"], ids["<|im_end|>"]),
        chat_template=CHATML,
        add_bos_token=True,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
