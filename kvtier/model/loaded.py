"""What every model backend returns, and the digest of the weight bytes it came from.

Its own module so the backends (GGUF, Hugging Face, presets) and the resolver in
`loader.py` all depend on it, never on each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.model.spec import ModelSpec
from kvtier.model.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_CHUNK = 8 << 20


@dataclass
class LoadedModel:
    """Everything the runner needs, independent of the file format it came from."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]  # HF names, e.g. "model.layers.0.self_attn.q_proj.weight"
    tokenizer: Tokenizer
    weights_digest: str  # blake2b hex of the weight bytes; part of the cache fingerprint
    source: str  # resolved path, or the preset name


def weights_digest(paths: list[Path]) -> str:
    """blake2b of the files' bytes in the given order, read in 8 MiB chunks."""
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        with p.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
