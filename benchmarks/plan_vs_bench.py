"""Does `kvtier plan --hardware this-machine` predict what `kvtier bench` measures here?

One generated multi-turn trace is measured by the bench driver (the engine, in real time)
and simulated by the planner's discrete-event model with this machine's measured link and
prefill speed; TTFT p50 per residency class is printed side by side with the error.

    python benchmarks/plan_vs_bench.py [--sessions 10] [--device-sessions 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.bench.run import run_config
from kvtier.bench.trace import generate
from kvtier.model.loader import load_model
from kvtier.plan.hardware import resolve_hardware
from kvtier.plan.models import shape_from_spec
from kvtier.plan.simulate import simulate

TOLERANCE = 0.25


def fmt(seconds: float | None) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds is not None else "-"
KV_DTYPE = "fp32"  # kvtier on CPU keeps KV in float32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--device-sessions", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_model(None)
    trace = generate(num_sessions=args.sessions, turns=(3, 4), arrival_rate=0.5,
                     think_s=(4.0, 8.0), first_tokens=(200, 300), turn_tokens=(30, 50),
                     output_tokens=(8, 16), vocab_size=loaded.spec.vocab_size, seed=7)
    longest = max(sum(len(r.new_tokens) + r.output_tokens for r in reqs)
                  for reqs in trace.sessions().values())
    blocks = args.device_sessions * -(-longest // 16) + 8  # the device holds ~K sessions
    run = run_config(loaded, trace, "tier-auto", {
        "num_device_blocks": blocks, "kv_offloading_size": 1.0, "max_num_batched_tokens": 2048})
    measured: dict[str, list[float]] = {}
    for rec in run.records:
        measured.setdefault(rec["residency"], []).append(rec["ttft_s"])
    hardware = resolve_hardware("this-machine")
    sim = simulate(trace.requests, shape_from_spec(loaded.spec, "SmolLM2-135M"), hardware,
                   kv_dtype=KV_DTYPE, device_sessions=args.device_sessions)
    rows: list[dict[str, Any]] = []
    print(f"trace: {trace.num_sessions} sessions, {len(trace.requests)} turns; device pool "
          f"{blocks} blocks (~{args.device_sessions} sessions); {hardware.description}")
    print(f"{'class':<11} {'bench n':>7} {'bench p50':>10} {'plan n':>6} {'plan p50':>9} "
          f"{'error':>7}")
    for cls in ("resident", "host", "recomputed", "new"):
        got = measured.get(cls, [])
        pred = sim.ttft.get(cls, {})
        p50_b = statistics.median(got) if got else None
        p50_p = pred.get("p50") if pred else None
        err = abs(p50_p - p50_b) / p50_b if p50_b and p50_p is not None else None
        rows.append({"class": cls, "bench_n": len(got), "bench_p50_s": p50_b,
                     "plan_n": pred.get("count", 0) if pred else 0, "plan_p50_s": p50_p,
                     "relative_error": err, "within_25pct": err is not None and err <= TOLERANCE})
        print(f"{cls:<11} {len(got):>7} {fmt(p50_b):>10} {rows[-1]['plan_n']:>6} "
              f"{fmt(p50_p):>9} {f'{err:.0%}' if err is not None else '-':>7}")
    judged = [r for r in rows if r["relative_error"] is not None]
    ok = bool(judged) and all(r["within_25pct"] for r in judged)
    print(f"target: every class with both numbers within {TOLERANCE:.0%}: "
          f"{'PASS' if ok else 'MISS'}")
    path = write_result("plan_vs_bench", {"rows": rows, "pass": ok, "device_blocks": blocks,
                                          "hardware": hardware.description}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
