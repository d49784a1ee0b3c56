"""The engine end to end on the tiny preset: prefix reuse, preemption, sampling, bad input."""

from __future__ import annotations

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog
from kvtier.errors import ConfigError, ModelLoadError, RequestError
from kvtier.llm import LLM
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=20)


def engine(tiny: LoadedModel, **knobs: object) -> LLMEngine:
    knobs.setdefault("num_device_blocks", 64)
    return LLMEngine(EngineConfig.from_knobs(model="tiny", **knobs), loaded=tiny)


def run(e: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    rid = e.add_request(prompt, params)
    return e.run_to_completion([rid])[rid]


def test_prefix_cache_hit_reuses_blocks_and_gives_identical_logits(tiny: LoadedModel) -> None:
    # block 16: a 64-token shared prefix, then a 40-token suffix. The warm engine computes only
    # the suffix; its logits must equal, bit for bit, a cold engine that computed everything.
    prefix = [(7 * i) % 300 + 3 for i in range(64)]
    suffix = [(11 * i) % 300 + 5 for i in range(40)]
    warm = engine(tiny)
    run(warm, [*prefix, 1, 2, 3])
    hit = run(warm, prefix + suffix)
    cold = run(engine(tiny), prefix + suffix)
    assert hit.num_cached_tokens == 64 and cold.num_cached_tokens == 0
    assert hit.token_ids == cold.token_ids
    assert hit.logprobs == cold.logprobs


def test_small_pool_completes_every_request_once_and_drains(tiny: LoadedModel) -> None:
    # 12 blocks of 16 tokens (192 tokens) against 10 requests of ~60-100 tokens each: the
    # scheduler must preempt and recompute, and every request still finishes exactly once.
    e = engine(tiny, num_device_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rids = [e.add_request([(i * 13 + j) % 380 + 1 for j in range(20 + 6 * i)], params)
            for i in range(10)]
    outs = e.run_to_completion(rids)
    assert sorted(outs) == sorted(rids)
    assert all(len(o.token_ids) == 40 for o in outs.values())
    assert e.scheduler.stats.num_preemptions > 0
    assert not e.has_unfinished()
    assert e.pool.num_used == 0
    e.pool.check_invariants()


def test_preempted_request_matches_an_unpressured_run(tiny: LoadedModel) -> None:
    # greedy output of a request that was preempted and recomputed equals a roomy run's
    prompt = [(5 * j) % 380 + 1 for j in range(50)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    roomy = run(engine(tiny), prompt, params)
    tight = engine(tiny, num_device_blocks=8, max_num_seqs=4)
    rids = [tight.add_request(prompt, params) for _ in range(3)]
    outs = tight.run_to_completion(rids)
    assert tight.scheduler.stats.num_preemptions > 0
    for rid in rids:
        assert outs[rid].token_ids == roomy.token_ids


def test_sampling_seed_top_k_stop_and_max_tokens(tiny: LoadedModel) -> None:
    e = engine(tiny)
    prompt = [10, 20, 30, 40]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    a, b = run(e, prompt, seeded), run(e, prompt, seeded)
    assert a.token_ids == b.token_ids  # same seed, same draw
    others = {tuple(run(e, prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=s,
                                                  ignore_eos=True)).token_ids) for s in range(4)}
    assert len(others) > 1  # different seeds explore
    greedy = run(e, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    top1 = run(e, prompt, SamplingParams(max_tokens=12, temperature=0.7, top_k=1, ignore_eos=True))
    assert top1.token_ids == greedy.token_ids
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    # stop on a token id: it ends the output and is reported as the stop reason
    stop_id = greedy.token_ids[3]
    stopped = run(e, prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                            stop_token_ids=[stop_id], ignore_eos=True))
    first = greedy.token_ids.index(stop_id)
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id


def test_stop_string_truncates_text(tiny: LoadedModel) -> None:
    e = engine(tiny)
    full = run(e, [1, 2, 3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = full.text
    needle = text[5:8]
    assert needle, "the tiny model produced too little text for this scenario"
    out = run(e, [1, 2, 3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                           stop=[needle]))
    assert out.finish_reason == "stop" and out.stop_reason == needle
    assert out.text == text[: text.find(needle)]


def test_chat_second_turn_hits_the_prefix_cache(tiny: LoadedModel) -> None:
    llm = LLM.__new__(LLM)  # share the loaded tiny model instead of loading it again
    llm.config = EngineConfig.from_knobs(model="tiny", num_device_blocks=64)
    llm.engine = LLMEngine(llm.config, loaded=tiny)
    llm.tokenizer = llm.engine.tokenizer
    llm.log = RequestLog()
    params = SamplingParams(max_tokens=16, temperature=0.0)
    history = [{"role": "system", "content": "You are terse. " * 8},
               {"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = llm.chat(history, params)[0]
    history += [{"role": "assistant", "content": first.text},
                {"role": "user", "content": "And two more?"}]
    second = llm.chat(history, params)[0]
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // 16) * 16 > 0
    assert llm.stats()["prefix_cache"]["hits"] > 0


def test_bad_input_raises_typed_errors(tiny: LoadedModel) -> None:
    e = engine(tiny, num_device_blocks=4)  # 64 tokens of context
    with pytest.raises(RequestError, match="empty"):
        e.add_request("", SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(RequestError, match="max_model_len is 64"):
        e.add_request(list(range(1, 80)), SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        e.add_request([1, 2, 100_000], SamplingParams())
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ConfigError, match="unknown engine knob 'max_num_seq'"):
        EngineConfig.from_knobs(max_num_seq=4)
    with pytest.raises(ConfigError, match="block_size=3"):
        EngineConfig.from_knobs(block_size=3)
    with pytest.raises(ModelLoadError, match=r"/no/such/model\.gguf"):
        LLM("/no/such/model.gguf")
    assert not e.has_unfinished() and e.pool.num_used == 0


def test_generation_stops_at_the_context_limit(tiny: LoadedModel) -> None:
    e = engine(tiny, num_device_blocks=2)  # 32 tokens of context in total
    out = run(e, list(range(1, 21)), SamplingParams(max_tokens=100, temperature=0.0,
                                                    ignore_eos=True))
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32
