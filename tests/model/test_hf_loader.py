"""Hugging Face directories: tiny random transformers models saved with save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.errors import ModelLoadError
from kvtier.model.hf import load_hf_dir, spec_from_config
from kvtier.model.presets import CHATML, load_preset

transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def save_tokenizer(d: Path, chat_template: object = CHATML) -> None:
    """The preset's byte-level tokenizer plus a tokenizer_config and generation_config."""
    load_preset("tiny").tokenizer.backend.save(str(d / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<s>", "special": True},  # dict form
        "eos_token": "<|im_end|>",  # string form
        "add_bos_token": True,
        "chat_template": chat_template,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 259]}))


def test_llama_dir_loads_identical_weights_and_spec(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, max_position_embeddings=512, rope_theta=20000.0,
                                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)

    loaded = load_hf_dir(tmp_path)
    expected = model.state_dict()
    assert set(loaded.weights) == set(expected)
    for name, w in expected.items():
        assert torch.equal(loaded.weights[name], w), name
    spec = loaded.spec
    assert (spec.architecture, spec.vocab_size, spec.hidden_size) == ("llama", 384, 64)
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (4, 2, 16)
    assert (spec.intermediate_size, spec.num_hidden_layers) == (128, 2)
    assert spec.rope_theta == 20000.0 and spec.rope_scaling is None  # rope_type "default"
    assert spec.rms_norm_eps == 1e-6 and spec.max_position_embeddings == 512
    assert not spec.tie_word_embeddings and not spec.attention_bias
    assert loaded.source == str(tmp_path) and len(loaded.weights_digest) == 32


def test_llama_dir_tokenizer_files(tmp_path: Path) -> None:
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    tok = load_hf_dir(tmp_path).tokenizer
    # <s> is 256, </s> 257, <|im_start|> 258, <|im_end|> 259 in the preset's vocabulary
    assert tok.bos_token_id == 256 and tok.add_bos_token
    assert tok.eos_token_ids == (259, 257)  # tokenizer_config's eos, then generation_config's
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    assert tok.encode("hi") == [256, ord("h"), ord("i")]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen2_dir_has_biases_and_ties(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, chat_template=[{"name": "tool_use", "template": "T"},
                                            {"name": "default", "template": "D"}])
    loaded = load_hf_dir(tmp_path)
    assert loaded.spec.architecture == "qwen2"
    assert loaded.spec.attention_bias  # implicit in Qwen2's config
    assert loaded.spec.tie_word_embeddings and "lm_head.weight" not in loaded.weights
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert torch.equal(loaded.weights[bias], model.state_dict()[bias])
    for name, w in model.state_dict().items():
        if name != "lm_head.weight":  # tied: saved once, as the embedding
            assert torch.equal(loaded.weights[name], w), name
    assert loaded.tokenizer.chat_template == "D"  # the template named "default"


def test_bf16_weights_become_float32(tmp_path: Path) -> None:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    loaded = load_hf_dir(tmp_path)
    w = loaded.weights["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, model.state_dict()["model.layers.0.mlp.up_proj.weight"].float())


def test_rope_scaling_old_and_new_spellings() -> None:
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    old = {"model_type": "llama", **TINY, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", **llama3}}  # 4.x, with the legacy "type" key
    new = {"model_type": "llama", **TINY,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}}  # 5.x
    for config in (old, new):
        spec = spec_from_config(config, Path("m"))
        assert spec.rope_theta == 500000.0
        assert spec.rope_scaling == {"rope_type": "llama3", **llama3}
        assert spec.head_dim == 16  # absent: hidden 64 / 4 heads


def test_hf_dir_errors_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json' as JSON"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **TINY}))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # never read: config first
    with pytest.raises(ModelLoadError, match=r"model_type 'gpt2'.*llama, mistral, qwen2"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ModelLoadError, match="lacks 'hidden_size'"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(ModelLoadError, match=r"cannot read safetensors file '.*model\.safe"):
        load_hf_dir(tmp_path)
