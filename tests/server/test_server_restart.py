"""SIGTERM to `kvtier serve` is a clean shutdown: the KV cache goes down to the disk tier and
the next server on that directory resumes the conversation from disk, with the same answer."""

from __future__ import annotations

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
