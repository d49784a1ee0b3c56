"""The host tier end to end on the tiny preset, in batch-invariant mode so that every output
can be compared bit for bit with a run on an unlimited device pool."""

from __future__ import annotations

import random
import time

import pytest
from conftest import exact_engine

from kvtier.config import EngineConfig, LoadMode
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams
from kvtier.tier import Faults
from kvtier.tier.faults import every_load

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
HOST = 0.02  # GiB: 2,500 tiny-model blocks


def run(e: LLMEngine, prompts: list[list[int]], params: SamplingParams = PARAMS
        ) -> list[RequestOutput]:
    rids = [e.add_request(p, params) for p in prompts]
    outs = e.run_to_completion(rids)
    return [outs[r] for r in rids]


def same(a: RequestOutput, b: RequestOutput) -> bool:
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def conversations(n: int, seed: int = 0, length: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 380) for _ in range(length)] for _ in range(n)]


def multi_turn(tiny: LoadedModel, e: LLMEngine, turns: int, sessions: list[list[int]],
               between: float = 0.0) -> list[RequestOutput]:
    """Each turn: every session sends its history plus a new user message, one at a time;
    each answer is checked against an unlimited-pool reference engine."""
    ref = exact_engine(tiny, num_device_blocks=512)
    rng = random.Random(1)
    outs = []
    for _ in range(turns):
        for i, history in enumerate(sessions):
            got, want = run(e, [history])[0], run(ref, [history])[0]
            assert same(got, want), (i, got.residency)
            outs.append(got)
            sessions[i] = history + got.token_ids + [rng.randrange(1, 380) for _ in range(9)]
        time.sleep(between)
    return outs


def test_sessions_evicted_from_the_device_wake_from_host_exactly(tiny: LoadedModel) -> None:
    # 12 device blocks hold ~1 session; 5 sessions of 40+ tokens take turns, so every later
    # turn finds its prefix gone from the device and on the host
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST)
    outs = multi_turn(tiny, e, 3, conversations(5))
    woken = [o for o in outs if o.residency == "host"]
    assert len(woken) >= 8 and all(o.num_restored_tokens > 0 for o in woken)
    assert all(o.restore_bytes == o.num_restored_tokens // 16 * e.runner.block_bytes
               for o in woken)
    stats = e.tier.manager.stats
    assert stats.loaded_blocks > 0 and stats.failed_loads == 0
    e.close()


def test_layerwise_wake_is_exact_too(tiny: LoadedModel) -> None:
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST, load_mode="layerwise")
    outs = multi_turn(tiny, e, 2, conversations(4, seed=2))
    assert sum(o.num_restored_tokens for o in outs) > 0
    e.close()


def test_load_mode_auto_is_async_on_a_cpu_and_an_explicit_choice_stands(tiny: LoadedModel) -> None:
    # on a CPU a layer-wise wake measured slower than an async one (benchmarks/wake.py)
    assert LoadMode.AUTO.on("cpu") is LoadMode.ASYNC
    assert LoadMode.AUTO.on("cuda") is LoadMode.LAYERWISE
    assert LoadMode.LAYERWISE.on("cpu") is LoadMode.LAYERWISE
    for asked, settled in (("auto", LoadMode.ASYNC), ("layerwise", LoadMode.LAYERWISE)):
        e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST, load_mode=asked)
        assert e.scheduler.policy.load_mode is settled
        e.close()


def test_swap_preemption_restores_the_whole_cache_including_the_partial_block(
    tiny: LoadedModel,
) -> None:
    # 10 blocks, 6 concurrent requests that grow past the pool: preemption must happen; with
    # preemption_mode=swap every victim's KV goes to host and comes back bit-exact
    prompts = conversations(6, seed=3, length=23)  # 23 tokens: a partial last block
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
    want = run(exact_engine(tiny, num_device_blocks=512), prompts, params)
    e = exact_engine(tiny, num_device_blocks=10, kv_offloading_size=HOST, preemption_mode="swap")
    got = run(e, prompts, params)
    assert e.scheduler.stats.num_swaps > 0 and e.scheduler.stats.num_recompute_preemptions == 0
    assert all(same(g, w) for g, w in zip(got, want))
    # their own state came back after preemption: swap-ins, not prompt tokens restored
    assert sum(g.num_swapped_in_tokens for g in got) > 0
    assert all(g.num_restored_tokens <= len(g.prompt_token_ids) for g in got)
    e.drain()  # in-flight write-through is all that may still hold blocks: let it land
    assert e.pool.num_used == 0
    e.close()


