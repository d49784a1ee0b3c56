"""A cache breakpoint inside a block matches exactly: the tokens before it in that block go
down to host under their own key, and a later request whose prompt agrees up to the
breakpoint loads them into a block of its own, ending its match at the breakpoint, with the
tokens a run without any tier produces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.output import RequestOutput
from kvtier.sequence import KvHints, SamplingParams
from kvtier.tier import PrefixRetention

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model, on host
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM = [10 + (i * 13) % 300 for i in range(96)]  # six blocks of 16
MARK = (PrefixRetention(40, 3600.0),)  # 40 tokens: two full blocks and 8 of the third
# the same first 40 tokens, then a different question: block 2 differs after token 40
TURN = [*SYSTEM[:40], *[200 + i for i in range(30)]]


def engine_of(tiny: LoadedModel, tier: bool = True, **knobs: Any) -> LLMEngine:
    base: dict[str, Any] = {"num_device_blocks": 48, "batch_invariant": True}
    if tier:
        base |= {"kv_offloading_size": 32 * BLOCK_GIB, "load_policy": "always"}
    return LLMEngine(EngineConfig.from_knobs(model=tiny.source, **base, **knobs), loaded=tiny)


def ask(engine: LLMEngine, prompt: list[int], **hints: Any) -> RequestOutput:
    rid = engine.add_request(prompt, PARAMS, hints=KvHints(**hints))
    out = engine.run_to_completion([rid])[rid]
    engine.drain()  # its blocks are down on host before the next request
    return out


@pytest.fixture(scope="module")
def plain(tiny: LoadedModel) -> dict[int, list[int]]:
    """Each prompt's tokens from an engine without any tier (or prefix to share)."""
    engine = engine_of(tiny, tier=False, enable_prefix_caching=False)
    try:
        return {len(p): ask(engine, p).token_ids for p in (TURN, SYSTEM[:40], SYSTEM[:40] + TURN)}
    finally:
        engine.close()


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_a_breakpoint_inside_a_block_is_read_back_to_the_token(
        tiny: LoadedModel, plain: dict[int, list[int]], load_mode: str) -> None:
    engine = engine_of(tiny, load_mode=load_mode)
    try:
        first = ask(engine, SYSTEM, prefixes=MARK)
        engine.demote_cached()  # nothing left on the device: all of it comes from host
        out = ask(engine, TURN)
    finally:
        engine.close()
    assert first.exact_breakpoints == (40,)
    [grant] = first.hint_reply.prefixes
    assert grant.value == 3600.0 and grant.blocks == 3  # two full blocks and the part
    assert out.num_read_tokens == 40 and out.num_restored_tokens == 40
    assert out.residency == "host"
    assert out.token_ids == plain[len(TURN)]


def test_the_part_completes_a_device_prefix_and_no_other_prompt_matches_it(
        tiny: LoadedModel, plain: dict[int, list[int]]) -> None:
    engine = engine_of(tiny)
    try:
        ask(engine, SYSTEM, prefixes=MARK)
        out = ask(engine, TURN)  # blocks 0-1 still on the device, the part from host
        # agrees up to token 36 only: the part (8 tokens) is not its prefix
        other = ask(engine, [*SYSTEM[:36], *[300 + i for i in range(34)]])
    finally:
        engine.close()
    assert (out.num_cached_tokens, out.num_restored_tokens) == (32, 8)
    assert out.token_ids == plain[len(TURN)]
    assert (other.num_cached_tokens, other.num_restored_tokens) == (32, 0)


def test_a_prompt_that_ends_at_its_breakpoint_writes_it_and_the_next_turn_reads_it(
        tiny: LoadedModel, plain: dict[int, list[int]]) -> None:
    """Anthropic's top-level cache_control marks the end of the prompt: the next turn, the
    same prompt and more, reads every token of it."""
    engine = engine_of(tiny)
    try:
        first = ask(engine, SYSTEM[:40], prefixes=MARK)
        out = ask(engine, SYSTEM[:40] + TURN)
    finally:
        engine.close()
    assert first.exact_breakpoints == (40,) and first.num_cache_write_tokens == 40
    assert out.num_read_tokens == 40
    assert first.token_ids == plain[40]
    assert out.token_ids == plain[40 + len(TURN)]


def test_after_a_restart_the_part_comes_up_from_disk_with_its_blocks(
        tiny: LoadedModel, plain: dict[int, list[int]], tmp_path: Path) -> None:
    disk = {"disk_kv_path": str(tmp_path / "kv"), "disk_kv_size": 0.001,
            "disk_kv_read_gbps": 2.0}
    engine = engine_of(tiny, **disk)
    try:
        ask(engine, SYSTEM, prefixes=MARK)
    finally:
        engine.close()
    engine = engine_of(tiny, **disk)  # an empty host: all of it is on disk
    try:
        out = ask(engine, TURN)
    finally:
        engine.close()
    assert out.residency == "disk" and out.num_restored_tokens == 40
    assert out.token_ids == plain[len(TURN)]


def test_without_a_host_tier_the_breakpoint_keeps_the_blocks_before_it(
        tiny: LoadedModel) -> None:
    engine = engine_of(tiny, tier=False)
    try:
        first = ask(engine, SYSTEM, prefixes=MARK)
        out = ask(engine, TURN)
    finally:
        engine.close()
    assert first.exact_breakpoints == ()
    assert out.num_read_tokens == 32


def test_a_purge_of_the_prompt_removes_its_parts_too(tiny: LoadedModel, tmp_path: Path
                                                     ) -> None:
    engine = engine_of(tiny)
    try:
        ask(engine, SYSTEM, prefixes=MARK)
        purged = engine.purge(SYSTEM)
        engine.demote_cached()
        out = ask(engine, TURN)
    finally:
        engine.close()
    assert purged["host_blocks"] == 7  # the six full blocks and the part
    assert out.num_read_tokens == 0
