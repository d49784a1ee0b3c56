"""kvtier under vLLM with sliding-window models (tiny random models, vLLM's engine in the
driver's process): a Mistral-style model (every layer windowed: one SlidingWindowSpec group,
vLLM drops blocks that leave the window) and a Gemma 3 text model under vLLM's hybrid
allocator (window and global layers in KV cache groups of their own over one pool). The
reference is vLLM's own prefix hit of the same prompt in the same run."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import BLOCK_SIZE, VOCAB, WINDOW, kv_bytes_per_block
from vllm_run import ONE_PROCESS, parse, run_vllm

pytestmark = pytest.mark.vllm

PROMPT = 10 * BLOCK_SIZE
FULL = PROMPT - BLOCK_SIZE  # vLLM computes the last block again
HOST = {"kv_offloading_size": 0.02}


def prompts(n_others: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    a = [rng.randrange(10, VOCAB) for _ in range(PROMPT)]
    out = {"a": a}
    for i in range(n_others):
        out[f"x{i}"] = [rng.randrange(10, VOCAB) for _ in range(PROMPT)]
    late = PROMPT - 20  # inside the last window: a windowed model reads it
    out["a'"] = [*a[:late], a[late] + 1, *a[late + 1:]]
    return out


# a follow-up to A: A, what A generated, and 40 tokens more (a second turn)
FOLLOW_UP = {"after": 0, "extra": [11 + i % 400 for i in range(40)]}


def serve(python: Path, model: Path, kind: str, n_others: int, blocks: int,
          follow_up: bool = False, **spec: Any) -> dict[str, Any]:
    """A, A (vLLM's own hit: the reference), [A's follow-up (vLLM's own hit)], others that
    evict A, A (from kvtier), A with a late token changed, [A's follow-up (from kvtier)]."""
    p: dict[str, Any] = {**prompts(n_others), "f": FOLLOW_UP}
    names = ["a", "a", *(["f"] if follow_up else []), *(f"x{i}" for i in range(n_others)),
             "a", "a'", *(["f"] if follow_up else [])]
    return parse(run_vllm(python, model, {
        "connector": HOST, "blocks": blocks, "prompts": [p[n] for n in names],
        "block_size": BLOCK_SIZE, "kv_bytes_per_block": kv_bytes_per_block(kind),
        "max_model_len": PROMPT + 4 * BLOCK_SIZE, "metrics": True, **spec},
        env=ONE_PROCESS).stdout)


def check_exact_restore(run: dict[str, Any], follow_up: bool = False) -> None:
    r = run["results"][:-1] if follow_up else run["results"]
    ref, again, changed = r[1], r[-2], r[-1]
    assert ref["cached"] == FULL and ref["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    assert again["kv_transfer_params"]["kvtier_residency"] == "host"
    # tokens vLLM did not compute thanks to kvtier (a window loads fewer: see the bytes)
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == FULL
    assert again["cached"] == FULL  # vLLM's own copy was evicted: all of it from kvtier
    assert again["tokens"] == ref["tokens"] and again["logprobs"] == ref["logprobs"]
    assert changed["tokens"] != ref["tokens"]  # the model reads its context


def test_mistral_style_window_restores_only_the_window_exactly(
        vllm_python: Path, tiny_hf: Callable[[str], Path]) -> None:
    # every layer windowed: vLLM keeps ~3 blocks a request, so six others evict A's window
    run = serve(vllm_python, tiny_hf("mistral"), "mistral", n_others=6, blocks=16,
                follow_up=True)
    window_blocks = WINDOW // BLOCK_SIZE
    check_exact_restore(run, follow_up=True)
    m = run["metrics"]
    # stored per prompt: its window before its prompt's boundary and before its final one
    # (the last one filled while it generated), not its 10 full blocks
    assert m["vllm:kvtier_stored_blocks"] <= 2 * window_blocks * 9
    # A's second turn carries what A generated: its window at A's final boundary (stored
    # when A finished, vLLM holding the blocks until then) serves it past A's prompt
    ref, again = run["results"][2], run["results"][-1]
    assert again["kv_transfer_params"]["kvtier_residency"] == "host"
    assert again["cached"] >= PROMPT + BLOCK_SIZE > FULL
    assert again["tokens"] == ref["tokens"] and again["logprobs"] == ref["logprobs"]


def test_gemma3_under_the_hybrid_allocator_restores_every_group_exactly(
        vllm_python: Path, tiny_hf: Callable[[str], Path]) -> None:
    # five windowed layers and one global: six KV cache groups of one layer each, one pool
    run = serve(vllm_python, tiny_hf("gemma3"), "gemma3", n_others=6, blocks=24, hybrid=True)
    check_exact_restore(run)
    m = run["metrics"]
    restored = {k.partition("group=")[2].rstrip("}"): v for k, v in m.items()
                if k.startswith("vllm:kvtier_restored_blocks{")}
    window_blocks = WINDOW // BLOCK_SIZE
    assert sorted(restored.values()) == [window_blocks] * 5 + [FULL // BLOCK_SIZE]
    assert sum(label.endswith(":full") for label in restored) == 1
    # at most, for each of the ten prompts: every block of the global layer's group and the
    # window of each other group (all six groups' blocks would be 10 * 60); the driver counts
    # every store that lands after the last request (181 here), none are lost in its race
    assert m["vllm:kvtier_stored_blocks"] <= len(run["results"]) * (10 + 5 * window_blocks)


def test_an_ssm_model_stops_vllm_at_start_with_kvtiers_message(
        vllm_python: Path, tiny_hf: Callable[[str], Path]) -> None:
    # (engine-only knobs and the other refused kinds are checked without vLLM:
    # test_settings.py, test_groups.py; an unknown knob through vLLM: test_vllm.py)
    proc = run_vllm(vllm_python, tiny_hf("mamba"), {
        "connector": HOST, "blocks": 24, "prompts": [], "block_size": BLOCK_SIZE,
        "kv_bytes_per_block": kv_bytes_per_block("llama"), "max_model_len": PROMPT},
        env=ONE_PROCESS, check=False)
    assert proc.returncode != 0
    assert "is MambaSpec (Mamba/SSM state)" in proc.stdout + proc.stderr