def test_recompute_mode_never_swaps(tiny: LoadedModel) -> None:
    prompts = conversations(6, seed=3, length=23)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    e = exact_engine(tiny, num_device_blocks=10, kv_offloading_size=HOST,
                     preemption_mode="recompute")
    got = run(e, prompts, params)
    assert e.scheduler.stats.num_swaps == 0 and e.scheduler.stats.num_preemptions > 0
    assert all(len(g.token_ids) == 30 for g in got)
    e.close()


def test_failed_loads_become_recomputes_and_are_counted(tiny: LoadedModel) -> None:
    # every host->device load fails (injected): answers are still exact, each failure is
    # counted, and no failed load is reported as a restore
    e = exact_engine(tiny, Faults(link=every_load), num_device_blocks=12, kv_offloading_size=HOST)
    outs = multi_turn(tiny, e, 2, conversations(4, seed=4))
    assert e.tier.manager.stats.failed_loads > 0
    assert all(o.num_restored_tokens == 0 and o.restore_bytes == 0 for o in outs)
    assert any(o.residency == "recomputed" and o.num_recomputed_tokens > 0 for o in outs)
    e.close()


def test_failed_layerwise_loads_discard_the_step_and_recompute(tiny: LoadedModel) -> None:
    e = exact_engine(tiny, Faults(link=lambda job, step: every_load(job, step) and step == 1),
                     num_device_blocks=12, kv_offloading_size=HOST, load_mode="layerwise")
    multi_turn(tiny, e, 2, conversations(4, seed=5))
    assert e.tier.manager.stats.failed_loads > 0
    e.close()


def test_idle_sessions_are_demoted_without_pressure(tiny: LoadedModel) -> None:
    # a roomy device pool never evicts; idle_offload_s demotes what sat unused for 20 ms
    e = exact_engine(tiny, num_device_blocks=256, kv_offloading_size=HOST, idle_offload_s=0.02)
    outs = multi_turn(tiny, e, 2, conversations(3, seed=6), between=0.05)
    assert e.tier.demoted_blocks > 0
    assert [o.residency for o in outs[3:]] == ["host"] * 3
    e.close()


def test_write_back_stores_only_what_the_device_is_about_to_evict(tiny: LoadedModel) -> None:
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST,
                     kv_write_policy="write_back")
    outs = multi_turn(tiny, e, 3, conversations(5, seed=7))
    assert sum(o.num_restored_tokens for o in outs) > 0
    e.close()


def test_max_load_tokens_caps_each_restore(tiny: LoadedModel) -> None:
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST, max_load_tokens=16)
    outs = multi_turn(tiny, e, 2, conversations(4, seed=8, length=60))
    assert any(o.num_restored_tokens for o in outs)
    assert all(o.num_restored_tokens <= 16 for o in outs)
    e.close()


def test_abort_while_loading_releases_blocks_after_the_copy(tiny: LoadedModel) -> None:
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST)
    first = conversations(6, seed=9)
    for prompt in first:  # 6 x 3 blocks of prefix through a 12-block pool: the first is evicted
        run(e, [prompt])
    rid = e.add_request(first[0] + [5, 6, 7], PARAMS)
    e.step()  # admitted: its load is in flight
    assert rid in e.scheduler.loading
    e.abort(rid)
    for _ in range(5):
        e.step()
    assert not e.has_unfinished() and not e.tier.busy
    assert e.pool.num_used == 0
    e.pool.check_invariants()
    e.close()


def test_offloading_needs_prefix_caching_and_a_sane_size(tiny: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        exact_engine(tiny, num_device_blocks=8, kv_offloading_size=HOST,
                     enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="available host RAM"):
        exact_engine(tiny, num_device_blocks=8, kv_offloading_size=100_000)
    with pytest.raises(ConfigError, match="preemption_mode='sometimes'"):
        EngineConfig.from_knobs(preemption_mode="sometimes")
