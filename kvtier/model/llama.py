"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over paged KV.

Weights arrive in Hugging Face naming; q/k/v and gate/up are fused at load time so that a
decode step makes few, large matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.errors import ModelLoadError
from kvtier.model.attention import AttentionMetadata, paged_attention
from kvtier.model.layers import Linear, RMSNorm, RopeTables, RotaryEmbedding, SwiGLU, apply_rope
from kvtier.model.spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias
        )
        self.o_proj = Linear(self.q_size, spec.hidden_size)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, rope: RopeTables, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(rope, q, k)
        o = paged_attention(kv, self.layer, meta, q, k, v, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SwiGLU(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: RopeTables, kv: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """input ids of one step (all sequences flattened) -> logits of the rows that sample."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.rope = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling
        )
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # A separate copy even when tied: the fast decode layout (see Linear).
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        # input_ids, positions: [T]; logit_rows: [S] rows whose next-token logits are needed
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, kv, meta)
        x = self.norm(x[logit_rows])
        return self.lm_head(x).float()  # [S, vocab]

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be set."""
        w = dict(weights)
        if self.spec.tie_word_embeddings:
            w["lm_head.weight"] = w["model.embed_tokens.weight"]
        elif "lm_head.weight" not in w:
            raise ModelLoadError("lm_head.weight is missing and embeddings are not tied")
        params = dict(self.named_parameters())
        assigned: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if name.endswith(".weight") and name + "_t" in params:
                name, tensor = name + "_t", tensor.t()
            if name not in params:
                raise ModelLoadError(f"unexpected weight {name!r}")
            if params[name].shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            assigned.add(name)

        try:
            put("embed_tokens.weight", w.pop("model.embed_tokens.weight"))
            put("norm.weight", w.pop("model.norm.weight"))
            put("lm_head.weight", w.pop("lm_head.weight"))
            for i in range(self.spec.num_hidden_layers):
                hf, own = f"model.layers.{i}.", f"layers.{i}."
                for kind in ("weight", "bias"):
                    parts = [w.pop(f"{hf}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
                    if all(p is not None for p in parts):
                        put(f"{own}self_attn.qkv_proj.{kind}", torch.cat(parts, 0))  # type: ignore[arg-type]
                put(f"{own}self_attn.o_proj.weight", w.pop(f"{hf}self_attn.o_proj.weight"))
                gate_up = [w.pop(f"{hf}mlp.{p}_proj.weight") for p in ("gate", "up")]
                put(f"{own}mlp.gate_up_proj.weight", torch.cat(gate_up, 0))
                put(f"{own}mlp.down_proj.weight", w.pop(f"{hf}mlp.down_proj.weight"))
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    put(f"{own}{norm}.weight", w.pop(f"{hf}{norm}.weight"))
        except KeyError as e:
            raise ModelLoadError(f"weight {e.args[0]!r} is missing from the checkpoint") from None
        leftover = [k for k in w if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ModelLoadError(f"checkpoint has weights this model does not use: {leftover[:5]}")
        missing = set(params) - assigned
        if missing:
            raise ModelLoadError(f"weights never set: {sorted(missing)[:5]}")


ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # sliding window unused below its window length
    "qwen2": LlamaForCausalLM,  # q/k/v bias via ModelSpec.attention_bias
}


def build_model(spec: ModelSpec) -> LlamaForCausalLM:
    """Instantiate the registered class for `spec.architecture`."""
    cls = ARCHITECTURES.get(spec.architecture)
    if cls is None:
        raise ModelLoadError(
            f"architecture {spec.architecture!r} is not supported; choose one of "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return cls(spec)
