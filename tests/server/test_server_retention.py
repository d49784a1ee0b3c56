"""The client steers its KV over HTTP (`kvtier serve`): a retained system prompt survives a
noisy tenant's flood and wakes from host, a retention over quota answers "refused:quota" (and
/metrics counts it) while the request succeeds, an expect-return hint stages a session up to
host, and bad values are a 400 naming the field. Tokens equal a server without the tier."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import start_server

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model
SYSTEM = [10 + (i * 13) % 300 for i in range(96)]  # six blocks
TURN = [*SYSTEM, 5, 6, 7, 8]


def complete(url: str, prompt: list[int], **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["choices"][0]["token_ids"], "an empty answer"
    return body


def flood(url: str, requests: int = 30) -> None:
    """A noisy tenant's burst of distinct five-block prompts."""
    for r in range(requests):
        ok(complete(url, [(r * 31 + i * 7) % 380 + 1 for i in range(80)], cache_salt="noisy"))


def server(tmp_path: Path, host_blocks: int = 24, disk_gib: float = 0.0004,
           *extra: str) -> tuple[Any, str]:
    return start_server("--num-device-blocks", "48", "--batch-invariant",
                        "--kv-offloading-size", str(host_blocks * BLOCK_GIB),
                        "--disk-kv-path", str(tmp_path / "kv"), "--disk-kv-size", str(disk_gib),
                        "--disk-kv-read-gbps", "2", "--idle-offload-s", "0.2",
                        "--kv-tenant-from", "cache_salt", *extra)  # as if a router set salts


def stop(proc: Any) -> None:
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def reference() -> Iterator[list[int]]:
    proc, url = start_server("--num-device-blocks", "64", "--batch-invariant")
    try:
        yield ok(complete(url, TURN))["choices"][0]["token_ids"]
    finally:
        stop(proc)


def test_a_retained_system_prompt_wakes_from_host_after_a_noisy_flood(
        tmp_path: Path, reference: list[int]) -> None:
    proc, url = server(tmp_path)
    try:
        first = ok(complete(url, SYSTEM, cache_salt="victim", prompt_cache_retention="24h"))
        assert first["kvtier_retention_s"] == 86400
        flood(url)
        time.sleep(0.5)  # idle_offload_s: nothing stays cached on the device
        r = complete(url, TURN, cache_salt="victim")
        body = ok(r)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        stop(proc)
    assert r.headers["x-kvtier-residency"] == "host"
    assert body["choices"][0]["token_ids"] == reference
    assert 'kvtier_tenant_bytes{kind="retained",tenant="victim",tier="host"} 49152.0' in metrics
    assert 'kvtier_tenant_evicted_blocks_total{tenant="noisy",tier="host"}' in metrics


def test_a_retention_over_quota_is_refused_and_counted_and_bad_values_are_400(
        tmp_path: Path, reference: list[int]) -> None:
    quota = json.dumps({"host": 4 * BLOCK_GIB})
    proc, url = server(tmp_path, 24, 0.0004, "--kv-tenant-quota", quota,
                       "--kv-retention-max-s", "3600")
    try:
        over = ok(complete(url, TURN, cache_salt="small", kv_retention_s=60))
        too_long = ok(complete(url, SYSTEM[:20], prompt_cache_key="k", kv_retention_s=7200))
        day = ok(complete(url, SYSTEM[:40], prompt_cache_retention="24h"))
        memory = ok(complete(url, SYSTEM[:40], prompt_cache_retention="in_memory"))
        stream = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": SYSTEM[:50], "max_tokens": 2, "stream": True,
            "kv_retention_s": 30})
        bad = {field: complete(url, SYSTEM, **{field: value}).json()["error"]["message"]
               for field, value in (("kv_retention_s", -1), ("kv_retention_s", "10"),
                                    ("kv_expect_return_s", 0), ("kv_retention_s", True),
                                    ("prompt_cache_retention", "1h"),
                                    ("prompt_cache_key", ""))}
        both = complete(url, SYSTEM, kv_retention_s=5, prompt_cache_retention="24h")
        huge = complete(url, SYSTEM, kv_expect_return_s=10**7)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        stop(proc)
    assert over["kvtier_retention_s"] == "refused:quota"
    assert over["choices"][0]["token_ids"] == reference  # the request itself succeeds
    assert too_long["kvtier_retention_s"] == "refused:over_max"
    assert day["kvtier_retention_s"] == "refused:over_max"  # 24 h > this server's 1 h
    assert "kvtier_retention_s" not in memory
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["kvtier_retention_s"] == 30 and chunks[-1]["choices"][0]["finish_reason"]
    assert all("kvtier_retention_s" not in c for c in chunks[:-1])
    for field, message in bad.items():
        assert field in message, message
    assert both.status_code == 400 and "give one of" in both.text
    assert huge.status_code == 400 and "kv_expect_return_s" in huge.text
    assert 'kvtier_tenant_retention_total{answer="quota",tenant="small"} 1.0' in metrics
    # prompt_cache_key names no tenant (a client could mint one a request): no salt, none,
    # like the 24 h ask's
    assert 'kvtier_tenant_retention_total{answer="over_max",tenant="default"} 2.0' in metrics
    assert 'tenant="k"' not in metrics


@pytest.mark.parametrize("hinted", [True, False])
def test_an_expect_return_hint_stages_the_session_up_to_host(
        tmp_path: Path, reference: list[int], hinted: bool) -> None:
    proc, url = server(tmp_path, 12, 0.002)  # a small host, a larger disk
    hint = {"kv_expect_return_s": 5.0} if hinted else {}
    try:
        ok(complete(url, SYSTEM, cache_salt="victim", **hint))
        back = time.monotonic() + 5.0
        flood(url, 6)  # pushes the session off the host, not off the disk
        assert time.monotonic() < back - 1.2, "the flood outlasted the watch's start"
        time.sleep(back - 0.3 - time.monotonic())  # the idle server stages it 1 s early
        r = complete(url, TURN, cache_salt="victim")
        body = ok(r)
    finally:
        stop(proc)
    assert r.headers["x-kvtier-residency"] == ("host" if hinted else "disk")
    assert body["choices"][0]["token_ids"] == reference


@pytest.mark.parametrize("retention_s, residency", [(3600.0, "disk"), (1.0, "new")])
def test_a_restart_keeps_unexpired_retention_and_an_expired_one_is_evictable(
        tmp_path: Path, reference: list[int], retention_s: float, residency: str) -> None:
    proc, url = server(tmp_path)
    try:
        granted = ok(complete(url, SYSTEM, cache_salt="victim", kv_retention_s=retention_s))
    finally:
        stop(proc)  # SIGTERM: the host goes down to disk, the deadlines beside it
    assert granted["kvtier_retention_s"] == retention_s
    time.sleep(1.2)  # the short retention has expired by the restart
    proc, url = server(tmp_path)
    try:
        flood(url)  # another tenant fills the new process's host and disk
        r = complete(url, TURN, cache_salt="victim")
        body = ok(r)
    finally:
        stop(proc)
    assert r.headers["x-kvtier-residency"] == residency
    assert body["choices"][0]["token_ids"] == reference
