"""Write a loaded model out as a Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), so another engine (vLLM)
can serve the very weights kvtier serves: the embedded GGUF becomes a model vLLM loads.

Primitives: `export_hf(loaded, out_dir, dtype)`. The directory is written under a temporary
name and renamed into place, so a failed export never leaves a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from kvtier.errors import ModelLoadError
from kvtier.model.loaded import LoadedModel

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_hf(loaded: LoadedModel, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `loaded` to `out_dir` (which must not exist yet); returns the directory."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists():
        raise ModelLoadError(f"'{out}' exists already; name a new directory to export into")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(loaded, tmp, dtype)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp made it private; a model directory is meant to be read
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(loaded: LoadedModel, out: Path, dtype: str) -> None:
    spec, tok = loaded.spec, loaded.tokenizer
    weights = {name: t.detach().to(DTYPES[dtype]).contiguous()
               for name, t in loaded.weights.items()
               if not (spec.tie_word_embeddings and name == "lm_head.weight")}
    safetensors.torch.save_file(weights, str(out / "model.safetensors"),
                                metadata={"format": "pt"})
    bos = tok.bos_token_id
    eos = list(tok.eos_token_ids)
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[spec.architecture]],
        "model_type": spec.architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "_name_or_path": spec.name or Path(loaded.source).stem,
    }
    _dump(out / "config.json", config)
    _dump(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos or None})
    (out / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.add_bos_token,
        "model_max_length": spec.max_position_embeddings,
        **tok.special_tokens,
    }
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    _dump(out / "tokenizer_config.json", tok_config)


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
