"""`DELETE /v1/kv` on `kvtier serve`: a tenant purges a prompt's blocks from every tier, in
its own namespace only (another tenant's identical prompt stays), the answer counting what
went; the next request computes the prompt again; bad asks are 400s, an unknown key a 401
(issue 45; the bytes themselves are shown gone in tests/engine/test_purge.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import start_server

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model
PROMPT = [10 + (i * 13) % 300 for i in range(100)]  # six full blocks
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-carol": "carol"}
OTHER = [20 + (i * 7) % 250 for i in range(100)]  # another six blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("purge")
    keys = directory / "keys.json"
    keys.write_text(json.dumps(KEYS))
    proc, url = start_server("--num-device-blocks", "48", "--batch-invariant",
                             "--kv-offloading-size", str(24 * BLOCK_GIB),
                             "--disk-kv-path", str(directory / "kv"),
                             "--disk-kv-size", "0.0004", "--disk-kv-read-gbps", "2",
                             "--idle-offload-s", "0.2", "--api-keys-file", str(keys),
                             "--load-policy", "always")  # the kept prompt is read back
    try:
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def as_(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def complete(url: str, key: str, prompt: list[int] = PROMPT) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", headers=as_(key), timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"])


def purge(url: str, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request("DELETE", f"{url}/v1/kv", headers=as_(key), timeout=60,
                         json=body if body is not None else {"prompt": PROMPT})


def test_a_tenant_purges_its_own_prompt_from_every_tier_and_no_one_elses(server: str) -> None:
    complete(server, "sk-alice")
    complete(server, "sk-bob")
    time.sleep(0.6)  # idle_offload_s: the blocks leave the device for host, and disk
    bob = purge(server, "sk-bob")
    assert bob.status_code == 200, bob.text
    gone = bob.json()
    assert gone["object"] == "kv.purge" and gone["blocks"] == 6
    assert gone["host_blocks"] + gone["device_blocks"] == 6
    assert gone["erased"] == {"disk": 6} and gone["erase_failures"] == {}
    again = complete(server, "sk-bob")
    assert again["residency"] == "new" and again["prompt_tokens_details"]["cached_tokens"] == 0
    alice = complete(server, "sk-alice")  # alice's identical prompt, her own namespace: kept
    assert alice["prompt_tokens_details"]["cached_tokens"] == 96, alice


@pytest.mark.parametrize("body, says", [
    ({}, "exactly one of 'prompt'"),
    ({"prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]}, "exactly one of"),
    ({"prompt": []}, "empty"),
    ({"prompt": PROMPT, "model": "other"}, "does not exist"),
    ({"scope": "tenant", "prompt": PROMPT}, "name no prompt"),
    ({"scope": "everyone"}, "scope"),
])
def test_a_bad_purge_is_refused_and_says_why(server: str, body: dict[str, Any],
                                             says: str) -> None:
    r = purge(server, "sk-alice", body)
    assert r.status_code in (400, 404) and says in r.json()["error"]["message"], r.text


def test_an_unknown_key_purges_nothing(server: str) -> None:
    assert purge(server, "sk-mallory").status_code == 401


def test_a_prompt_never_seen_purges_nothing_and_fails_nothing(server: str) -> None:
    r = purge(server, "sk-alice", {"prompt": [7] * 40})
    assert r.status_code == 200
    out = r.json()
    assert out["host_blocks"] == out["device_blocks"] == 0 and out["erased"] == {"disk": 0}


def test_a_tenant_purges_every_block_it_owns_and_no_one_elses(server: str) -> None:
    complete(server, "sk-carol")
    complete(server, "sk-carol", OTHER)
    complete(server, "sk-alice", OTHER)
    time.sleep(0.6)  # idle_offload_s: the blocks leave the device for host, and disk
    r = purge(server, "sk-carol", {"scope": "tenant"})
    assert r.status_code == 200, r.text
    gone = r.json()
    assert gone["object"] == "kv.purge" and gone["tenant"] == "carol"
    assert gone["blocks"] >= 12 and gone["host_blocks"] >= 12  # both prompts, and answers
    assert gone["erased"]["disk"] >= 12 and gone["erase_failures"] == {}
    for prompt in (PROMPT, OTHER):
        again = complete(server, "sk-carol", prompt)
        assert again["residency"] == "new", again
        assert again["prompt_tokens_details"]["cached_tokens"] == 0
    alice = complete(server, "sk-alice", OTHER)  # the same prompt, another tenant's: kept
    assert alice["prompt_tokens_details"]["cached_tokens"] == 96, alice


def test_a_server_without_tenants_refuses_a_tenant_purge() -> None:
    proc, url = start_server("--num-device-blocks", "16",
                             "--kv-offloading-size", str(16 * BLOCK_GIB))
    try:
        r = httpx.request("DELETE", f"{url}/v1/kv", timeout=60, json={"scope": "tenant"})
        assert r.status_code == 400 and "names no tenants" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
