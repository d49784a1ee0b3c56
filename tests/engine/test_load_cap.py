"""`max_load_gbps`: the host -> device bandwidth a deployment gives wakes. The planner plans
loads at it, so a cap that makes a restore slower than its prefill turns the wake into a
recompute (counted as `slower`), with answers still bit for bit an unlimited pool's; bad
values are refused by name."""

from __future__ import annotations

import math
import random

import pytest
from conftest import exact_engine

from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel
from kvtier.output import Residency
from kvtier.sequence import SamplingParams
from kvtier.tier.config import TierConfig

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
HOST = 0.02  # GiB


def turns(tiny: LoadedModel, **knobs: object) -> tuple[list[Residency], dict, float]:
    """Six 40-token sessions take two turns each on a 12-block pool (four sessions' room),
    so every second turn finds its prefix on host; each answer checked against an
    unlimited pool. The residencies, the host tier's stats and the planner's link GB/s."""
    ref = exact_engine(tiny, num_device_blocks=512)
    e = exact_engine(tiny, num_device_blocks=12, kv_offloading_size=HOST, **knobs)
    rng = random.Random(3)
    sessions = [[rng.randrange(1, 380) for _ in range(40)] for _ in range(6)]
    residencies = []
    try:
        for _ in range(2):
            for i, history in enumerate(sessions):
                got = e.run_to_completion([rid := e.add_request(history, PARAMS)])[rid]
                want = ref.run_to_completion([r := ref.add_request(history, PARAMS)])[r]
                assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
                residencies.append(got.residency)
                sessions[i] = history + got.token_ids + [7, 8, 9]
        host = engine_stats(e, RequestLog())["host_tier"]
        return residencies, host, e.tier.manager.planner.calibration.link_gbps
    finally:
        e.close()
        ref.close()


def test_a_load_cap_below_the_prefills_pace_turns_wakes_into_counted_recomputes(
        tiny: LoadedModel) -> None:
    # The tiny model: an 8 KB block of 16 tokens, prefill ~1e5 tokens/s. At 0.01 GB/s a
    # 2-block restore takes ~1.6 ms against ~0.4 ms of prefill: recompute. Uncapped: restore.
    free, free_host, _ = turns(tiny)
    assert free.count(Residency.HOST) >= 4 and free_host["declined"] == {}
    capped, host, link_gbps = turns(tiny, max_load_gbps=0.01)
    assert link_gbps <= 0.01
    assert Residency.HOST not in capped and host["loaded_blocks"] == 0
    assert host["declined"].get("slower", 0) >= 4


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "2", True, 1e9])
def test_bad_load_caps_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_load_gbps"):
        TierConfig.of(kv_offloading_size=1, max_load_gbps=bad).validate()
