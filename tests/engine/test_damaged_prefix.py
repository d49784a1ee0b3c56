"""A prefix with several damaged blocks on disk leaves the disk index in one fetch: after the
first bad block nothing of the prefix is served, but every later disk block is still read
and verified, so each bad one is dropped (with its own reason) and each good one stays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams
from kvtier.tier import Medium
from kvtier.tier.keys import hash_blocks

BLOCK = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
# Fixed read rates: the planner's call for the tiny model must not hang on this disk's speed.
BASE = {"num_device_blocks": 48, "batch_invariant": True, "kv_offloading_size": 0.02,
        "disk_kv_read_gbps": 2.0}


def engine(tiny: LoadedModel, **knobs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_knobs(model="tiny", **{**BASE, **knobs}), loaded=tiny)


def answer(e: LLMEngine, ids: list[int]) -> Any:
    rid = e.add_request(ids, PARAMS)
    return e.run_to_completion([rid])[rid]


def scribble(e: LLMEngine, key: bytes) -> None:
    """Flip one payload bit of `key`'s disk slot (its header stays valid)."""
    store = e.tier.worker.store(Medium.DISK).store
    slot = e.tier.manager.below.tier(Medium.DISK)._entries[key].slot
    offset = store._offset(slot) + store.header_area + 100
    with open(store.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_three_scribbled_blocks_of_one_prefix_all_leave_the_disk_index_in_one_fetch(
        tiny: LoadedModel, tmp_path: Path) -> None:
    disk = {"disk_kv_path": str(tmp_path / "kv"), "disk_kv_size": 0.01}
    first = [10 + (i * 13) % 300 for i in range(100)]
    a = engine(tiny, **disk)
    out = answer(a, first)
    a.close()  # a clean shutdown: the conversation's 6 full blocks are on disk
    ids = [*first, *out.token_ids, 3, 4, 5, 6]
    # write_back: nothing goes down to disk while the test reads the index afterwards
    b = engine(tiny, **disk, kv_write_policy="write_back")
    try:
        keys = hash_blocks(b.namespace(), ids, BLOCK)[:6]
        index = b.tier.manager.below.tier(Medium.DISK)
        assert [index.lookup([k]) for k in keys] == [1] * 6
        for key in keys[1:4]:  # block 0 still serves; 1, 2 and 3 are scribbled
            scribble(b, key)
        got = answer(b, ids)
        misses = engine_stats(b, RequestLog())["tiers_below_host"]["misses"]
        on_disk = [index.lookup([k]) for k in keys]
    finally:
        b.close()
    ref = engine(tiny, kv_offloading_size=0.0)
    try:
        expected = answer(ref, ids)
    finally:
        ref.close()
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs
    assert got.residency == "disk" and got.num_restored_tokens == BLOCK
    assert misses == {"disk:checksum": 3}  # each scribbled block counted once, by its reason
    assert on_disk == [1, 0, 0, 0, 1, 1]  # the bad ones are gone; the good ones after stay
