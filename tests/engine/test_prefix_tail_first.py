"""A full host takes a session's prefix from its tail (kvtier's engine, tiny model): the
session returns and restores the head it kept. Before, the host took the head first (stored
first, least recent), and the blocks left behind it were held but never served: 0 restored."""

from __future__ import annotations

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model, on host
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SESSION = [10 + (i * 13) % 300 for i in range(160)]  # ten blocks
TURN = [*SESSION, 5, 6, 7, 8]
OTHER = [(i * 31 + 7) % 380 + 1 for i in range(48)]  # three blocks of another prompt


def ask(engine: LLMEngine, prompt: list[int]) -> RequestOutput:
    rid = engine.add_request(prompt, PARAMS)
    out = engine.run_to_completion([rid])[rid]
    engine.drain()
    engine.demote_cached()  # as idle_offload_s would: nothing stays cached on the device
    engine.drain()
    return out


def test_a_full_host_keeps_a_session_head_and_the_session_restores_it(
        tiny: LoadedModel) -> None:
    knobs = {"model": tiny.source, "num_device_blocks": 48, "batch_invariant": True}
    plain = LLMEngine(EngineConfig.from_knobs(**knobs), loaded=tiny)
    try:
        reference = ask(plain, TURN)
    finally:
        plain.close()
    engine = LLMEngine(EngineConfig.from_knobs(**knobs, kv_offloading_size=12 * BLOCK_GIB),
                       loaded=tiny)
    try:
        ask(engine, SESSION)  # its ten blocks down to host (12 slots)
        ask(engine, OTHER)  # three more: one of the session's must go
        evictions = engine.tier.report().host.evictions
        out = ask(engine, TURN)
    finally:
        engine.close()
    assert evictions == 1
    assert out.token_ids == reference.token_ids
    assert out.residency == "host"
    assert out.num_restored_tokens == 9 * 16  # its head: all but the block that went
