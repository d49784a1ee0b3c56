"""Hyperparameters of a Llama-family decoder, independent of where the weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ModelLoadError


@dataclass(frozen=True)
class ModelSpec:
    """What the decoder needs to know to build itself; loaders fill it from config.json or GGUF."""

    architecture: str  # registry key, e.g. "llama", "mistral", "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v projections
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def describe(self) -> str:
        """Canonical text of every field that changes numerics, for the cache fingerprint."""
        fields = (
            self.architecture, self.vocab_size, self.hidden_size, self.intermediate_size,
            self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads,
            self.head_dim, repr(self.rms_norm_eps), repr(self.rope_theta),
            repr(sorted((self.rope_scaling or {}).items())), self.max_position_embeddings,
            self.tie_word_embeddings, self.attention_bias,
        )
        return "|".join(str(f) for f in fields)
