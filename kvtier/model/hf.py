"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer files).

Primitives: `load_hf_dir(path)`; inside, `spec_from_config` maps config.json to a ModelSpec,
`_weights` reads every safetensors shard as float32, `_tokenizer` joins tokenizer.json with the
special tokens and chat template from tokenizer_config.json and generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import safetensors.torch
import tokenizers
import torch

from kvtier.errors import ModelLoadError
from kvtier.model.loaded import SUPPORTED_ARCHITECTURES as MODEL_TYPES
from kvtier.model.loaded import LoadedModel, weights_digest
from kvtier.model.spec import ModelSpec
from kvtier.model.tokenizer import Tokenizer


def load_hf_dir(path: Path) -> LoadedModel:
    """Read the whole directory into memory; weights become float32 in their HF names."""
    config = _read_json(path / "config.json", required=True)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(
            f"model directory '{path}' has config.json but no *.safetensors weights; "
            "save the model with safe_serialization=True"
        )
    spec = spec_from_config(config, path)  # refuse an unsupported model before reading weights
    weights = _weights(shards)
    if "tie_word_embeddings" not in config:  # unsaid: tied exactly when no lm_head was saved
        spec = dataclasses.replace(spec, tie_word_embeddings="lm_head.weight" not in weights)
    return LoadedModel(
        spec=spec,
        weights=weights,
        tokenizer=_tokenizer(path),
        weights_digest=weights_digest(shards),
        source=str(path),
    )


def spec_from_config(config: dict[str, Any], path: Path) -> ModelSpec:
    """ModelSpec from a transformers config.json (4.x `rope_scaling` or 5.x `rope_parameters`)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelLoadError(
            f"'{path / 'config.json'}' has model_type {model_type!r} "
            f"({', '.join(config.get('architectures') or [])}); "
            f"kvtier runs {', '.join(MODEL_TYPES)}"
        )

    def need(key: str) -> Any:
        if key not in config:
            raise ModelLoadError(f"'{path / 'config.json'}' lacks '{key}'; is it a full config?")
        return config[key]

    for key in ("use_sliding_window", "mlp_bias"):
        if config.get(key):
            raise ModelLoadError(f"'{path / 'config.json'}' sets {key}=true; kvtier lacks it")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = _rope(config)
    return ModelSpec(
        architecture=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and never says so in its config.
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        name=str(config.get("_name_or_path") or path.name),
    )


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None for plain RoPE), normalizing `type` to `rope_type`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **params}


def _weights(shards: list[Path]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            tensors = safetensors.torch.load_file(shard)
        except Exception as e:  # SafetensorError, OSError, ... from a damaged shard
            raise ModelLoadError(
                f"cannot read safetensors file '{shard}' ({type(e).__name__}: {e}); re-download it"
            ) from e
        weights.update({name: t.to(torch.float32) for name, t in tensors.items()})
    return weights


def _tokenizer(path: Path) -> Tokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ModelLoadError(
            f"model directory '{path}' has no tokenizer.json; save the fast tokenizer with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"cannot parse '{file}': {e}") from e
    config = _read_json(path / "tokenizer_config.json", required=False)
    generation = _read_json(path / "generation_config.json", required=False)
    special = {
        key: text
        for key in ("bos_token", "eos_token")
        if (text := _token_text(config.get(key))) is not None
    }
    bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
    eos_ids = [backend.token_to_id(special["eos_token"])] if "eos_token" in special else []
    extra = generation.get("eos_token_id")
    eos_ids += extra if isinstance(extra, list) else [extra]
    return Tokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        chat_template=_chat_template(config.get("chat_template"), path),
        add_bos_token=bool(config.get("add_bos_token", False)),
        special_tokens=special,
    )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(value: Any, path: Path) -> str | None:
    """The template string; a list of named templates yields the one named "default"."""
    if value is None or isinstance(value, str):
        return value if value is not None else _template_file(path)
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ModelLoadError(
            f"'{path / 'tokenizer_config.json'}' has chat templates {sorted(map(str, named))} "
            "but none named 'default'"
        )
    raise ModelLoadError(f"'{path / 'tokenizer_config.json'}' has a chat_template of bad type")


def _template_file(path: Path) -> str | None:
    """Newer checkpoints keep the template in chat_template.jinja next to the config."""
    file = path / "chat_template.jinja"
    return file.read_text(encoding="utf-8") if file.is_file() else None


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelLoadError(f"'{file}' is missing; a Hugging Face model directory needs it")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read '{file}' as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"'{file}' holds {type(data).__name__}, expected a JSON object")
    return data
