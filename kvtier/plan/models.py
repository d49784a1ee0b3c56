"""The model shapes the planner's arithmetic needs: KV bytes per token, weights, FLOPs.

Primitives: `MODELS` (name -> ModelShape, read-only), `resolve_model(name_or_path)` (a preset
name or a Hugging Face config.json / model directory), `shape_from_spec(spec)` (params
estimated from the shapes), `kv_dtype_bytes(name)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvtier.errors import ConfigError, KvtierError
from kvtier.model.spec import ModelSpec

KV_DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1})
WEIGHT_BYTES = 2  # bf16/fp16 weights: what the HBM budget and the decode-time model assume


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes of one KV element; unknown dtype -> ConfigError listing the choices."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(
            f"--kv-dtype {kv_dtype!r} is not known; choose one of {', '.join(KV_DTYPE_BYTES)}"
        )
    return KV_DTYPE_BYTES[kv_dtype]


@dataclass(frozen=True)
class ModelShape:
    """What restore-vs-recompute needs of a model; no weights, no tokenizer."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_params: int  # all weights, embeddings included (prefill FLOPs ~ 2 * this per token)
    vocab_size: int
    source: str = ""  # where the numbers come from

    def kv_bytes_per_token(self, kv_dtype: str = "fp16") -> int:
        """Keys and values of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes(kv_dtype)

    @property
    def weights_bytes(self) -> int:
        return self.num_params * WEIGHT_BYTES



def _preset(name: str, layers: int, kv_heads: int, hidden: int, params: float, vocab: int,
            source: str) -> ModelShape:
    return ModelShape(name, layers, kv_heads, 128, hidden, int(params), vocab, source)


# Published config.json values; params as the model cards state them.
MODELS: Mapping[str, ModelShape] = MappingProxyType({
    "llama-3.1-8b": _preset("llama-3.1-8b", 32, 8, 4096, 8.03e9, 128256,
                            "meta-llama/Llama-3.1-8B config.json"),
    "llama-3.1-70b": _preset("llama-3.1-70b", 80, 8, 8192, 70.6e9, 128256,
                             "meta-llama/Llama-3.1-70B config.json"),
    "qwen2.5-7b": _preset("qwen2.5-7b", 28, 4, 3584, 7.61e9, 152064,
                          "Qwen/Qwen2.5-7B config.json"),
    "qwen2.5-72b": _preset("qwen2.5-72b", 80, 8, 8192, 72.7e9, 152064,
                           "Qwen/Qwen2.5-72B config.json"),
    "mistral-7b": _preset("mistral-7b", 32, 8, 4096, 7.24e9, 32000,
                          "mistralai/Mistral-7B-v0.1 config.json"),
})


def shape_from_spec(spec: ModelSpec, source: str = "") -> ModelShape:
    """Params estimated from the shapes: embeddings (+ lm_head unless tied) and per layer the
    q/k/v/o projections (+ q/k/v biases), the gated MLP's three matrices and two norms."""
    h, kv_dim = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    q_dim = spec.num_attention_heads * spec.head_dim
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    if spec.attention_bias:
        attention += q_dim + 2 * kv_dim
    per_layer = attention + 3 * h * spec.intermediate_size + 2 * h
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    params = embeddings + spec.num_hidden_layers * per_layer + h  # + the final norm
    return ModelShape(
        name=spec.name or "model", num_layers=spec.num_hidden_layers,
        num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim, hidden_size=h,
        num_params=params, vocab_size=spec.vocab_size, source=source or "config.json",
    )


def resolve_model(name_or_path: str) -> ModelShape:
    """A preset name, or a path to a config.json or to the directory holding one."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = Path(name_or_path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ConfigError(
            f"--model {name_or_path!r} is neither a preset ({', '.join(MODELS)}) nor a path "
            "to a Hugging Face config.json or a directory holding one"
        )
    from kvtier.model.hf import spec_from_config

    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ConfigError(f"'{config_file}' holds {type(config).__name__}, not an object")
        spec = spec_from_config(config, config_file.parent)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read '{config_file}' as JSON: {e}") from e
    except ConfigError:
        raise
    except KvtierError as e:  # ModelLoadError: a missing key or an unsupported architecture
        raise ConfigError(f"--model {name_or_path!r}: {e}") from e
    return shape_from_spec(spec, source=str(config_file))
