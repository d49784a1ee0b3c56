"""A disk that turns slow: the wake from it ends by its deadline, serves the blocks that
landed, recomputes the rest (the answer is a tier-less run's, token by token and logprob by
logprob), counts the rest as "deadline" misses but keeps them on disk, and the planner
recomputes the next wake from that disk instead of waiting on it again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import EngineConfig
from kvtier.engine.faults import EngineFaults
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams
from kvtier.tier import Faults, Job
from kvtier.tier.keys import Medium, hash_blocks

BASE = {"num_device_blocks": 48, "batch_invariant": True, "kv_offloading_size": 0.02,
        "disk_kv_size": 0.01, "disk_kv_read_gbps": 2.0}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
BLOCK = 16
SLOW_READ_S = 0.3  # each block read from the slow disk
SLACK_S = 0.3


def engine(tiny: LoadedModel, path: Path | None, faults: Faults | None = None) -> LLMEngine:
    knobs = {**BASE, "disk_kv_path": str(path)} if path else {"num_device_blocks": 48,
                                                              "batch_invariant": True}
    return LLMEngine(EngineConfig.from_knobs(model="tiny", **knobs), loaded=tiny,
                     faults=EngineFaults(tier=faults) if faults else None)


def run(e: LLMEngine, ids: list[int]) -> Any:
    rid = e.add_request(ids, PARAMS)
    return e.run_to_completion([rid])[rid]


def slow_disk(job: Job, index: int) -> float:
    return SLOW_READ_S if job.dst is Medium.HOST else 0.0


def test_a_slow_disk_wake_ends_by_its_deadline(tiny: LoadedModel, tmp_path: Path) -> None:
    first = [10 + (i * 13 + 7) % 300 for i in range(100)]
    a = engine(tiny, tmp_path / "kv")
    out = run(a, first)
    a.close()  # its blocks go down to disk at shutdown
    ids = [*first, *out.token_ids, 3, 4, 5, 6]
    plain = engine(tiny, None)
    reference = run(plain, ids)
    plain.close()
    b = engine(tiny, tmp_path / "kv", Faults(slow=slow_disk))
    try:
        woken = run(b, ids)
        deep = engine_stats(b, RequestLog())["tiers_below_host"]
        manager = b.tier.manager
        keys = hash_blocks(b.namespace(), ids, BLOCK)[:6]
        # 6 blocks on disk, two readers, each block's read 0.3 s late, deadline 0.5 s:
        # blocks 0-1 land at 0.3 s; 2-3 are ready at 0.6 s, past it (misses); 4-5 are never
        # waited for. The wake ends one slow read past its deadline, at most.
        assert woken.token_ids == reference.token_ids and woken.logprobs == reference.logprobs
        assert woken.residency == "disk" and woken.num_restored_tokens == 2 * BLOCK
        assert deep["misses"] == {"disk:deadline": 4}
        assert deep["fetch_seconds"]["disk"] < 0.5 + SLOW_READ_S + SLACK_S
        assert all(manager.below.holds(k) for k in keys)  # slow, not bad: still on disk
        assert "disk" in manager.planner.slowdowns
        decision = manager.decide(6 * BLOCK, 6 * manager.block_bytes, via="disk")
        assert decision.choice == "recompute"  # the next wake from this disk
    finally:
        b.close()
