"""`kvtier plan`'s arithmetic: the seed's 70B example, the published 2x-22x, sessions by hand."""

import json
import re

import pytest

from kvtier.errors import ConfigError
from kvtier.plan.analysis import analyze, planner_for
from kvtier.plan.hardware import GIB, HARDWARE, Hardware, meminfo_gib, resolve_hardware
from kvtier.plan.models import MODELS, ModelShape, resolve_model
from kvtier.tier.planner import Calibration, Planner

A100 = HARDWARE["a100-80g-pcie-gen4"]
H100 = HARDWARE["h100-sxm"]


def test_seed_70b_8000_tokens_restore_wins_by_an_order_of_magnitude() -> None:
    # 80 layers, 8 KV heads, head dim 128, fp16 -> 327,680 B/token; 8,000 tokens -> 2.62 GB
    model = MODELS["llama-3.1-70b"]
    one_gpu = analyze(model, A100, "fp16", [8000], tensor_parallel=1).contexts[0]
    assert one_gpu.kv_bytes_per_token == 327_680
    assert one_gpu.session_bytes == 2_621_440_000
    assert one_gpu.transfer_s == pytest.approx(0.1048576)  # ~100 ms over one 25 GB/s link
    assert 1.0 < one_gpu.recompute_s < 10.0  # one A100: seconds of prefill
    assert one_gpu.decision == "restore" and one_gpu.speedup > 10
    node = analyze(model, A100, "fp16", [8000], tensor_parallel=8).contexts[0]
    assert 0.5 < node.recompute_s < 2.0  # a whole 8x A100 node: "about a second"
    assert node.decision == "restore"


def test_llama_8b_on_h100_spans_the_published_2x_to_22x() -> None:
    contexts = [1024, 2048, 8192, 32768, 65536, 131072]
    plan = analyze(MODELS["llama-3.1-8b"], H100, "fp16", contexts)
    speedups = [c.speedup for c in plan.contexts]
    assert speedups == sorted(speedups)  # recompute grows faster than restore
    assert 1.2 <= speedups[0] <= 5  # short prompts: the fixed wake cost dominates
    assert 12 <= speedups[4] <= 40  # 64k tokens: attention's T^2 dominates recompute
    assert speedups[-1] <= 40
    assert all(c.decision == "restore" for c in plan.contexts)


def test_fp8_halves_the_bytes_and_the_transfer() -> None:
    model = MODELS["qwen2.5-7b"]
    fp16 = analyze(model, H100, "fp16", [4096]).contexts[0]
    fp8 = analyze(model, H100, "fp8", [4096]).contexts[0]
    assert model.kv_bytes_per_token("fp16") == 2 * 28 * 4 * 128 * 2
    assert fp8.session_bytes * 2 == fp16.session_bytes
    assert fp8.transfer_s * 2 == pytest.approx(fp16.transfer_s)
    assert fp8.recompute_s == fp16.recompute_s
    with pytest.raises(ConfigError, match="fp16, bf16, fp8"):
        model.kv_bytes_per_token("int4")


def test_crossover_falls_as_the_link_gets_faster() -> None:
    model = MODELS["mistral-7b"]
    crossovers = []
    for gbps in (2, 5, 10, 25, 50, 450):
        plan = analyze(model, HARDWARE["l40s"].with_overrides(link_gbps=gbps), "fp16", [1000])
        crossovers.append(plan.crossover_tokens)
    assert all(c is not None for c in crossovers)
    assert crossovers == sorted(crossovers, reverse=True) and len(set(crossovers)) == 6
    # the crossover is where the decision flips
    planner = planner_for(model, HARDWARE["l40s"].with_overrides(link_gbps=2))
    per_token, cross = model.kv_bytes_per_token("fp16"), crossovers[0]
    assert planner.decide(int(cross * 0.9), int(cross * 0.9) * per_token).choice == "recompute"
    assert planner.decide(int(cross * 1.1), int(cross * 1.1) * per_token).choice == "restore"


def test_sessions_per_node_by_hand() -> None:
    # 2 GPUs x 80 GiB, 100 GiB RAM; weights 10 GiB; 1 KiB/token; sessions of 1,024 tokens = 1 MiB
    toy = ModelShape("toy", num_layers=2, num_kv_heads=1, head_dim=128, hidden_size=256,
                     num_params=5 * GIB, vocab_size=1000)
    hw = Hardware("toy", hbm_gib=80, host_gib=100, link_gbps=10, flops=1e14, mfu=0.5,
                  transfer_overhead_s=0.001, hbm_gbps=1000, gpus=2)
    plan = analyze(toy, hw, "fp16", [1024])
    c = plan.contexts[0]
    assert (plan.tensor_parallel, plan.replicas) == (1, 2)
    assert c.session_bytes == 1024 * 1024
    assert plan.kv_room_bytes == int(80 * 0.9 * GIB - 10 * GIB)  # 62 GiB per GPU
    assert c.sessions_device == 2 * 62 * 1024
    assert plan.host_pool_bytes == 25 * GIB  # half the RAM, split over 2 replicas
    assert c.sessions_with_tier == 2 * 62 * 1024 + 2 * 25 * 1024
    assert plan.pinned_bytes == 50 * GIB and plan.warnings == ()
    big = analyze(toy, hw, "fp16", [1024], host_pool_gib=45)  # 90 GiB pinned of 100
    assert any("pinned host pool 90.0 GiB exceeds 80%" in w for w in big.warnings)
    json.dumps(big.to_json())


