"""Wake-up latency: TTFT of a short follow-up when the session is resident on the device,
restored from host (layerwise and async) and recomputed, at several session lengths.

Restore GB/s (p50 of the restores) is printed beside this machine's copy peak measured in the
same run (best of its samples; target: 0.8x), and the best restore beside the same peak (like
against like: memory bandwidth on a shared VM moves from minute to minute), the planner's
predicted restore and recompute times beside the measured ones, and the layer-wise wake
against the async one (the default, load_mode=auto, picks async on a CPU).

    python benchmarks/wake.py [--model PATH] [--lengths 512,2048,4096] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_peak_gbps, write_result

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.model.loader import load_model
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams

FOLLOW_UP = 16  # tokens of the new user message
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def ask(engine: LLMEngine, prompt: list[int]) -> RequestOutput:
    rid = engine.add_request(prompt, PARAMS)
    return engine.run_to_completion([rid])[rid]


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def measure(engine: LLMEngine, length: int, repeats: int, rng: random.Random, vocab: int,
            mode: str) -> list[RequestOutput]:
    """Run `repeats` sessions of `length` tokens, then wake each with a follow-up."""
    outs = []
    for _ in range(repeats):
        session = tokens(rng, length, vocab)
        ask(engine, session)  # the session's first turn: its KV is cached (and written down)
        engine.drain()  # a user thinks for seconds: the write-through has landed
        follow = session + tokens(rng, FOLLOW_UP, vocab)
        if mode == "host":
            engine.demote_cached()  # the session went idle: its KV is on host only
        elif mode == "recompute":
            follow = tokens(rng, length + FOLLOW_UP, vocab)  # nothing of it is cached anywhere
        out = ask(engine, follow)
        expected = {"resident": "resident", "host": "host", "recompute": "new"}[mode]
        assert out.residency == expected, (mode, out.residency)
        outs.append(out)
        engine.demote_cached()
    return outs


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    loaded = load_model(args.model)
    vocab = loaded.spec.vocab_size
    blocks = max(lengths) // 16 * 2 + 64
    engines = {
        mode: LLMEngine(EngineConfig.from_knobs(
            model=args.model, num_device_blocks=blocks, kv_offloading_size=1.0,
            load_mode=mode, preemption_mode="auto", max_num_batched_tokens=8192), loaded=loaded)
        for mode in ("layerwise", "async")
    }
    copy_samples = [copy_peak_gbps()]
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    for length in lengths:
        e = engines["async"]
        resident = measure(e, length, args.repeats, rng, vocab, "resident")
        recomputed = measure(e, length, max(1, args.repeats - 1), rng, vocab, "recompute")
        woken = {m: measure(engines[m], length, args.repeats, rng, vocab, "host")
                 for m in engines}
        copy_samples.append(copy_peak_gbps())
        nbytes = woken["async"][0].restore_bytes
        predicted = e.tier.manager.decide(length + FOLLOW_UP, nbytes)  # the planner's view
        # The same bytes copied once by a bare tensor copy, right beside the restores: the
        # ceiling for this transfer size on this machine at this minute.
        same_size = copy_peak_gbps(mib=max(1, round(nbytes / 2**20)))
        row: dict[str, Any] = {
            "length": length, "restore_bytes": nbytes, "same_size_copy_gbps": same_size,
            "ttft_resident_s": median([o.metrics.ttft_s for o in resident]),
            "ttft_recompute_s": median([o.metrics.ttft_s for o in recomputed]),
            "predicted_restore_s": predicted.restore_s,
            "predicted_recompute_s": predicted.recompute_s,
        }
        for m, outs in woken.items():
            row[f"ttft_host_{m}_s"] = median([o.metrics.ttft_s for o in outs])
            row[f"restore_{m}_s"] = median([o.metrics.restore_s for o in outs])
            rates = [o.restore_bytes / o.metrics.restore_s / 1e9
                     for o in outs if o.metrics.restore_s > 0]
            row[f"restore_{m}_gbps"] = median(rates)
            # best of the restores beside the best of the copy samples: like against like
            row[f"restore_{m}_best_gbps"] = max(rates, default=float("nan"))
        rows.append(row)
    copy_peak = max(copy_samples)
    for e in engines.values():
        e.close()

    print(f"model {loaded.source}; copy peak {copy_peak:.1f} GB/s "
          f"(samples {', '.join(f'{c:.1f}' for c in copy_samples)})")
    head = (f"{'tokens':>6} {'MB':>6} {'resident':>9} {'host/lw':>8} {'host/async':>10} "
            f"{'recompute':>9} {'restore':>8} {'GB/s':>5} {'x peak':>6} {'x same':>6} "
            f"{'best x peak':>11} "
            f"{'pred rest':>9} {'pred recomp':>11} {'recomp/lw':>9}")
    print(head)
    targets: dict[str, bool] = {}
    for r in rows:
        gbps = r["restore_async_gbps"]
        speedup = r["ttft_recompute_s"] / r["ttft_host_layerwise_s"]
        print(f"{r['length']:>6} {r['restore_bytes'] / 1e6:>6.1f} "
              f"{r['ttft_resident_s'] * 1e3:>8.1f}ms {r['ttft_host_layerwise_s'] * 1e3:>6.1f}ms "
              f"{r['ttft_host_async_s'] * 1e3:>8.1f}ms {r['ttft_recompute_s'] * 1e3:>7.0f}ms "
              f"{r['restore_async_s'] * 1e3:>6.1f}ms {gbps:>5.1f} {gbps / copy_peak:>6.2f} "
              f"{gbps / r['same_size_copy_gbps']:>6.2f} "
              f"{r['restore_async_best_gbps'] / copy_peak:>11.2f} "
              f"{r['predicted_restore_s'] * 1e3:>7.1f}ms "
              f"{r['predicted_recompute_s'] * 1e3:>9.0f}ms {speedup:>8.0f}x")
        budget = r["ttft_resident_s"] + 1.25 * r["restore_bytes"] / (copy_peak * 1e9)
        targets[f"restore_ge_0.8x_peak@{r['length']}"] = gbps >= 0.8 * copy_peak
        targets[f"restore_ge_0.8x_same_size_copy@{r['length']}"] = (
            gbps >= 0.8 * r["same_size_copy_gbps"])
        targets[f"layerwise_ttft_le_resident_plus_1.25x_copy@{r['length']}"] = (
            r["ttft_host_layerwise_s"] <= budget)
        targets[f"layerwise_not_slower_than_async@{r['length']}"] = (
            r["ttft_host_layerwise_s"] <= r["ttft_host_async_s"])
        if r["length"] == 2048:
            targets["woken_2048_ge_50x_faster_than_recompute"] = speedup >= 50
    for name, ok in targets.items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    from kvtier.config import LoadMode

    chosen = LoadMode.AUTO.on("cpu").value
    slower = [r["length"] for r in rows if r["ttft_host_layerwise_s"] > r["ttft_host_async_s"]]
    print(f"load_mode=auto on a CPU picks {chosen}: layer-wise was slower than async at "
          f"{', '.join(map(str, slower)) or 'no'} of the measured lengths in this run")
    path = write_result("wake", {"model": loaded.source, "copy_peak_gbps": copy_peak,
                                 "copy_samples_gbps": copy_samples, "rows": rows,
                                 "targets": targets}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
