"""The engine's split of each TTFT into queue, tier and compute: the parts add up for every
residency class, a request held back by a full pool is charged queue time, and a host wake's
tier part grows with the bytes it restores."""

from __future__ import annotations

import random
import time
from pathlib import Path

from conftest import Armed

from kvtier.config import EngineConfig
from kvtier.engine.faults import EngineFaults
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog
from kvtier.model.loader import LoadedModel
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams
from kvtier.tier import Faults, Job, Medium
from kvtier.tier.faults import every_load

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
HOST = 0.02  # GiB
SLOW_LINK_S_PER_BLOCK = 0.002  # an emulated slow link: each loaded block costs 2 ms


def engine(tiny: LoadedModel, link: Armed | None = None, **knobs: object) -> LLMEngine:
    """`link`: the tier's link fault hook, armed by the test when it wants it."""
    faults = EngineFaults(tier=Faults(link=link)) if link else None
    return LLMEngine(EngineConfig.from_knobs(model="tiny", **knobs), loaded=tiny, faults=faults)


def ask(e: LLMEngine, prompt: list[int], params: SamplingParams = PARAMS) -> RequestOutput:
    rid = e.add_request(prompt, params)
    return e.run_to_completion([rid])[rid]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 380) for _ in range(n)]


def assert_adds_up(out: RequestOutput) -> None:
    m = out.metrics
    assert m.ttft_s is not None and None not in (m.queue_s, m.tier_s, m.compute_s), m
    parts = m.queue_s + m.tier_s + m.compute_s
    assert abs(parts - m.ttft_s) <= max(1e-3, 0.01 * m.ttft_s), (out.residency, m)
    assert min(m.queue_s, m.tier_s, m.compute_s) >= 0.0, m


def slow_loads(job: Job, step: int) -> bool:
    """A link fault hook that fails nothing but makes each load cost time per block."""
    if job.dst is Medium.DEVICE and step == 0:
        time.sleep(SLOW_LINK_S_PER_BLOCK * len(job.device_blocks))
    return False


def evict(e: LLMEngine, seed: int) -> None:
    """Fill the small device pool with other prompts, pushing earlier prefixes to host."""
    for k in range(3):
        ask(e, tokens(120, seed * 10 + k))
    e.drain()


def test_the_parts_add_up_for_every_residency_class(tiny: LoadedModel, tmp_path: Path) -> None:
    knobs = {"num_device_blocks": 16, "kv_offloading_size": HOST,
             "disk_kv_path": str(tmp_path / "kv"), "disk_kv_size": 0.01,
             "disk_kv_read_gbps": 2.0}
    e = engine(tiny, **knobs)
    outs: list[RequestOutput] = []
    a = tokens(100, 1)
    outs.append(ask(e, a))  # new
    outs.append(ask(e, [*a, 7, 8]))  # resident: its prefix is still on the device
    evict(e, 2)
    outs.append(ask(e, [*a, 7, 8, 9]))  # host
    e.close()
    failing = Armed(every_load)
    e = engine(tiny, failing, **knobs)  # a restart: the prefix comes back up from disk
    outs.append(ask(e, [*a, 7, 8, 9, 10]))
    failing.armed = True
    evict(e, 3)
    outs.append(ask(e, [*a, 7, 8, 9, 10, 11]))  # its load fails: recomputed
    e.close()
    seen = {o.residency for o in outs}
    assert seen == {"new", "resident", "host", "disk", "recomputed"}, seen
    for out in outs:
        assert_adds_up(out)
    by = {o.residency: o.metrics for o in outs}
    assert by["resident"].tier_s == 0.0 and by["new"].tier_s == 0.0
    assert by["host"].tier_s > 0 and by["disk"].tier_s > 0 and by["recomputed"].tier_s > 0
    log = RequestLog()  # what LLM.stats() reports as ttft_split_s
    log.add(outs)
    split = log.split_by_class()
    assert split["all"]["queue"]["count"] == len(outs)
    assert split["host"]["tier"]["p50"] == by["host"].tier_s
    assert split["remote"]["compute"]["count"] == 0


def test_layerwise_wakes_add_up_too(tiny: LoadedModel) -> None:
    slow = Armed(slow_loads)
    e = engine(tiny, slow, num_device_blocks=16, kv_offloading_size=HOST, load_mode="layerwise")
    a = tokens(100, 4)
    ask(e, a)
    evict(e, 5)
    slow.armed = True
    out = ask(e, [*a, 3])
    e.close()
    assert out.residency == "host"
    assert_adds_up(out)
    # the load overlaps the step; what did not overlap held the compute back: tier time
    assert out.metrics.tier_s > 0


def test_a_request_held_back_by_a_full_pool_is_charged_queue_time(tiny: LoadedModel) -> None:
    # 6 blocks of 16 tokens hold one 60-token prompt and its 30 outputs, not two prompts
    e = engine(tiny, num_device_blocks=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    rids = [e.add_request(tokens(60, 10 + k), params) for k in range(3)]
    outs = e.run_to_completion(rids)
    first, *held = (outs[r] for r in rids)
    for out in outs.values():
        assert_adds_up(out)
    assert all(h.metrics.queue_s > 5 * first.metrics.queue_s for h in held)
    assert all(h.metrics.queue_s > h.metrics.compute_s for h in held)
    assert held[1].metrics.queue_s > held[0].metrics.queue_s


def test_a_host_wakes_tier_part_grows_with_its_bytes(tiny: LoadedModel) -> None:
    slow = Armed(slow_loads)
    e = engine(tiny, slow, num_device_blocks=40, kv_offloading_size=HOST)
    short, long = tokens(40, 20), tokens(400, 21)
    ask(e, short)
    ask(e, long)
    e.demote_cached()  # both prefixes now live on host only
    slow.armed = True
    woke = [ask(e, [*short, 5]), ask(e, [*long, 5])]
    e.close()
    assert [o.residency for o in woke] == ["host", "host"]
    small, big = (o.metrics for o in woke)
    blocks = [o.restore_bytes // e.runner.block_bytes for o in woke]
    assert blocks[1] >= 8 * blocks[0]
    assert big.tier_s >= SLOW_LINK_S_PER_BLOCK * blocks[1]
    assert big.tier_s > small.tier_s + SLOW_LINK_S_PER_BLOCK * (blocks[1] - blocks[0]) / 2
    for out in woke:
        assert_adds_up(out)
