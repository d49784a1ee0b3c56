"""What a vLLM engine's KV bytes depend on, folded into kvtier's fingerprint (fail closed).

Model identity is a sampled digest of the weight files: each safetensors file's size, its
whole header (every tensor's name, dtype, shape and offsets) and 32 windows of 64 KiB spread
over its payload, plus config.json. A changed shape, dtype, file or any sampled byte changes
it; it reads about 2 MiB per file, so it costs milliseconds for any model size. A fine-tune
that changes no sampled byte is the case it cannot see: give such weights their own
directory (the path is not part of it, on purpose: a copy of a model is the same model).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from kvtier.errors import ConfigError

WINDOWS = 32
WINDOW_BYTES = 64 << 10
MAX_HEADER_BYTES = 100 << 20


def weights_identity(model: str, revision: str | None = None) -> str:
    """Digest of a local model directory's weights (see module doc), or `model@revision` for
    a hub model pinned to a commit; ConfigError when neither identifies the weights."""
    path = Path(model)
    if not path.is_dir():
        if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
            return f"{model}@{revision}"
        raise ConfigError(
            f"kvtier cannot tell which weights {model!r} holds (not a local directory, and no "
            "commit revision pinned): serve a local model directory, or pass --revision <sha>")
    h = hashlib.blake2b(digest_size=16)
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors files for kvtier to identify the weights "
                          "by; kvtier's connector supports safetensors checkpoints")
    for file in files:
        _sample(file, h)
    return h.hexdigest()


def _sample(file: Path, h: hashlib._Hash) -> None:
    size = file.stat().st_size
    h.update(f"{file.name}\x00{size}\x00".encode())
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ConfigError(f"{file} is not a safetensors file (header of {header_len} bytes)")
        h.update(f.read(header_len))
        start = 8 + header_len
        payload = size - start
        for i in range(WINDOWS):
            offset = start + (payload - WINDOW_BYTES) * i // max(WINDOWS - 1, 1)
            f.seek(max(start, offset), os.SEEK_SET)
            h.update(f.read(WINDOW_BYTES))
