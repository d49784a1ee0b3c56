"""A conversation written down by one process is resumed from disk by the next; a block
from any other fingerprint is never found (a miss and a recompute, never a wrong answer)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier.tier.fingerprint as fingerprint
from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.errors import RequestError
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

# A fixed starting read rate: the planner's call for the tiny model (whose prefill is nearly
# free) must not hang on this machine's disk latency of the minute.
TIERS = {"kv_offloading_size": 0.02, "disk_kv_size": 0.01, "disk_kv_read_gbps": 2.0}
BASE = {"num_device_blocks": 48, "batch_invariant": True}
FIRST = [10 + (i * 13) % 300 for i in range(100)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)

# Process A: one turn, then the interpreter exits without `shutdown()`: the exit hook must
# write the cache down by itself.
CHILD = """
import json, sys
from kvtier.llm import LLM
from kvtier.sequence import SamplingParams
knobs = json.loads(sys.argv[1])
llm = LLM("tiny", **knobs)
out = llm.generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=8, temperature=0.0,
                   ignore_eos=True))[0]
print(json.dumps({"tokens": out.token_ids, "residency": out.residency}))
"""


def run_child(knobs: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(knobs), json.dumps(prompt)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A disk tier directory left by process A, and the second turn's prompt."""
    directory = tmp_path_factory.mktemp("disk") / "kv"
    first = run_child({**BASE, **TIERS, "disk_kv_path": str(directory)}, FIRST)
    assert first["residency"] == "new"
    return directory, [*FIRST, *first["tokens"], 7, 8, 9, 10, 11]


def second_turn(loaded: LoadedModel, prompt: list[int], **knobs: Any) -> Any:
    engine = LLMEngine(EngineConfig.from_knobs(model=loaded.source, **knobs), loaded=loaded)
    try:
        rid = engine.add_request(prompt, PARAMS)
        return engine.run_to_completion([rid])[rid], engine_stats(engine, RequestLog())
    finally:
        engine.close()


def copy_of(directory: Path, tmp_path: Path) -> str:
    target = tmp_path / "kv"
    shutil.copytree(directory, target)
    return str(target)


def test_process_b_resumes_from_disk(written: tuple[Path, list[int]], tiny: LoadedModel,
                                     tmp_path: Path) -> None:
    directory, prompt = written
    reference, _ = second_turn(tiny, prompt, **BASE)
    out, stats = second_turn(tiny, prompt, **BASE, **TIERS,
                             disk_kv_path=copy_of(directory, tmp_path))
    assert out.residency == "disk"
    assert out.num_restored_tokens == 96  # 6 full blocks of the 100-token first turn
    assert out.token_ids == reference.token_ids
    assert out.logprobs == reference.logprobs  # batch-invariant: bit for bit
    deep = stats["tiers_below_host"]
    assert deep["fetched_blocks"] == {"disk": 6} and deep["misses"] == {}


def _other_weights(tiny: LoadedModel) -> LoadedModel:
    weights = dict(tiny.weights)
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    weights[name] = weights[name] + 0.01 * torch.ones_like(weights[name])
    return dataclasses.replace(tiny, weights=weights, weights_digest="other-weights")


class _RenamedTokenizer:
    """The same tokenizer under another digest (as a re-exported vocabulary would be)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def digest(self) -> str:
        return "other-tokenizer"


@pytest.mark.parametrize("change", ["dtype", "block_size", "weights", "tokenizer",
                                    "layout_version"])
def test_any_fingerprint_change_misses(change: str, written: tuple[Path, list[int]],
                                       tiny: LoadedModel, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    directory, prompt = written
    loaded, knobs = tiny, dict(BASE)
    if change == "dtype":
        knobs["dtype"] = "bfloat16"
    elif change == "block_size":
        knobs["block_size"] = 32
    elif change == "weights":
        loaded = _other_weights(tiny)
    elif change == "tokenizer":
        loaded = dataclasses.replace(tiny, tokenizer=_RenamedTokenizer(tiny.tokenizer))
    else:
        monkeypatch.setattr(fingerprint, "KV_LAYOUT_VERSION", fingerprint.KV_LAYOUT_VERSION + 1)
    reference, _ = second_turn(loaded, prompt, **knobs)
    out, stats = second_turn(loaded, prompt, **knobs, **TIERS,
                             disk_kv_path=copy_of(directory, tmp_path))
    assert out.residency == "new" and out.num_restored_tokens == 0
    assert out.token_ids == reference.token_ids
    assert stats["tiers_below_host"]["fetched_blocks"] == {}


def test_a_prefetch_turns_the_disk_wake_into_a_host_wake(
        written: tuple[Path, list[int]], tiny: LoadedModel, tmp_path: Path) -> None:
    directory, prompt = written
    reference, _ = second_turn(tiny, prompt, **BASE)
    engine = LLMEngine(EngineConfig.from_knobs(model=tiny.source, **BASE, **TIERS,
                                               disk_kv_path=copy_of(directory, tmp_path)),
                       loaded=tiny)
    try:
        found = engine.prefetch(prompt)  # the client's hint: this session comes back soon
        assert found == {"prompt_tokens": len(prompt), "blocks": len(prompt) // 16,
                         "host_blocks": 0, "fetching_blocks": 6, "from": ["disk"],
                         "limited_blocks": 0}
        engine.drain()  # the user's think time: the fetch lands on host
        again = engine.prefetch(prompt)
        assert again["host_blocks"] == 6 and again["fetching_blocks"] == 0
        rid = engine.add_request(prompt, PARAMS)
        out = engine.run_to_completion([rid])[rid]
        with pytest.raises(RequestError, match="empty"):
            engine.prefetch([])
        with pytest.raises(RequestError, match="outside the vocabulary"):
            engine.prefetch([10**9])
        assert engine.prefetch(prompt, cache_salt="another tenant")["host_blocks"] == 0
    finally:
        engine.close()
    assert out.residency == "host" and out.num_restored_tokens == 96
    assert out.token_ids == reference.token_ids and out.logprobs == reference.logprobs