def test_seventy_b_picks_four_gpus_and_warns_when_forced_onto_one() -> None:
    plan = analyze(MODELS["llama-3.1-70b"], A100, "fp16", [8000])
    assert (plan.tensor_parallel, plan.replicas) == (4, 2)
    forced = analyze(MODELS["llama-3.1-70b"], A100, "fp16", [8000], tensor_parallel=1)
    assert forced.contexts[0].sessions_device == 0 and "no KV room" in forced.warnings[0]
    with pytest.raises(ConfigError, match="--tp 16"):
        analyze(MODELS["llama-3.1-70b"], A100, "fp16", [8000], tensor_parallel=16)
    with pytest.raises(ConfigError, match="positive"):
        analyze(MODELS["llama-3.1-70b"], A100, "fp16", [0])


def test_attention_term_in_the_shared_planner() -> None:
    # 1,000 tok/s linear, a = 1e-6 s/token^2: 2,000 tokens -> 2 s + 1e-6 * 4e6 / 2 = 4 s
    p = Planner(Calibration(10.0, 0.5, 1000.0, attention_s_per_token2=1e-6))
    assert p.recompute_s(2000) == pytest.approx(4.0)
    assert p.prefill_s(1000, cached_tokens=1000) == pytest.approx(p.recompute_s(2000)
                                                                  - p.recompute_s(1000))
    # 1 MB/token at 10 GB/s: linear gain 1e-3 - 1e-4 = 9e-4 s/token; the quadratic closes it
    cross = p.crossover_tokens(1e6)
    assert cross is not None
    assert p.restore_s(int(cross * 1e6)) == pytest.approx(p.recompute_s(cross), rel=1e-3)
    # a link too slow for the linear term alone still wins once attention dominates
    slow = Planner(Calibration(0.5, 0.0, 20000.0, attention_s_per_token2=1e-8))
    assert Planner(Calibration(0.5, 0.0, 20000.0)).crossover_tokens(40960) is None
    assert slow.crossover_tokens(40960) == pytest.approx((40960 / 0.5e9 - 1 / 20000) * 2 / 1e-8)
    # observe_prefill refines only the linear term, net of the modelled attention
    p.observe_prefill(2000, 3.0)  # 3 s - 2 s of attention -> 2,000 tok/s measured
    assert p.calibration.prefill_tokens_per_s == pytest.approx(0.8 * 1000 + 0.2 * 2000)
    assert p.calibration.attention_s_per_token2 == 1e-6


def test_model_from_a_config_json_estimates_params(tmp_path) -> None:
    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    shape = resolve_model(str(tmp_path))
    assert shape.num_params == pytest.approx(8.03e9, rel=0.005)
    assert shape.kv_bytes_per_token("bf16") == MODELS["llama-3.1-8b"].kv_bytes_per_token("bf16")
    qwen = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "tie_word_embeddings": False}
    (tmp_path / "qwen.json").write_text(json.dumps(qwen))
    assert resolve_model(str(tmp_path / "qwen.json")).num_params == pytest.approx(7.61e9,
                                                                                   rel=0.005)
    (tmp_path / "moe.json").write_text(json.dumps({**llama, "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match="mixtral"):
        resolve_model(str(tmp_path / "moe.json"))
    with pytest.raises(ConfigError, match=re.escape("llama-3.1-8b, llama-3.1-70b")):
        resolve_model("llama-9")


def test_hardware_overrides_and_errors() -> None:
    hw = resolve_hardware("h100-sxm", link_gbps=20.0, mfu=None)
    assert hw.link_gbps == 20.0 and hw.mfu == H100.mfu
    with pytest.raises(ConfigError, match=re.escape("mfu=1.5")):
        resolve_hardware("h100-sxm", mfu=1.5)
    with pytest.raises(ConfigError, match=r"'tpu-v9' is not a preset.*gh200-nvlink-c2c.*this-mach"):
        resolve_hardware("tpu-v9")
    assert meminfo_gib("MemTotal", "MemTotal:  2097152 kB\nMemFree: 1 kB\n") == 2.0
