"""Our decoder against transformers' LlamaForCausalLM on the same weights, in float32."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from kvtier.config import EngineConfig
from kvtier.engine.batch import ScheduledSeq
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.hf import spec_from_config
from kvtier.model.loader import LoadedModel
from kvtier.model.presets import byte_tokenizer
from kvtier.model.runner import ModelRunner
from kvtier.sequence import SamplingParams, Sequence

RTOL = 1e-4


def all_logits(loaded: LoadedModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every position of one prefill through the paged path (blocks in reverse order,
    so block tables really are scattered)."""
    n_blocks = -(-len(token_ids) // block_size)
    config = EngineConfig.from_knobs(model="test", block_size=block_size,
                                     num_device_blocks=n_blocks + 2)
    runner = ModelRunner(loaded, config)
    seq = Sequence("r", token_ids, SamplingParams(max_tokens=1))
    blocks = list(range(n_blocks + 1, 1, -1))[:n_blocks]
    chunk = ScheduledSeq(seq, 0, len(token_ids), blocks)
    ids, pos, meta, _, _ = runner._prepare([chunk])
    with torch.inference_mode():
        return runner.model(ids, pos, runner.kv, meta, torch.arange(len(token_ids)))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def loaded_from_hf(model: torch.nn.Module, config: dict) -> LoadedModel:
    spec = spec_from_config(config, __import__("pathlib").Path("test"))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return LoadedModel(spec, weights, byte_tokenizer(), "test-digest", "test")


def random_hf(kind: str) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if kind == "llama3":
        cfg = LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    else:
        cfg = Qwen2Config(**common, rope_theta=10000.0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # make the biases non-trivial so a missed bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model, cfg.to_dict()


def test_random_llama3_and_qwen2_logits_match_transformers() -> None:
    # 3 layers, GQA 8:2, llama3 rope scaling (short original context so scaling bites) and
    # Qwen2's q/k/v biases; 150 tokens over 10 scattered blocks
    ids = torch.randint(0, 384, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    for kind in ("llama3", "qwen2"):
        model, config = random_hf(kind)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        ours = all_logits(loaded_from_hf(model, config), ids)
        assert relative_error(ours, ref) < RTOL, kind


def test_smollm2_logits_match_transformers(smollm2: LoadedModel, hf_smollm2) -> None:
    text = "The quick brown fox jumps over the lazy dog. In 2024, KV caches grew 10x."
    ids = smollm2.tokenizer.encode(text)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0]
    ours = all_logits(smollm2, ids)
    assert relative_error(ours, ref) < RTOL


def test_smollm2_greedy_generation_matches_transformers(smollm2: LoadedModel, hf_smollm2) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    engine = LLMEngine(EngineConfig.from_knobs(model="default", num_device_blocks=64),
                       loaded=smollm2)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    outs = engine.run_to_completion(rids)  # all three decode together in one batch
    for rid, prompt in zip(rids, prompts):
        ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = hf_smollm2.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert outs[rid].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
