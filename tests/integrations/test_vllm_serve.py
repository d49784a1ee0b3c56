"""kvtier's connector under `vllm serve` itself: the flag a user passes on the command line,
requests over HTTP, the caller told through `kv_transfer_params`, and kvtier's counters in
the /metrics the server exports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_run import KV_BYTES_PER_BLOCK, VllmServer, prompts

pytestmark = pytest.mark.vllm
FULL = 7 * 128


@pytest.fixture(scope="module")
def server(smollm2_hf: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[VllmServer]:
    tmp = tmp_path_factory.mktemp("serve")
    s = VllmServer(smollm2_hf, {"kv_offloading_size": 0.25}, 24, tmp / "vllm.log").start()
    yield s
    s.close()


def complete(server: VllmServer, ids: list[int]) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text[:500]
    return r.json()


def test_vllm_serve_restores_from_kvtier_and_its_metrics_say_so(server: VllmServer) -> None:
    a, *evictors, again = prompts()
    first = complete(server, a)
    assert first["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    for ids in evictors:  # push A out of vLLM's 24-block pool
        complete(server, ids)
    woken = complete(server, again)
    assert woken["kv_transfer_params"]["kvtier_residency"] == "host"
    assert woken["kv_transfer_params"]["kvtier_restored_tokens"] == FULL
    assert woken["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL
    assert woken["choices"][0]["text"] == first["choices"][0]["text"]
    m = server.metrics()
    total = {k.split("{")[0]: v for k, v in m.items()}
    assert total["vllm:kvtier_restored_tokens_total"] == FULL
    assert total["vllm:kvtier_restore_bytes_total"] == 7 * KV_BYTES_PER_BLOCK
    assert total["vllm:kvtier_stored_blocks_total"] == 5 * 8
    assert total.get("vllm:kvtier_failed_loads_total", 0) == 0
