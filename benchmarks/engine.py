"""Prefill and decode throughput of kvtier against transformers on the same model and threads.

Decode at batch 1 streams every weight once per step, so achieved GB/s (weight bytes per
step / step time) is printed beside the copy peak measured in the same run.

    python benchmarks/engine.py [--model PATH] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_peak_gbps, write_result

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import LoadedModel, default_model_path, load_model
from kvtier.sequence import SamplingParams


def prompt(n: int, salt: int) -> list[int]:
    """Deterministic token ids that share nothing across salts (no prefix-cache help)."""
    return [(salt * 7919 + i * 31) % 40000 + 100 for i in range(n)]


def kvtier_prefill(engine: LLMEngine, n: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        rid = engine.add_request(prompt(n, 1000 + r), SamplingParams(max_tokens=1, temperature=0))
        out = engine.run_to_completion([rid])[rid]
        times.append(out.metrics.ttft_s)
    return n / min(times)


def kvtier_decode(engine: LLMEngine, batch: int, steps: int) -> tuple[float, float]:
    """(aggregate tokens/s, median step seconds) over `steps` pure decode steps."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    rids = [engine.add_request(prompt(128, 2000 + batch * 100 + i), params) for i in range(batch)]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    for _ in range(2):  # settle
        engine.step()
    durations = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - t)
    for rid in rids:
        engine.abort(rid)
    return batch * steps / sum(durations), statistics.median(durations)


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@torch.inference_mode()
def hf_prefill(model: Any, n: int, repeats: int) -> float:
    best = float("inf")
    for r in range(repeats):
        ids = torch.tensor([prompt(n, 3000 + r)])
        t = time.perf_counter()
        model(ids, use_cache=True)
        best = min(best, time.perf_counter() - t)
    return n / best


@torch.inference_mode()
def hf_decode(model: Any, batch: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([prompt(128, 4000 + i) for i in range(batch)])
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(2):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    t = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    return batch * steps / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--out", default=None, help="directory for the JSON (benchmarks/results)")
    args = ap.parse_args()
    repeats, steps = (1, 8) if args.quick else (3, 24)
    lengths, batches = (128, 512, 2048), (1, 8, 32)

    loaded: LoadedModel = load_model(args.model)
    engine = LLMEngine(EngineConfig.from_knobs(
        model=args.model, enable_prefix_caching=False, max_num_seqs=64,
        max_num_batched_tokens=2048, kv_cache_size=2.0), loaded=loaded)
    weight_bytes = engine.runner.weight_bytes_per_step
    copy_samples = [copy_peak_gbps()]
    rows: dict[str, dict[str, Any]] = {"kvtier": {}, "transformers": {}}
    for n in lengths:
        rows["kvtier"][f"prefill_{n}"] = kvtier_prefill(engine, n, repeats)
    step_s: dict[int, float] = {}
    for b in batches:
        rows["kvtier"][f"decode_b{b}"], step_s[b] = kvtier_decode(engine, b, steps)
        if b == 1:  # the roofline right beside the measurement it judges
            copy_samples.append(copy_peak_gbps())
    if not args.no_transformers and args.model is None:
        model = hf_model(default_model_path())
        for n in lengths:
            rows["transformers"][f"prefill_{n}"] = hf_prefill(model, n, repeats)
        for b in batches:
            rows["transformers"][f"decode_b{b}"] = hf_decode(model, b, steps)
        del model
    copy_samples.append(copy_peak_gbps())
    # This VM's memory bandwidth drifts by +-20% between minutes: judge against the best copy
    # seen in the run (the strictest roofline) and keep every sample in the JSON.
    copy_peak = max(copy_samples)
    achieved = {name: r["decode_b1"] * weight_bytes / 1e9 for name, r in rows.items() if r}

    print(f"model {loaded.source}  weights/step {weight_bytes / 1e6:.0f} MB  "
          f"threads {torch.get_num_threads()}  copy peak {copy_peak:.1f} GB/s "
          f"(samples {', '.join(f'{c:.1f}' for c in copy_samples)})")
    print(f"{'tokens/s':<14}" + "".join(f"{name:>14}" for name in rows if rows[name]))
    for key in [f"prefill_{n}" for n in lengths] + [f"decode_b{b}" for b in batches]:
        print(f"{key:<14}" + "".join(f"{r[key]:>14.1f}" for r in rows.values() if r))
    for name, gbps in achieved.items():
        print(f"{name}: batch-1 decode {gbps:.1f} GB/s = {gbps / copy_peak:.0%} of copy peak")
    k = rows["kvtier"]
    targets = {
        "b1_decode_ge_75pct_roofline": achieved["kvtier"] >= 0.75 * copy_peak,
        "b32_ge_10x_b1": k["decode_b32"] >= 10 * k["decode_b1"],
    }
    if rows["transformers"]:
        targets["prefill_2048_ge_transformers"] = (
            k["prefill_2048"] >= rows["transformers"]["prefill_2048"])
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    path = write_result("engine", {
        "model": loaded.source, "weight_bytes_per_step": weight_bytes,
        "copy_peak_gbps": copy_peak, "copy_samples_gbps": copy_samples,
        "tokens_per_s": rows, "decode_b1_gbps": achieved,
        "decode_step_s": step_s, "targets": targets,
    }, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
