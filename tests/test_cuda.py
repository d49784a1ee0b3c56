"""The same engine on CUDA: paged attention, logits against transformers, prefix reuse.

Marked `gpu`; skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.attention import build_metadata, paged_attention
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_paged_attention_on_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    # kv: [num_blocks, num_layers, block_size, 2, kv_heads, head_dim]
    kv = torch.randn(12, 2, 4, 2, 2, 8, generator=gen)
    chunks = [(0, 7, [3, 9]), (5, 1, [1, 4]), (6, 3, [0, 2, 11])]  # prefill, decode, chunk
    rows = sum(n for _, n, _ in chunks)
    q = torch.randn(rows, 6, 8, generator=gen)
    k = torch.randn(rows, 2, 8, generator=gen)
    v = torch.randn(rows, 2, 8, generator=gen)
    cpu_kv, gpu_kv = kv.clone(), kv.cuda()
    ref = paged_attention(cpu_kv, 1, build_metadata(chunks, 4, torch.device("cpu")), q, k, v,
                          8**-0.5)
    meta = build_metadata(chunks, 4, torch.device("cuda"))
    out = paged_attention(gpu_kv, 1, meta, q.cuda(), k.cuda(), v.cuda(), 8**-0.5)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_kv.cpu(), cpu_kv)  # the same slots were written


def test_smollm2_float32_on_cuda_matches_transformers(smollm2: LoadedModel, hf_smollm2) -> None:
    engine = LLMEngine(EngineConfig.from_knobs(device="cuda", dtype="float32",
                                               num_device_blocks=64), loaded=smollm2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    rid = engine.add_request(prompt, params)
    out = engine.run_to_completion([rid])[rid]
    ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
    with torch.no_grad():
        ref = hf_smollm2.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert out.token_ids == ref[0, ids.shape[1]:].tolist()


def test_bfloat16_on_cuda_generates_and_reuses_prefixes(smollm2: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig.from_knobs(device="cuda", num_device_blocks=64),
                       loaded=smollm2)
    assert engine.runner.dtype == torch.bfloat16 and engine.runner.kv.is_cuda
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    prefix = "You are a careful assistant. " * 12
    first = engine.add_request(prefix + "Say hi.", params)
    engine.run_to_completion([first])
    second = engine.add_request(prefix + "Say bye.", params)
    out = engine.run_to_completion([second])[second]
    assert out.num_cached_tokens >= 64 and len(out.token_ids) == 8
    assert engine.pool.num_used == 0


def test_host_tier_on_cuda_wakes_sessions_with_identical_tokens(smollm2: LoadedModel) -> None:
    # pinned host pool, side-stream copies, events: a demoted session wakes (async and
    # layerwise) and answers as a never-offloaded engine on the same GPU (float32, so the
    # prefill-vs-suffix numerics differ only in the last bits and greedy tokens agree)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLMEngine(EngineConfig.from_knobs(device="cuda", dtype="float32",
                                            num_device_blocks=128), loaded=smollm2)
    prompt = "Explain the KV cache of a transformer in one paragraph. " * 6
    rid = ref.add_request(prompt, params)
    want = ref.run_to_completion([rid])[rid]
    for load_mode in ("async", "layerwise"):
        e = LLMEngine(EngineConfig.from_knobs(device="cuda", dtype="float32",
                                              num_device_blocks=128, kv_offloading_size=0.5,
                                              load_mode=load_mode), loaded=smollm2)
        assert e.tier.enabled and e.tier.worker.host.pinned
        first = e.add_request(prompt, params)
        e.run_to_completion([first])
        assert e.demote_cached() > 0
        again = e.add_request(prompt, params)
        got = e.run_to_completion([again])[again]
        assert got.residency == "host" and got.num_restored_tokens > 0
        assert got.token_ids == want.token_ids, load_mode
        e.close()
