"""Batch-invariant mode: a request's logits do not depend on its neighbours, its chunking,
or on being preempted and recomputed. The tier's exactness tests stand on this."""

from __future__ import annotations

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
PROMPTS = [[(i * 37 + j * 11) % 380 + 1 for j in range(15 + 23 * i)] for i in range(6)]


def serve(loaded: LoadedModel, prompts: list[list[int]], **knobs: object) -> list[tuple]:
    knobs.setdefault("num_device_blocks", 128)
    engine = LLMEngine(EngineConfig.from_knobs(model="tiny", batch_invariant=True, **knobs),
                       loaded=loaded)
    rids = [engine.add_request(p, PARAMS) for p in prompts]
    outs = engine.run_to_completion(rids)
    assert engine.pool.num_used == 0
    return [(tuple(outs[r].token_ids), tuple(map(tuple, map(sorted, (
        d.items() for d in outs[r].logprobs or []))))) for r in rids]


def test_alone_batched_chunked_and_preempted_runs_agree_bit_for_bit(tiny: LoadedModel) -> None:
    # each prompt alone is the reference; then all six together, then with prefill chunks of
    # 7 tokens, then on a 10-block pool that must preempt and recompute
    alone = [serve(tiny, [p])[0] for p in PROMPTS]
    assert serve(tiny, PROMPTS) == alone
    assert serve(tiny, PROMPTS, max_num_batched_tokens=7) == alone
    tight = LLMEngine(EngineConfig.from_knobs(model="tiny", batch_invariant=True,
                                              num_device_blocks=10), loaded=tiny)
    rids = [tight.add_request(p, PARAMS) for p in PROMPTS]
    outs = tight.run_to_completion(rids)
    assert tight.scheduler.stats.num_preemptions > 0
    for rid, ref in zip(rids, alone):
        assert tuple(outs[rid].token_ids) == ref[0]


def test_batch_invariant_changes_the_cache_namespace(tiny: LoadedModel) -> None:
    plain = LLMEngine(EngineConfig.from_knobs(model="tiny", num_device_blocks=4), loaded=tiny)
    inv = LLMEngine(EngineConfig.from_knobs(model="tiny", num_device_blocks=4,
                                            batch_invariant=True), loaded=tiny)
    assert plain.namespace() != inv.namespace()  # different numerics, different KV bytes


def test_batch_invariant_is_refused_off_cpu(tiny: LoadedModel) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to be refused on")
    with pytest.raises(ConfigError, match="CPU kernels only"):
        LLMEngine(EngineConfig.from_knobs(model="tiny", device="cuda", batch_invariant=True),
                  loaded=tiny)
