"""kv_offload_dtype: blocks leave the device in 8 bits (host memory holds ~4x more, disk and
Redis get the same bytes), a session restored from them is tagged lossy, and a lossy block
is never found by an exact engine (or the reverse). The knob's validation, which needs no
model, is tests/tier/test_lossy_knobs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

BASE = {"num_device_blocks": 48, "batch_invariant": True, "kv_offloading_size": 0.02}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
FIRST = [10 + (i * 13) % 300 for i in range(100)]


def serve(tiny: LoadedModel, ids: list[int], **knobs: Any) -> tuple[Any, dict[str, Any]]:
    """One request on a fresh engine, closed after; its output and the deep-tier stats (with
    the exact size of one block under "block_bytes")."""
    engine = LLMEngine(EngineConfig.from_knobs(model="tiny", **{**BASE, **knobs}), loaded=tiny)
    try:
        rid = engine.add_request(ids, PARAMS)
        out = engine.run_to_completion([rid])[rid]
        engine.drain()
        deep = engine_stats(engine, RequestLog())["tiers_below_host"] or {}
        return out, {**deep, "block_bytes": engine.runner.block_bytes}
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_lossy_restore_is_tagged_close_and_smaller(dtype: str, tiny: LoadedModel,
                                                   tmp_path: Path) -> None:
    disk = {"disk_kv_path": str(tmp_path / "kv"), "disk_kv_size": 0.01, "kv_offload_dtype": dtype,
            "disk_kv_read_gbps": 2.0}  # a steady planner call for the tiny model
    first, written = serve(tiny, FIRST, **disk)
    assert first.residency == "new" and not first.lossy
    ids = [*FIRST, *first.token_ids, 3, 4, 5]
    out, stats = serve(tiny, ids, **disk)
    reference, _ = serve(tiny, ids, kv_offloading_size=0)
    assert out.residency == "disk" and out.lossy and out.num_restored_tokens == 96
    assert not reference.lossy
    log = RequestLog()
    log.add([out, reference])
    assert log.restore_summary()["requests_restored_lossy"] == 1  # LLM.stats() reports it
    # 8-bit payloads: a quarter of float32's bytes, plus one float32 scale per head slab
    exact = stats["block_bytes"]
    assert stats["fetched_bytes"]["disk"] / stats["fetched_blocks"]["disk"] < 0.3 * exact
    assert written["written_bytes"]["disk"] / written["written_blocks"]["disk"] < 0.3 * exact
    # close, not bit-exact: the greedy tokens' logprobs within a small margin
    for got, want in zip(out.logprobs, reference.logprobs):
        token = next(iter(want))
        if token in got:
            assert abs(got[token] - want[token]) < 0.1


def test_exact_and_lossy_engines_never_share_blocks(tiny: LoadedModel, tmp_path: Path) -> None:
    disk = {"disk_kv_path": str(tmp_path / "kv"), "disk_kv_size": 0.01}
    first, _ = serve(tiny, FIRST, **disk, kv_offload_dtype="int8")
    ids = [*FIRST, *first.token_ids, 3, 4, 5]
    out, stats = serve(tiny, ids, **disk)  # exact engine, lossy blocks on disk
    assert out.residency == "new" and not out.lossy and stats["fetched_blocks"] == {}


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_host_tier_holds_8bit_blocks_and_wakes_from_them(load_mode: str,
                                                         tiny: LoadedModel) -> None:
    exact = LLMEngine(EngineConfig.from_knobs(model="tiny", **BASE), loaded=tiny)
    lossy = LLMEngine(EngineConfig.from_knobs(model="tiny", **BASE, kv_offload_dtype="int8",
                                              load_mode=load_mode), loaded=tiny)
    try:
        # the same GiB holds ~4x the blocks: float32 block vs its int8 codes plus scales
        assert lossy.tier.worker.host.num_slots > 3.5 * exact.tier.worker.host.num_slots
        first = lossy.run_to_completion([lossy.add_request(FIRST, PARAMS)])
        out1 = next(iter(first.values()))
        lossy.drain()
        lossy.demote_cached()  # the session went idle: only its 8-bit copy is left
        ids = [*FIRST, *out1.token_ids, 3, 4, 5]
        rid = lossy.add_request(ids, PARAMS)
        out = lossy.run_to_completion([rid])[rid]
        ref = exact.run_to_completion([exact.add_request(ids, PARAMS)])
        want = next(iter(ref.values()))
    finally:
        lossy.close()
        exact.close()
    assert out.residency == "host" and out.lossy and out.num_restored_tokens == 96
    assert not want.lossy
    for got, expected in zip(out.logprobs, want.logprobs):
        token = next(iter(expected))
        if token in got:
            assert abs(got[token] - expected[token]) < 0.1
