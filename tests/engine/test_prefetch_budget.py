"""A prefetch is a client's hint, nothing computed: each tenant's prefetches may bring up at
most about half the host per 10 s (`prefetch_budget.py`). Before, a loop of prefetches read
whatever it named from disk (7,950 blocks at 266-365 calls a second) and pushed other
tenants' sessions off host; now the blocks past the budget stay below, counted."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.sequence import KvHints, SamplingParams

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model, on host
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SESSIONS = [[(s * 41 + i * 7) % 380 + 1 for i in range(64)] for s in range(6)]  # 4 blocks


def test_a_loop_of_prefetches_brings_up_half_the_host_and_counts_the_rest(
        tiny: LoadedModel, tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig.from_knobs(
        model=tiny.source, num_device_blocks=48, batch_invariant=True,
        kv_offloading_size=12 * BLOCK_GIB, disk_kv_path=str(tmp_path / "kv"),
        disk_kv_size=60 * BLOCK_GIB), loaded=tiny)
    try:
        for prompt in SESSIONS:  # 24 blocks: the first sessions go down to disk
            rid = engine.add_request(prompt, PARAMS, hints=KvHints(tenant="mallory"))
            engine.run_to_completion([rid])
            engine.drain()
            engine.demote_cached()
            engine.drain()
        answers = []
        for _ in range(20):  # the loop: every session, again and again
            for prompt in SESSIONS:
                answers.append(engine.prefetch(prompt, tenant="mallory"))
                engine.drain()
        other = engine.prefetch(SESSIONS[0], tenant="victim")  # another tenant's budget
        counts = engine.tier.report().tenants["mallory"]
    finally:
        engine.close()
    fetched = sum(a["fetching_blocks"] for a in answers)
    limited = sum(a["limited_blocks"] for a in answers)
    # half of 12 host slots, one session taken below empty, and what refilled meanwhile
    assert 0 < fetched <= 6 + 4 + 1
    assert counts.prefetched == fetched and counts.prefetch_limited == limited > 0
    assert other["limited_blocks"] == 0
