"""SIGTERM to `kvtier serve` is a clean shutdown: the KV cache goes down to the disk tier and
the next server on that directory resumes the conversation from disk, with the same answer."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from conftest import start_server

FIRST = [10 + (i * 13) % 300 for i in range(100)]


def complete(url: str, prompt: list[int]) -> tuple[list[int], str]:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], r.headers["x-kvtier-residency"]


def serve(disk: Path | None) -> tuple[object, str]:
    args = ["--num-device-blocks", "64", "--batch-invariant"]
    if disk is not None:
        args += ["--kv-offloading-size", "0.02", "--disk-kv-path", str(disk),
                 "--disk-kv-size", "0.01", "--disk-kv-read-gbps", "2"]
    return start_server(*args)


def stop(proc: object) -> str:
    proc.terminate()  # type: ignore[attr-defined]
    out, _ = proc.communicate(timeout=30)  # type: ignore[attr-defined]
    assert proc.returncode in (0, -15), out  # type: ignore[attr-defined]
    return out


def prefetch(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/kv/prefetch", timeout=60, json=body)


def test_sigterm_writes_the_cache_down_and_a_new_server_resumes(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    proc, url = serve(disk)
    tokens, residency = complete(url, FIRST)
    stop(proc)
    assert residency == "new"
    second = [*FIRST, *tokens, 3, 4, 5]
    proc, url = serve(disk)
    try:
        resumed, residency = complete(url, second)
    finally:
        stop(proc)
    proc, url = serve(None)  # the reference: no tier, the whole prompt computed
    try:
        expected, _ = complete(url, second)
    finally:
        stop(proc)
    assert residency == "disk"
    assert resumed == expected


def test_a_prefetch_brings_the_session_up_to_host_before_it_returns(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    proc, url = serve(disk)
    tokens, _ = complete(url, FIRST)
    stop(proc)
    second = [*FIRST, *tokens, 3, 4, 5]
    proc, url = serve(disk)
    try:
        r = prefetch(url, {"prompt": second})
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "kv.prefetch", "model": "tiny",
                            "prompt_tokens": len(second), "blocks": len(second) // 16,
                            "host_blocks": 0, "fetching_blocks": 6, "from": ["disk"],
                            "limited_blocks": 0}
        deadline = time.monotonic() + 10
        while prefetch(url, {"prompt": second}).json()["host_blocks"] < 6:
            assert time.monotonic() < deadline, "the prefetch never landed on host"
            time.sleep(0.05)
        bad = {
            "{}": ({}, 400, "exactly one of"),
            "both": ({"prompt": [1], "messages": [{"role": "user", "content": "x"}]}, 400,
                     "exactly one of"),
            "empty": ({"prompt": []}, 400, "empty"),
            "vocab": ({"prompt": [10**9]}, 400, "outside the vocabulary"),
            "model": ({"model": "nope", "prompt": [1]}, 404, "does not exist"),
            "salt": ({"prompt": [1], "cache_salt": 5}, 400, "cache_salt"),
        }
        for name, (body, status, why) in bad.items():
            got = prefetch(url, body)
            assert got.status_code == status and why in got.text, (name, got.text)
        chat = prefetch(url, {"messages": [{"role": "user", "content": "hello"}]})
        assert chat.status_code == 200 and chat.json()["host_blocks"] == 0, chat.text
        resumed, residency = complete(url, second)
    finally:
        stop(proc)
    proc, url = serve(None)
    try:
        expected, _ = complete(url, second)
    finally:
        stop(proc)
    assert residency == "host"  # it would have woken from disk without the prefetch
    assert resumed == expected


def test_a_loop_of_prefetches_is_answered_429_past_the_tenants_budget(tmp_path: Path) -> None:
    """POST /v1/kv/prefetch was a free host flush (266-365 calls a second, every block named
    read from disk): past half the host per 10 s, a tenant's prefetch brings nothing up and
    is a 429 in OpenAI's shape, counted in /metrics; the blocks stay on disk."""
    disk = tmp_path / "kv"
    sessions = [[(s * 41 + i * 7) % 380 + 1 for i in range(160)] for s in range(6)]
    proc, url = serve(disk)  # host 0.02 GiB: 2,560 slots of the tiny model's 8 KiB blocks
    for prompt in sessions:
        complete(url, prompt)
    stop(proc)  # written down to disk: the next server finds them there, not on host
    proc, url = start_server("--num-device-blocks", "64", "--batch-invariant",
                             "--kv-offloading-size", str(20 * 8192 / 1024**3),
                             "--disk-kv-path", str(disk), "--disk-kv-size", "0.01",
                             "--disk-kv-read-gbps", "2")
    try:
        answers = [prefetch(url, {"prompt": p}) for p in sessions for _ in range(3)]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        stop(proc)
    codes = [r.status_code for r in answers]
    assert codes[0] == 200 and 429 in codes, codes
    refused = next(r for r in answers if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error" and refused["code"] == "rate_limit_exceeded"
    assert "over their budget" in refused["message"]
    fetched = sum(r.json()["fetching_blocks"] for r in answers if r.status_code == 200)
    assert 0 < fetched <= 10 + 10  # half of 20 host slots, one session below empty
    assert 'kvtier_tenant_prefetch_blocks_total{answer="limited",tenant="default"}' in metrics
