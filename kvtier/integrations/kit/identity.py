"""What a vLLM engine's KV bytes depend on, folded into kvtier's fingerprint (fail closed).

Primitives: `weights_identity(model, revision, pinned, load_format)` for the base model,
computed once at start; `config_identity(hf_config_json, model, ...)` for the configuration
vLLM computes with; `unshared_identity(why)` for weights kvtier cannot know;
`adapter_identity(lora_request)` for a request's LoRA adapter, on every request.

The model's identity is config.json's bytes plus, for every weight file vLLM's loader reads
under the engine's `load_format` (the same file patterns, first match wins, a safetensors
index filtering the shards as vLLM's does), sorted by name, its name and a digest of all its
bytes (`kvtier.model.digest`: xxh3-128, cached per file version, so only the first start after
a change reads the weights). Any changed byte changes it; the path is not part of it (a copy of
a model is the same model, and two nodes sharing Redis agree). A hub name that is not a local
directory identifies as `model@<40-hex commit>` or not at all. A pin (`pinned`, the
connector's `model_identity` knob, e.g. a model registry's version) replaces all of this
without reading a byte: that the pin changes whenever the weights do is then the operator's
responsibility, not kvtier's.

Weights kvtier cannot know get an identity of their own that nothing else shares and no later
process reuses (`unshared:<random>`): `load_format="dummy"` (random weights: benchmarks,
profiling), a load format whose files kvtier does not read, and the weights after a cache
reset (a reload in place, `epochs.py`). A pin never overrides that: a dummy load is not the
pinned model.

An adapter's identity is a digest of its directory's adapter_config.json and weight files,
through the same cache, memoised in-process by their stat stamps (a request costs a few
`stat` calls). An adapter kvtier cannot see the bytes of (not a local directory), or one that
changed on disk while this process served it (vLLM may still hold the old weights in memory),
has no identity: its requests are neither looked up nor stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from kvtier.errors import ConfigError
from kvtier.model.digest import file_digest, racy, stamp

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = (".safetensors", ".bin", ".pt")  # what vLLM's LoRA loader reads
MEMO_ENTRIES = 4096
CHANGED = "changed-while-served"  # never a hex digest
UNSHARED = "unshared:"  # an identity no other process has, nor any later one
# vLLM's default loader, per load_format: the file patterns tried in order (the first that
# matches any file wins) and the safetensors index that filters the shards, if any
_SAFETENSORS_INDEX = "model.safetensors.index.json"
LOADED_FILES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "hf": (("*.safetensors", "*.bin", "*.pt"), _SAFETENSORS_INDEX),
    "safetensors": (("*.safetensors",), _SAFETENSORS_INDEX),
    "fastsafetensors": (("*.safetensors",), _SAFETENSORS_INDEX),
    "instanttensor": (("*.safetensors",), _SAFETENSORS_INDEX),
    "mistral": (("consolidated*.safetensors",), "consolidated.safetensors.index.json"),
    "pt": (("*.pt",), None),
    "npcache": (("*.bin", "*.pt"), None),
}
# keys of the HF config that name where the model was read from or what wrote it: vLLM
# computes nothing with them, so the same bytes at another path share
PATH_FIELDS = frozenset({"_name_or_path", "name_or_path", "transformers_version",
                         "_commit_hash"})

Stamps = tuple[tuple[str, int, int, int, int, int], ...]  # (name, size, mtime, ctime, ino, dev)


def unshared_identity(why: str, instance: str = "") -> str:
    """An identity of this engine alone: its blocks are never found by another engine or
    after a restart (`why` is logged, and kept readable in the identity). `instance`: what
    every process of one engine shares and no other engine has (vLLM's `instance_id`), so
    its scheduler and workers agree on the identity; "" draws a random one."""
    if instance:
        token = hashlib.blake2b(f"{why}\x00{instance}".encode(), digest_size=16).hexdigest()
    else:
        token = secrets.token_hex(16)
    return f"{UNSHARED}{why}:{token}"


def is_shared(identity: str) -> bool:
    return not identity.startswith(UNSHARED)


def weights_identity(model: str, revision: str | None = None, pinned: str | None = None,
                     load_format: str = "auto", instance: str = "") -> str:
    """Identity of the weights vLLM serves (see module doc); ConfigError when kvtier cannot
    tell which weights they are. `instance`: as `unshared_identity`'s, for weights kvtier
    cannot know."""
    fmt = str(getattr(load_format, "value", load_format)).lower()
    if fmt == "dummy":
        log.warning("kvtier: load_format=dummy: vLLM serves random weights, so kvtier caches "
                    "their KV under an identity of this engine alone (never shared through "
                    "disk or Redis, never found after a restart)")
        return unshared_identity("load_format=dummy", instance)
    if pinned is not None:
        if not pinned.strip():
            raise ConfigError("model_identity is empty; give the version your model registry "
                              "guarantees for these weights, or unset it")
        return "pinned:" + pinned
    path = Path(model)
    if not path.is_dir():
        if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
            return f"{model}@{revision}"
        raise ConfigError(
            f"kvtier cannot tell which weights {model!r} holds (not a local directory, and no "
            "commit revision pinned): serve a local model directory, or pass --revision <sha>")
    files = loaded_files(path, fmt)
    if files is None:
        log.warning("kvtier: load_format=%s reads files kvtier does not identify: their KV is "
                    "cached under an identity of this engine alone (pin model_identity to "
                    "share it)", fmt)
        return unshared_identity(f"load_format={fmt}", instance)
    if not files:
        raise ConfigError(f"{path} has no weight files that vLLM's load_format={fmt} reads "
                          "for kvtier to identify the weights by")
    began = time.perf_counter()
    h = xxhash.xxh3_128()
    config = path / "config.json"
    try:
        if config.is_file():
            h.update(config.read_bytes())
        h.update(b"\x00")
        cached = _add_files(h, files)
        size = sum(file.stat().st_size for file in files)
    except OSError as e:
        raise ConfigError(f"kvtier cannot read {path}'s weights to identify them: {e}") from e
    log.info("kvtier: identified the weights in %s (%d file(s), %.2f GB) in %.2f s; %d of %d "
             "file digest(s) from the cache", path, len(files), size / 1e9,
             time.perf_counter() - began, cached, len(files))
    return h.hexdigest()


def loaded_files(path: Path, load_format: str) -> list[Path] | None:
    """The weight files vLLM's default loader reads from `path` under `load_format`, sorted;
    None for a format kvtier does not follow (tensorizer, sharded_state, gguf, ...)."""
    fmt = load_format
    if fmt == "auto":
        fmt = "mistral" if any(path.glob("consolidated*.safetensors")) else "hf"
    if fmt not in LOADED_FILES:
        return None
    patterns, index = LOADED_FILES[fmt]
    files: list[Path] = []
    for pattern in patterns:
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if files:
            break
    if files and files[0].suffix == ".safetensors" and index and (path / index).is_file():
        try:
            named = set(json.loads((path / index).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"kvtier cannot read {path / index} (which vLLM filters the "
                              f"weight files by): {e}") from e
        files = [f for f in files if f.name in named]
    return files


def config_identity(hf_config_json: str) -> str:
    """The model's configuration as vLLM computes with it, without the fields that say where
    it was read from (`PATH_FIELDS`): key-sorted JSON."""
    config = json.loads(hf_config_json)
    return json.dumps(_without_paths(config), sort_keys=True, separators=(",", ":"))


def _without_paths(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in PATH_FIELDS}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


class AdapterMemo:
    """What this process knows of adapters: each directory's digest per stat stamps, and the
    first digest it served per directory (a later, different one means vLLM may still hold
    the first in memory)."""

    def __init__(self) -> None:
        self.by_stamps: dict[tuple[str, Stamps], str] = {}
        self.first: dict[str, str] = {}

    def remember(self, table: dict[Any, str], key: Any, digest: str) -> None:
        table[key] = digest
        if len(table) > MEMO_ENTRIES:
            del table[next(iter(table))]


def adapter_identity(lora_request: Any, memo: AdapterMemo) -> str | None:
    """Digest of a LoRA adapter's files (`lora_request.lora_path`, as vLLM's LoRARequest holds
    it); None when kvtier cannot identify it: never look its KV up or store it then."""
    raw = getattr(lora_request, "lora_path", "") or ""
    directory = Path(raw).expanduser()
    if not raw or not directory.is_dir():
        return None  # a hub id (vLLM downloads it in the worker) or a missing path
    directory = directory.resolve()
    key = str(directory)
    try:
        files = sorted(_adapter_files(directory))
        stamps: Stamps = tuple((f.name, *stamp(f.stat())) for f in files)
    except OSError:
        return None
    if not any(name == ADAPTER_CONFIG for name, *_ in stamps) or len(stamps) < 2:
        return None  # vLLM cannot load it either: nothing to cache
    digest = memo.by_stamps.get((key, stamps))
    if digest is None:
        try:
            digest = _adapter_digest(files)
        except OSError:
            return None
        now = time.time_ns()
        if not any(racy(s[1:], now) for s in stamps):
            memo.remember(memo.by_stamps, (key, stamps), digest)
    first = memo.first.get(key)
    if first is None:
        memo.remember(memo.first, key, digest)
    elif first != digest:
        if first != CHANGED:  # warn once per adapter
            log.warning("kvtier: the LoRA adapter in %s changed on disk while vLLM serves it "
                        "(vLLM may still hold the old weights): its KV is not cached until a "
                        "restart", directory)
            memo.first[key] = CHANGED
        return None
    return digest


def _adapter_files(directory: Path) -> Iterator[Path]:
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_file() and (entry.name == ADAPTER_CONFIG
                                    or entry.name.endswith(ADAPTER_WEIGHTS)):
                yield Path(entry.path)


def _adapter_digest(files: list[Path]) -> str:
    h = xxhash.xxh3_128()
    _add_files(h, files)
    return h.hexdigest()


def _add_files(h: Any, files: list[Path]) -> int:
    """Each file's name and full-content digest into `h`, in order (the model's weights and
    an adapter's files alike); how many digests the cache served."""
    cached = 0
    for file in files:
        digest = file_digest(file)
        h.update(f"{file.name}\x00{digest.hex}\x00".encode())
        cached += digest.cached
    return cached
