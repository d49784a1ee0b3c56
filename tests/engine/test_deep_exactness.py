"""Property: with a host tier too small to hold the sessions and a disk tier below it, any
interleaving of new sessions, turns, idle demotions and restarts answers exactly as an
unlimited device pool does, and blocks really come back up from disk."""

from __future__ import annotations

import random
import time
from pathlib import Path

from conftest import output_key
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams
from kvtier.tier import Medium

ACTIONS = st.lists(
    st.tuples(st.sampled_from(["new", "turn", "turn", "idle", "restart"]),
              st.integers(0, 10**6)),
    min_size=4, max_size=12,
)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS, host_slots=st.integers(8, 24), policy=st.sampled_from(["lru", "arc"]))
def test_any_interleaving_with_disk_matches_an_unlimited_pool(
    tiny: LoadedModel, tmp_path: Path, actions: list[tuple[str, int]], host_slots: int,
    policy: str,
) -> None:
    directory = tmp_path / f"kv-{random.random()}"
    block_bytes = 0

    def build() -> LLMEngine:
        host_gib = host_slots * (block_bytes or 8192) / 1024**3
        return LLMEngine(EngineConfig.from_knobs(
            model="tiny", batch_invariant=True, num_device_blocks=16, idle_offload_s=0.005,
            kv_offloading_size=host_gib, disk_kv_path=str(directory), disk_kv_size=0.01,
            disk_kv_read_gbps=2.0,  # a steady planner call for the tiny model
            eviction_policy=policy, max_num_batched_tokens=48), loaded=tiny)

    ref = LLMEngine(EngineConfig.from_knobs(model="tiny", batch_invariant=True,
                                            num_device_blocks=1024), loaded=tiny)
    e = build()
    block_bytes = e.runner.block_bytes
    sessions: list[list[int]] = []
    cold: set[int] = set()  # sessions written down by a restart and not asked since
    try:
        for action, seed in actions:
            rng = random.Random(seed)
            if action == "restart":  # a clean shutdown, then a new process on the same disk
                e.close()
                e = build()
                cold = set(range(len(sessions)))
                continue
            if action == "idle":
                time.sleep(0.01)
                continue
            if action == "new" or not sessions:
                sessions.append([rng.randrange(1, 380) for _ in range(rng.randrange(17, 60))])
            i = len(sessions) - 1 if action == "new" else rng.randrange(len(sessions))
            params = SamplingParams(max_tokens=rng.randrange(3, 10), temperature=0.0,
                                    ignore_eos=True, logprobs=2)
            if len(sessions[i]) + params.max_tokens + 5 > e.max_model_len:
                sessions[i] = [rng.randrange(1, 380) for _ in range(17)]
                cold.discard(i)
            rid = e.add_request(sessions[i], params)
            got = e.run_to_completion([rid])[rid]
            r = ref.add_request(sessions[i], params)
            assert output_key(got) == output_key(ref.run_to_completion([r])[r])
            if i in cold:  # the whole conversation went down at shutdown: it comes back up
                assert got.residency == "disk" and got.num_restored_tokens >= 16
                event("a conversation woke from disk after a restart")
                cold.discard(i)
            sessions[i] = sessions[i] + got.token_ids + [rng.randrange(1, 380) for _ in range(5)]
        e.drain()
        assert not e.scheduler.running and e.pool.num_used == 0
        e.pool.check_invariants()
        e.tier.manager.host.check_invariants()
        disk = e.tier.manager.below.tier(Medium.DISK)
        disk.check_invariants()
        assert disk.stats.pinned == 0 and e.tier.manager.host.stats.pinned == 0
    finally:
        e.close()
