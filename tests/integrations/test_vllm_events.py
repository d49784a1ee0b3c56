"""kvtier's host tier published as vLLM's own KV events, under real vLLM (one start, a tiny
random Llama, a ZMQ subscriber in the driver decoding with vLLM's `KVEventBatch`): the blocks
kvtier stores appear as `BlockStored` with medium CPU under exactly the hashes (and parents,
tokens, extra keys, group) vLLM gave the same blocks in its GPU `BlockStored`, as
`BlockRemoved` CPU once kvtier's host tier evicts them, and as `BlockStored` STORAGE once
their disk writes land."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import BLOCK_SIZE, VOCAB, kv_bytes_per_block
from vllm_run import ONE_PROCESS, parse, run_vllm

pytestmark = pytest.mark.vllm

GIB = 1024**3
PROMPT = 10 * BLOCK_SIZE  # 10 full blocks, all stored once computed
HOST_SLOTS = 10  # one prompt's blocks: the second prompt evicts all of the first's
# fields of a BlockStored that differ block by block (or by where it was stored)
PER_BLOCK = {"block_hashes", "parent_block_hash", "token_ids", "extra_keys", "medium"}


def per_block(events: list[dict[str, Any]], medium: str) -> dict[tuple[int, ...], dict]:
    """Every block `BlockStored` on `medium` announced, by its token ids: its hash, parent,
    extra keys, and the rest of the event's fields (group, its kind, LoRA, block size...)."""
    out = {}
    for e in events:
        if e["type"] != "BlockStored" or e["medium"] != medium:
            continue
        parent, bs = e["parent_block_hash"], e["block_size"]
        extra = e.get("extra_keys") or [None] * len(e["block_hashes"])
        shared = {k: v for k, v in e.items() if k not in PER_BLOCK}
        for i, (h, keys) in enumerate(zip(e["block_hashes"], extra)):
            out[tuple(e["token_ids"][i * bs:(i + 1) * bs])] = {
                **shared, "hash": h, "parent": parent, "extra_keys": keys}
            parent = h
    return out


def removed_at(events: list[dict[str, Any]], medium: str) -> dict[Any, int]:
    """Each hash `BlockRemoved` on `medium`, with the position of its first removal."""
    out: dict[Any, int] = {}
    for n, e in enumerate(events):
        if e["type"] == "BlockRemoved" and e["medium"] == medium:
            for h in e["block_hashes"]:
                out.setdefault(h, n)
    return out


def blocks(prompt: list[int]) -> list[tuple[int, ...]]:
    return [tuple(prompt[i:i + BLOCK_SIZE]) for i in range(0, PROMPT, BLOCK_SIZE)]


def test_host_residency_is_published_under_vllms_own_block_hashes(
        vllm_python: Path, tiny_hf: Callable[[str], Path], tmp_path: Path) -> None:
    rng = random.Random(7)
    a, b = ([rng.randrange(10, VOCAB) for _ in range(PROMPT)] for _ in range(2))
    nbytes = kv_bytes_per_block("llama")
    run = parse(run_vllm(vllm_python, tiny_hf("llama"), {
        "connector": {"kv_offloading_size": HOST_SLOTS * nbytes / GIB,
                      "disk_kv_path": str(tmp_path / "kv"),
                      "disk_kv_size": 4 * HOST_SLOTS * nbytes / GIB},
        "blocks": 24, "prompts": [a, b], "block_size": BLOCK_SIZE, "kv_bytes_per_block": nbytes,
        "max_model_len": PROMPT + 2 * BLOCK_SIZE, "kv_events": True}, env=ONE_PROCESS).stdout)
    events = run["kv_events"]
    assert {e["medium"] for e in events if "medium" in e} == {"GPU", "CPU", "STORAGE"}
    gpu, cpu = per_block(events, "GPU"), per_block(events, "CPU")
    disk = per_block(events, "STORAGE")
    # every block kvtier stored, on host and on disk, is announced exactly as vLLM
    # announced its GPU copy
    for prompt in (a, b):
        assert all(cpu[blk] == gpu[blk] for blk in blocks(prompt)), "CPU and GPU disagree"
        assert all(disk[blk] == gpu[blk] for blk in blocks(prompt)), "disk and GPU disagree"
    assert not removed_at(events, "STORAGE")  # the disk holds both prompts
    assert cpu[blocks(a)[0]]["parent"] is None and cpu[blocks(a)[0]]["group_idx"] == 0
    # b's store evicted all of a's blocks from kvtier's host tier: each withdrawn, after its
    # store was announced; b's are still there
    gone = removed_at(events, "CPU")
    stored_at = {h: n for n, e in enumerate(events) if e["type"] == "BlockStored"
                 and e["medium"] == "CPU" for h in e["block_hashes"]}
    for blk in blocks(a):
        h = cpu[blk]["hash"]
        assert h in gone and gone[h] > stored_at[h]
    assert not any(cpu[blk]["hash"] in gone for blk in blocks(b))
