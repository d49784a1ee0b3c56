"""Quotas a client cannot turn against its neighbour (`kvtier serve`): a tenant is named by
what a client cannot mint (an API key, or the header the operator's router sets), never by
a cache_salt or prompt_cache_key a client makes up per request. The attack: a victim just
over its host quota, a neighbour minting a new cache_salt for every request."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import start_server

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model
VICTIM = [10 + (i * 13) % 300 for i in range(7 * 16)]  # seven blocks: one over its quota
QUOTA = json.dumps({"host": 6 * BLOCK_GIB})


def complete(url: str, prompt: list[int], headers: dict[str, str], **extra: Any
             ) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, headers=headers, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "ignore_eos": True, **extra})


def attack(url: str, victim: dict[str, str], mallory: dict[str, str]) -> list[int]:
    """The victim's restored tokens at each of its four turns, while mallory sends two
    five-block prompts between them, each under a cache_salt never seen before."""
    restored, n = [], 0
    for turn in range(4):
        r = complete(url, [*VICTIM, 5 + turn], victim, cache_salt="victim")
        assert r.status_code == 200, r.text
        restored.append(r.json()["usage"]["restored_tokens"])
        for _ in range(2):
            n += 1
            r = complete(url, [(n * 31 + i * 7) % 380 + 1 for i in range(80)], mallory,
                         cache_salt=f"mint-{n}", prompt_cache_key=f"mint-{n}")
            assert r.status_code == 200, r.text
        time.sleep(0.4)  # idle_offload_s: the device keeps nothing; returns come from host
    return restored


def server(*extra: str) -> tuple[Any, str]:
    return start_server("--num-device-blocks", "24", "--batch-invariant",
                        "--kv-offloading-size", str(24 * BLOCK_GIB), "--idle-offload-s", "0.2",
                        "--kv-tenant-quota", QUOTA, *extra)


def stop(proc: Any) -> str:
    proc.terminate()
    return str(proc.communicate(timeout=30)[0])


def test_without_authentication_minted_salts_are_no_tenants_and_the_log_says_so() -> None:
    """Before: each minted salt was a tenant under its quota, so the victim, one block over
    its own, lost its prefix first (restored 0 at its third turn). Now every request is one
    tenant: the victim fares as with no quota at all."""
    proc, url = server()
    try:
        restored = attack(url, {}, {})
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        out = stop(proc)
    assert restored == [0, 112, 112, 112]
    assert "warning: kvtier tenants: none are told apart" in out
    assert "bounds all clients together and separates none" in out
    assert 'tenant="mint-' not in metrics and 'tenant="victim"' not in metrics


@pytest.mark.parametrize("auth", ["keys", "header"])
def test_minted_salts_count_against_the_tenant_that_minted_them(
        tmp_path: Path, auth: str) -> None:
    """With API keys, or the router's tenant header, mallory's salts are all mallory's: it
    is far over its quota and loses first; the victim keeps its prefix at every turn."""
    if auth == "keys":
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"sk-v": "victim", "sk-m": "mallory"}))
        extra = ("--api-keys-file", str(keys))
        victim, mallory = ({"Authorization": f"Bearer sk-{k}"} for k in "vm")
    else:
        extra = ("--tenant-header", "X-Tenant")
        victim, mallory = {"X-Tenant": "victim"}, {"X-Tenant": "mallory"}
    proc, url = server(*extra)
    try:
        restored = attack(url, victim, mallory)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        bare = complete(url, VICTIM, {}, cache_salt="victim")
    finally:
        out = stop(proc)
    assert restored == [0, 112, 112, 112]
    assert 'kvtier_tenant_evicted_blocks_total{tenant="mallory",tier="host"}' in metrics
    assert 'kvtier_tenant_evicted_blocks_total{tenant="victim"' not in metrics
    assert 'tenant="mint-' not in metrics
    assert bare.status_code == (401 if auth == "keys" else 400), bare.text
    if auth == "header":
        assert "X-Tenant header must name the request's tenant" in bare.json()["error"]["message"]
        assert "named by the router's X-Tenant header" in out
