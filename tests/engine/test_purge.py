"""A purge that can be proven (issue 45): a prompt's blocks leave the device, the host and
every tier below, their disk slots overwritten (the raw file holds none of their bytes), the
shared directory's files and the Valkey keys deleted; a restart on the same disk finds
nothing of them and computes the prompt again, exactly; another prompt's blocks stay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.sequence import KvHints, SamplingParams
from kvtier.tier import BlockKey, hash_blocks

TIERS = {"kv_offloading_size": 0.02, "disk_kv_size": 0.01, "disk_kv_read_gbps": 2.0}
BASE = {"num_device_blocks": 48, "batch_invariant": True}
GONE = [10 + (i * 13) % 300 for i in range(100)]  # six full blocks of 16 tokens, and some
KEPT = [20 + (i * 7) % 250 for i in range(100)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def engine(tiny: LoadedModel, **knobs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_knobs(model=tiny.source, **BASE, **knobs), loaded=tiny)


def serve(e: LLMEngine, prompt: list[int]) -> Any:
    rid = e.add_request(prompt, PARAMS)
    return e.run_to_completion([rid])[rid]


def keys_of(e: LLMEngine, prompt: list[int]) -> list[BlockKey]:
    return hash_blocks(e.namespace(), prompt, e.scheduler.block_size)


def written_down(e: LLMEngine, *prompts: list[int]) -> list[Any]:
    """Serve each prompt, then demote every cached block: host, and on to every tier below."""
    outs = [serve(e, p) for p in prompts]
    e.demote_cached()
    e.drain()
    return outs


def after_restart(again: LLMEngine, residency: str, reference: Any) -> None:
    """A restarted engine (`again`, closed here) restores the prompt that was kept from
    `residency` and computes the purged one anew, token for token."""
    try:
        woken = serve(again, KEPT)  # the other prompt is still there
        assert woken.residency.value == residency and woken.num_restored_tokens == 96
        fresh = serve(again, GONE)
        assert fresh.residency.value == "new" and fresh.num_restored_tokens == 0
        assert fresh.token_ids == reference.token_ids  # computed again, exactly
    finally:
        again.close()


def test_a_purged_prompt_is_gone_from_the_disk_file_and_a_restart_computes_it_again(
        tiny: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "kv"
    e = engine(tiny, **TIERS, disk_kv_path=str(path))
    reference, _ = written_down(e, GONE, KEPT)
    gone, kept = keys_of(e, GONE), keys_of(e, KEPT)
    disk = max(path.iterdir(), key=lambda f: f.stat().st_size)  # the slot file
    raw = disk.read_bytes()
    assert all(k in raw for k in gone + kept)  # each header carries its key
    out = e.purge(GONE)
    assert out["blocks"] == len(gone) == 6
    assert out["host_blocks"] == 6 and out["host_in_use"] == 0
    assert out["erased"] == {"disk": 6} and out["erase_failures"] == {}
    raw = disk.read_bytes()
    assert not any(k in raw for k in gone)  # the headers are gone...
    assert all(k in raw for k in kept)  # ...and only theirs
    report = e.tier.report().below
    assert report is not None and report.erased_blocks == {"disk": 6}
    e.close()
    after_restart(engine(tiny, **TIERS, disk_kv_path=str(path)), "disk", reference)


def test_the_payload_bytes_are_overwritten_not_only_the_header(tiny: LoadedModel,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "kv"
    e = engine(tiny, **TIERS, disk_kv_path=str(path))
    try:
        written_down(e, GONE)
        disk = max(path.iterdir(), key=lambda f: f.stat().st_size)
        before = disk.read_bytes()
        e.purge(GONE)
        after = disk.read_bytes()
        changed = [i for i in range(0, len(before), 4096) if before[i:i + 4096] !=
                   after[i:i + 4096]]
        assert changed  # the slots were written...
        # ...and every page that changed holds zeros now: header and payload alike
        assert all(after[i:i + 4096] == bytes(len(after[i:i + 4096])) for i in changed)
        nonzero_before = sum(1 for i in changed if before[i:i + 4096].strip(b"\0"))
        assert nonzero_before > 6  # payload pages, not six headers only
    finally:
        e.close()


def test_a_purge_deletes_the_shared_directory_files_and_the_valkey_keys(
        tiny: LoadedModel, tmp_path: Path, valkey_server: Any) -> None:
    shared = tmp_path / "shared"
    url = f"valkey://127.0.0.1:{valkey_server.port}/0"
    stores = {"kv_offloading_size": 0.02,
              "kv_stores": {"fs": {"path": str(shared)}, "redis": {"url": url}}}
    e = engine(tiny, **stores)
    try:
        reference, _ = written_down(e, GONE, KEPT)
        files = {f for f in shared.rglob("*") if f.is_file()}
        with valkey_server.client() as client:
            stored = set(client.scan_iter(count=1000))
        assert len(files) >= 12 and len(stored) >= 12
        out = e.purge(GONE)
        # a shared store is asked for every key the prompt could have left there: one per
        # token (its six full blocks, and each part of a block a breakpoint could have kept)
        assert out["erased"] == {"fs": 100, "remote": 100} and out["erase_failures"] == {}
        left = {f for f in shared.rglob("*") if f.is_file()}
        with valkey_server.client() as client:
            remaining = set(client.scan_iter(count=1000))
        assert len(files - left) == 6 and len(stored - remaining) == 6
    finally:
        e.close()
    # a restart: an empty host over the same stores
    after_restart(engine(tiny, **stores), "remote", reference)


def test_a_store_that_cannot_erase_says_so(tiny: LoadedModel, valkey_server: Any) -> None:
    url = f"valkey://127.0.0.1:{valkey_server.port}/0"
    e = engine(tiny, kv_offloading_size=0.02, remote_kv_url=url)
    try:
        written_down(e, GONE)
        valkey_server.close()  # gone: its keys cannot be deleted now
        out = e.purge(GONE)
        assert out["host_blocks"] == 6  # what could go, went
        assert out["erase_failures"] == {"remote": 100}  # never a silent success
    finally:
        e.close()


def test_a_purge_keeps_what_a_running_request_uses_and_says_so(tiny: LoadedModel) -> None:
    e = engine(tiny, kv_offloading_size=0.02)
    try:
        serve(e, GONE)
        rid = e.add_request([*GONE, 5, 6, 7], PARAMS)
        e.step()  # admitted: it holds the prefix's device blocks
        out = e.purge(GONE)
        assert out["device_in_use"] == 6 and out["device_blocks"] == 0
        e.run_to_completion([rid])
        e.drain()  # its write-through lands (the purge had taken the host's copies too)
        assert e.purge(GONE)["device_blocks"] == 6  # free now: gone
    finally:
        e.close()


def test_a_tenant_purge_erases_every_block_it_owns_from_the_disk_file(
        tiny: LoadedModel, tmp_path: Path) -> None:
    path = tmp_path / "kv"
    e = engine(tiny, **TIERS, disk_kv_path=str(path))
    try:
        for prompt, tenant in ((GONE, "a"), (KEPT, "a"), (KEPT, "b")):
            rid = e.add_request(prompt, PARAMS, cache_salt=tenant, hints=KvHints(tenant=tenant))
            e.run_to_completion([rid])
        e.demote_cached()
        e.drain()
        owned = hash_blocks(e.namespace("a"), GONE, 16) + hash_blocks(e.namespace("a"), KEPT, 16)
        other = hash_blocks(e.namespace("b"), KEPT, 16)
        disk = max(path.iterdir(), key=lambda f: f.stat().st_size)
        assert all(k in disk.read_bytes() for k in owned + other)
        out = e.purge_tenant("a")
        raw = disk.read_bytes()
        assert out["tenant"] == "a" and out["blocks"] >= 12 and out["erase_failures"] == {}
        assert not any(k in raw for k in owned)  # erased, header and all
        assert all(k in raw for k in other)  # b's copy of the same prompt stays
        assert e.purge_tenant("a")["blocks"] == 0  # nothing of a's is remembered
    finally:
        e.close()
