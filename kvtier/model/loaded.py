"""What every model backend returns, and the digest of the weight bytes it came from.

Its own module so the backends (GGUF, Hugging Face, presets) and the resolver in
`loader.py` all depend on it, never on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.model.digest import combined_digest
from kvtier.model.spec import ModelSpec
from kvtier.model.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    """Everything the runner needs, independent of the file format it came from."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]  # HF names, e.g. "model.layers.0.self_attn.q_proj.weight"
    tokenizer: Tokenizer
    weights_digest: str  # digest of every weight byte (model/digest.py); in the fingerprint
    source: str  # resolved path, or the preset name


def weights_digest(paths: list[Path]) -> str:
    """A digest of every byte of the files in the given order, cached per file version: any
    changed byte changes it, a copy of the files elsewhere does not."""
    return combined_digest(paths)
