"""8-bit demotion under vLLM (`kv_offload_dtype`, a tiny random Llama, vLLM's engine in the
driver's process): host slots hold int8 encodings of vLLM's blocks, a restore decodes them
into vLLM's KV cache, and the request is told it was served from lossy KV. The reference is
vLLM's own (exact) prefix hit of the same prompt in the same run; the deviation is measured
in benchmarks/vllm_connector.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from test_vllm_parallel import FULL, prompt_set
from tiny_models import BLOCK_SIZE, kv_bytes_per_block
from vllm_run import ONE_PROCESS, parse, run_vllm

pytestmark = pytest.mark.vllm


def test_an_8bit_restore_is_tagged_lossy_and_stays_close(
        vllm_python: Path, tiny_hf: Callable[[str], Path]) -> None:
    p = prompt_set()
    run = parse(run_vllm(vllm_python, tiny_hf("llama"), {
        "connector": {"kv_offloading_size": 0.01, "kv_offload_dtype": "int8"}, "blocks": 24,
        "prompts": [p[n] for n in ("a", "a", "b", "c", "d", "a")], "block_size": BLOCK_SIZE,
        "kv_bytes_per_block": kv_bytes_per_block("llama"), "max_model_len": 13 * BLOCK_SIZE,
        "metrics": True}, env=ONE_PROCESS).stdout)
    ref, again = run["results"][1], run["results"][-1]
    assert ref["kv_transfer_params"]["kvtier_lossy"] is False  # vLLM's own hit: exact
    params = again["kv_transfer_params"]
    assert params["kvtier_residency"] == "host" and params["kvtier_restored_tokens"] == FULL
    assert params["kvtier_lossy"] is True
    assert run["metrics"]["vllm:kvtier_lossy_restored_tokens"] == FULL
    # close, not exact: the first token's logprob moves a little, the greedy token not
    first, exact = again["logprobs"][0], ref["logprobs"][0]
    token = str(ref["tokens"][0])
    assert again["tokens"][0] == ref["tokens"][0]
    assert 0 < abs(first[token] - exact[token]) < 0.5 and math.isfinite(first[token])
