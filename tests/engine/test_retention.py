"""The client steers its KV under kvtier's engine: a retained prefix survives another tenant's
flood of host and disk, a retention over quota is refused and counted, deadlines expire and
survive a restart, an expect-return hint stages a session up to host before it returns, and
bad values are refused. Tokens equal a run without the tier in every case."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import RequestError
from kvtier.model.loader import LoadedModel
from kvtier.output import RequestOutput
from kvtier.sequence import KvHints, SamplingParams
from kvtier.tier import PrefixRetention, hash_blocks

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model, on host
BASE = {"num_device_blocks": 48, "batch_invariant": True}
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = [10 + (i * 13) % 300 for i in range(96)]  # six blocks: the victim's system prompt
TURN = [*SYSTEM, 5, 6, 7, 8]


def tiers(tmp_path: Path, host_blocks: int = 24, **knobs: Any) -> dict[str, Any]:
    return {**BASE, "kv_offloading_size": host_blocks * BLOCK_GIB, "disk_kv_size": 0.0004,
            "disk_kv_path": str(tmp_path / "kv"), "disk_kv_read_gbps": 2.0, **knobs}


def engine_of(tiny: LoadedModel, **knobs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_knobs(model=tiny.source, **knobs), loaded=tiny)


def ask(engine: LLMEngine, prompt: list[int], salt: str = "", **hints: Any) -> RequestOutput:
    rid = engine.add_request(prompt, PARAMS, cache_salt=salt,
                             hints=KvHints(tenant=salt, **hints))
    out = engine.run_to_completion([rid])[rid]
    engine.drain()  # its blocks are down on host and disk before the next request
    return out


def flood(engine: LLMEngine, requests: int = 30) -> None:
    """A noisy tenant's burst of distinct five-block prompts (more than device, host and
    disk hold together), then the idle demotion `idle_offload_s` makes: nothing is left
    cached on the device."""
    for r in range(requests):
        ask(engine, [(r * 31 + i * 7) % 380 + 1 for i in range(80)], "noisy")
    engine.demote_cached()


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> RequestOutput:
    engine = engine_of(tiny, **BASE)
    try:
        rid = engine.add_request(TURN, PARAMS)
        return engine.run_to_completion([rid])[rid]
    finally:
        engine.close()


@pytest.mark.parametrize("retained", [True, False])
def test_a_noisy_tenant_cannot_evict_a_retained_system_prompt(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput, retained: bool) -> None:
    engine = engine_of(tiny, **tiers(tmp_path))
    try:
        first = ask(engine, SYSTEM, "victim", retention_s=3600.0 if retained else None)
        assert first.retention == (3600.0 if retained else None)
        flood(engine)
        out = ask(engine, TURN, "victim")
        tenants = engine.tier.report().tenants
    finally:
        engine.close()
    assert out.token_ids == reference.token_ids
    if retained:  # it wakes from host, all six blocks, after the flood
        assert out.residency == "host" and out.num_restored_tokens == 96
        assert tenants["victim"].retained["host"] == 6
        assert tenants["noisy"].evictions["host"] > 0 and tenants["victim"].evictions == {}
    else:  # the control: the same flood takes it away
        assert out.residency == "new"


def test_a_retention_over_quota_is_refused_counted_and_the_request_succeeds(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput) -> None:
    engine = engine_of(tiny, **tiers(tmp_path, kv_tenant_quota={"host": 4 * BLOCK_GIB},
                                     kv_tenant_quotas={"victim": {"host": 8 * BLOCK_GIB}}))
    try:
        small = ask(engine, SYSTEM, "small", retention_s=60.0)  # 6 blocks > 4
        big = ask(engine, SYSTEM, "victim", retention_s=60.0)  # 6 blocks <= its 8
        over = ask(engine, [*SYSTEM, *TURN[-4:], *range(1, 61)], "victim", retention_s=60.0)
        again = ask(engine, TURN, "small")
        tenants = engine.tier.report().tenants
    finally:
        engine.close()
    assert small.retention == "refused:quota" and big.retention == 60.0
    assert over.retention == "refused:quota"  # 10 blocks, more than its 8
    assert tenants["small"].retention_refused == {"quota": 1}
    assert tenants["victim"].retention_refused == {"quota": 1}
    assert tenants["victim"].retention_granted == 1
    assert again.token_ids == reference.token_ids and small.finish_reason == "length"


def test_an_expired_retention_is_an_ordinary_block_again(
        tiny: LoadedModel, tmp_path: Path) -> None:
    engine = engine_of(tiny, **tiers(tmp_path))
    try:
        assert ask(engine, SYSTEM, "victim", retention_s=0.5).retention == 0.5
        time.sleep(0.6)
        flood(engine)
        out = ask(engine, TURN, "victim")
    finally:
        engine.close()
    assert out.residency == "new"


def test_a_restart_from_disk_keeps_unexpired_retention(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput) -> None:
    knobs = tiers(tmp_path)
    first = engine_of(tiny, **knobs)
    try:
        assert ask(first, SYSTEM, "victim", retention_s=3600.0).retention == 3600.0
        assert ask(first, [*SYSTEM[:32], 1, 2], "short", retention_s=0.2).retention == 0.2
    finally:
        first.close()  # writes the host down and saves the deadlines beside the disk file
    assert (tmp_path / "kv" / "retention.json").exists()
    time.sleep(0.3)
    second = engine_of(tiny, **knobs)
    try:
        flood(second)  # the new process's host and disk fill with another tenant's blocks
        out = ask(second, TURN, "victim")
        tenants = second.tier.report().tenants
    finally:
        second.close()
    assert out.residency == "disk" and out.token_ids == reference.token_ids
    assert "short" not in tenants or tenants["short"].retained["disk"] == 0


@pytest.mark.parametrize("hinted", [True, False])
def test_an_expect_return_hint_turns_a_disk_wake_into_a_host_wake(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput, hinted: bool) -> None:
    # The host holds 12 blocks, the disk many more: the flood pushes the session below host.
    engine = engine_of(tiny, **tiers(tmp_path, host_blocks=12, disk_kv_size=0.002))
    gap = 5.0  # the tool call: the hint is watched from 1 s before the return
    try:
        ask(engine, SYSTEM, "victim", expect_return_s=gap if hinted else None)
        back = time.monotonic() + gap
        flood(engine, 6)
        assert time.monotonic() < back - 1.2, "the flood outlasted the watch's start"
        time.sleep(back - 0.5 - time.monotonic())
        for _ in range(3):
            engine.step()  # the idle engine's steps stage what is due
        engine.drain()
        out = ask(engine, TURN, "victim")
    finally:
        engine.close()
    assert out.token_ids == reference.token_ids
    assert out.residency == ("host" if hinted else "disk")


@pytest.mark.parametrize("hints, error", [
    ({"retention_s": -1.0}, "kv_retention_s=-1.0 must be a finite number"),
    ({"retention_s": float("nan")}, "kv_retention_s=nan"),
    ({"expect_return_s": float("inf")}, "kv_expect_return_s=inf"),
    ({"expect_return_s": 10**6}, "past the longest hint"),
])
def test_bad_hints_are_refused_by_name(tiny: LoadedModel, hints: dict[str, Any],
                                       error: str) -> None:
    engine = engine_of(tiny, **BASE)
    try:
        with pytest.raises(RequestError, match=error):
            engine.add_request(SYSTEM, PARAMS, hints=KvHints(**hints))
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_over_the_maximum_or_without_a_tier_the_retention_is_refused_with_the_reason(
        tiny: LoadedModel, tmp_path: Path) -> None:
    engine = engine_of(tiny, **tiers(tmp_path, kv_retention_max_s=60.0))
    off = engine_of(tiny, **BASE)
    try:
        assert ask(engine, SYSTEM, "a", retention_s=61.0).retention == "refused:over_max"
        assert ask(off, SYSTEM, "a", retention_s=5.0).retention == "refused:disabled"
    finally:
        engine.close()
        off.close()


def test_redis_keeps_a_retained_block_as_long_as_its_retention(
        tiny: LoadedModel, redis_server: Any) -> None:
    """The store's TTL (remote_kv_ttl_s) is stretched to the retention's deadline for the
    blocks retained when they are written; the others keep the plain TTL."""
    engine = engine_of(tiny, **BASE, kv_offloading_size=0.02, remote_kv_url=redis_server.url,
                       remote_kv_ttl_s=30.0)
    try:
        ask(engine, SYSTEM, "victim", retention_s=3600.0)
        ask(engine, [*range(1, 49)], "other")
    finally:
        engine.close()
    with redis_server.client() as client:
        ttls = sorted(client.pttl(k) / 1000 for k in client.scan_iter(count=1000))
    assert len(ttls) == 6 + 3, ttls
    assert all(0 < t <= 30 for t in ttls[:3]), ttls  # the other tenant's: the store's TTL
    assert all(3500 < t <= 3600 for t in ttls[3:]), ttls  # the retained six: an hour


def test_a_later_retention_renews_blocks_already_in_redis(
        tiny: LoadedModel, redis_server: Any) -> None:
    """A prefix written to Redis under the plain TTL, retained by a later turn that finds it
    cached, gets its TTL stretched to the new deadline; a shorter retention never cuts it."""
    engine = engine_of(tiny, **BASE, kv_offloading_size=0.02, remote_kv_url=redis_server.url,
                       remote_kv_ttl_s=30.0)

    def ttls() -> list[float]:
        engine.drain()
        with redis_server.client() as client:
            return sorted(client.pttl(k) / 1000 for k in client.scan_iter(count=1000))

    try:
        first = ask(engine, SYSTEM, "victim")
        assert len(ttls()) == 6 and all(0 < t <= 30 for t in ttls())
        again = ask(engine, SYSTEM, "victim", retention_s=3600.0)
        assert again.retention == 3600.0 and again.token_ids == first.token_ids
        assert all(3500 < t <= 3600 for t in ttls()), ttls()
        assert ask(engine, SYSTEM, "victim", retention_s=60.0).retention == 60.0
        assert all(3500 < t <= 3600 for t in ttls()), ttls()
        below = engine.tier.report().below
        assert below is not None and below.renewed_blocks["remote"] == 12
        assert not below.renew_failures
    finally:
        engine.close()


def test_one_tenant_cannot_pin_a_whole_disk_by_retaining_what_it_spills(
        tiny: LoadedModel, tmp_path: Path) -> None:
    """The retained share (80%) and the quota hold in every tier a retained block enters,
    not only where it sat at the grant: one tenant retaining prompt after prompt, each
    granted on host and then spilled to disk, filled every disk slot with retained blocks
    before (12 of 13 here, and no other tenant's block could reach the disk)."""
    engine = engine_of(tiny, **tiers(tmp_path, host_blocks=24, disk_kv_size=20 * BLOCK_GIB))
    try:
        disk_slots = engine.tier.report().below.stores["disk"].capacity
        for r in range(12):
            ask(engine, [(r * 37 + i * 11) % 380 + 1 for i in range(48)], "mallory",
                retention_s=3600.0)
        mallory = engine.tier.report().tenants["mallory"]
    finally:
        engine.close()
    assert mallory.retained["disk"] <= 0.8 * disk_slots < disk_slots
    assert mallory.held["disk"] == disk_slots  # the rest of the disk: ordinary blocks


def test_a_breakpoint_keeps_exactly_the_tokens_before_it_through_a_flood(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput) -> None:
    # a cache breakpoint 40 tokens into the system prompt: its two full blocks and the part
    # of the third before it are retained, the rest of the prompt is not; after the flood the
    # turn restores exactly those 40 tokens
    engine = engine_of(tiny, **tiers(tmp_path))
    try:
        first = ask(engine, SYSTEM, "victim", prefixes=(PrefixRetention(40, 3600.0),))
        flood(engine)
        out = ask(engine, TURN, "victim")
        tenants = engine.tier.report().tenants
    finally:
        engine.close()
    [grant] = first.hint_reply.prefixes
    assert grant.value == 3600.0 and grant.blocks == 3 and first.retention is None
    assert out.token_ids == reference.token_ids
    assert out.residency == "host" and out.num_restored_tokens == 40
    assert tenants["victim"].retained["host"] == 3


def test_a_breakpoint_asked_again_renews_its_lifetime_and_one_not_renewed_expires(
        tiny: LoadedModel, tmp_path: Path) -> None:
    """As both providers do, a hit that marks the same breakpoint renews its TTL: kept
    through a flood past the first deadline; the same lifetime never renewed ends (a short
    one standing in for Anthropic's 5m)."""
    engine = engine_of(tiny, **tiers(tmp_path))
    mark = (PrefixRetention(40, 2.0),)  # a flood takes ~0.2 s here: margins of 0.7 s
    try:
        ask(engine, SYSTEM, "victim", prefixes=mark)
        time.sleep(1.4)
        again = ask(engine, TURN, "victim", prefixes=mark)  # a hit, the same breakpoint
        time.sleep(0.8)  # past the first deadline, within the renewed one
        flood(engine)
        kept = ask(engine, TURN, "victim")
        time.sleep(1.2)  # past the renewed one too
        flood(engine)
        gone = ask(engine, TURN, "victim")
    finally:
        engine.close()
    assert again.num_cached_tokens + again.num_restored_tokens >= 32
    assert again.hint_reply.prefixes[0].value == 2.0
    assert kept.residency == "host" and kept.num_restored_tokens == 40  # to the breakpoint
    assert gone.residency == "new" and gone.num_restored_tokens == 0


def test_no_tier_refuses_every_hint_alike(tiny: LoadedModel) -> None:
    engine = engine_of(tiny, **BASE)  # no tier: every asked hint answered "disabled"
    try:
        out = ask(engine, SYSTEM, "a", retention_s=5.0, expect_return_s=5.0,
                  prefixes=(PrefixRetention(32, 5.0), PrefixRetention(64, 5.0)))
    finally:
        engine.close()
    reply = out.hint_reply
    assert [str(g) for g in (reply.retention, reply.expect_return, *reply.prefixes)] == \
        ["refused:disabled"] * 4


@pytest.mark.parametrize("erase", [True, False])
def test_an_expired_retention_erases_its_blocks_where_the_deployment_asks(
        tiny: LoadedModel, tmp_path: Path, reference: RequestOutput, erase: bool) -> None:
    """Zero data retention (kv_retention_erase): once a retention expires its blocks leave
    the device, host and disk (the raw file holds none of their keys, nor the retention
    file their hashes) on the next step; without it they stay as ordinary cached blocks."""
    engine = engine_of(tiny, **tiers(tmp_path), kv_retention_erase=erase)
    try:
        ask(engine, SYSTEM, "victim", retention_s=0.5)
        keys = hash_blocks(engine.namespace("victim"), SYSTEM, 16)
        disk = max((tmp_path / "kv").iterdir(), key=lambda f: f.stat().st_size)  # the slots
        assert all(k in disk.read_bytes() for k in keys)
        logged = b"".join(f.read_bytes() for f in (tmp_path / "kv").iterdir() if f != disk)
        assert all(k.hex().encode() in logged for k in keys)  # the deadlines, by hash
        time.sleep(0.7)
        engine.step()  # the expiry is seen, the erase decided...
        engine.drain()  # ...and written
        raw = disk.read_bytes()
        log = b"".join(f.read_bytes() for f in (tmp_path / "kv").iterdir() if f != disk)
        out = ask(engine, TURN, "victim")
    finally:
        engine.close()
    assert out.token_ids == reference.token_ids
    if erase:
        assert not any(k in raw for k in keys)
        assert not any(k.hex().encode() in log for k in keys)
        assert out.residency == "new" and out.num_read_tokens == 0
    else:
        assert all(k in raw for k in keys)
        assert out.num_read_tokens == 96
