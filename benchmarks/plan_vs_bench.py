"""Does `kvtier plan` on this machine predict where `kvtier bench`'s TTFT goes, per class?

One trace (`kvtier bench`'s default generator, or a file with bench's loader flags) is
replayed in real time by kvtier's engine in-process on the embedded default model, and
simulated by the planner's discrete-event model with this machine measured
(`--hardware this-machine`) and the same device pool, host pool, preemption mode and
idle offload. Prints queue / tier / compute / TTFT p50 and p90 per residency class, plan
beside bench, and writes both to JSON. A bench split the engine does not report yet prints
as "-".

    python benchmarks/plan_vs_bench.py [--trace F --format auto --scale-length 1
        --time-scale 1 --limit N] [--sessions 16] [--config tier-auto | NAME:KNOB=V,...]
        [--device-sessions K] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.bench.cli import DEFAULT_BASE, DEFAULT_CONFIGS, parse_config
from kvtier.bench.run import run_config
from kvtier.bench.split import split_summary
from kvtier.bench.trace import FORMATS, generate, load_trace
from kvtier.config import EngineConfig
from kvtier.engine.stats import percentile
from kvtier.errors import ConfigError, KvtierError
from kvtier.model.loader import load_model
from kvtier.plan.analysis import ACTIVATION_FRACTION, HOST_USABLE_FRACTION
from kvtier.plan.hardware import GIB, Hardware, resolve_hardware
from kvtier.plan.models import ModelShape, shape_from_spec
from kvtier.plan.simulate import SimConfig, SimResult, simulate
from kvtier.sequence import RESIDENCY_CLASSES, SPLIT_PARTS
from kvtier.tier import LoadPolicy

PARTS = (*SPLIT_PARTS, "ttft")
KV_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
Stats = dict[str, dict[str, Any]]  # class -> {"count": n, part: {"p50", "p90"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", default=None, help="JSONL (kvtier schema) or Mooncake trace")
    ap.add_argument("--format", default="auto", choices=FORMATS)
    ap.add_argument("--scale-length", type=float, default=1.0, help="as kvtier bench")
    ap.add_argument("--time-scale", type=float, default=1.0, help="as kvtier bench")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of --trace")
    ap.add_argument("--sessions", type=int, default=16, help="generator: number of sessions")
    ap.add_argument("--config", default="tier-auto",
                    help=f"{' | '.join(DEFAULT_CONFIGS)} or NAME:KNOB=V,... over bench's base")
    ap.add_argument("--device-sessions", type=int, default=None,
                    help="simulate a device pool of K sessions instead of the bench's bytes")
    ap.add_argument("--out", default=None, help="directory for the JSON (benchmarks/results)")
    return ap.parse_args(argv)


def make_trace(args: argparse.Namespace, vocab: int) -> Any:
    """The file through bench's loader, or the generator call `kvtier bench` makes by default."""
    if args.trace:
        return load_trace(args.trace, vocab, fmt=args.format, scale_length=args.scale_length,
                          time_scale=args.time_scale, limit=args.limit)
    return generate(num_sessions=args.sessions, turns=(3, 5), arrival_rate=0.8,
                    think_s=(3.0, 8.0), first_tokens=(150, 300), turn_tokens=(20, 60),
                    output_tokens=(8, 24), vocab_size=vocab, seed=0)


def config_knobs(text: str) -> tuple[str, dict[str, Any]]:
    """A default configuration by name, or bench's NAME:KNOB=V syntax, over bench's base."""
    if text in DEFAULT_CONFIGS:
        return text, {**DEFAULT_BASE, **DEFAULT_CONFIGS[text]}
    if ":" not in text:
        raise ConfigError(f"--config {text!r}: choose {' or '.join(DEFAULT_CONFIGS)}, or give "
                          "NAME:KNOB=VALUE[,KNOB=VALUE...]")
    name, knobs = parse_config(text)
    return name, {**DEFAULT_BASE, **knobs}


def kv_dtype_of(config: EngineConfig) -> str:
    """The KV dtype the engine will keep: its weights' dtype (auto: fp32 on CPU, bf16 CUDA)."""
    if config.dtype != "auto":
        return KV_DTYPES[config.dtype]
    import torch

    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return "bf16" if cuda else "fp32"


def sim_machine(measured: Hardware, config: EngineConfig, model: ModelShape,
                kv_dtype: str) -> tuple[Hardware, dict[str, Any]]:
    """This machine with the bench's pools: HBM such that the KV room is the bench's
    num_device_blocks x block_size tokens, host RAM such that the host pool is its size."""
    blocks, block_size = config.cache.num_device_blocks, config.cache.block_size
    if blocks is None:
        room = config.cache.kv_cache_size * GIB
        tokens = int(room // model.kv_bytes_per_token(kv_dtype))
    else:
        tokens = blocks * block_size
        room = tokens * model.kv_bytes_per_token(kv_dtype)
    host_pool = config.offload.kv_offloading_size * GIB
    machine = measured.with_overrides(
        gpus=1, hbm_gib=(room + model.weights_bytes) / GIB / (1 - ACTIVATION_FRACTION),
        host_gib=max(host_pool, 1.0) / GIB / HOST_USABLE_FRACTION)  # 1 B: no host tier
    pool = {"device_blocks": blocks, "block_size": block_size, "device_tokens": tokens,
            "device_kv_bytes": room, "host_pool_bytes": host_pool, "kv_dtype": kv_dtype}
    return machine, pool


def bench_stats(records: list[dict[str, Any]]) -> Stats:
    """Per class: count, the report's own queue / tier / compute p50 and p90 (None where no
    record carries a split), and TTFT's."""
    split = split_summary(records, RESIDENCY_CLASSES)
    out: Stats = {}
    for cls, entry in split.items():
        chosen = [r for r in records if cls in ("all", r.get("residency"))]
        if not chosen:
            continue
        ttft = [r["ttft_s"] for r in chosen if r.get("ttft_s") is not None]
        out[cls] = {"count": len(chosen), **{part: entry[part] for part in SPLIT_PARTS},
                    "ttft": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90)}}
    return out


def plan_stats(sim: SimResult) -> Stats:
    """The simulation's per-class tables in `bench_stats`' shape (TTFT p90 from its records)."""
    out: Stats = {}
    for cls, ttft in sim.ttft.items():
        if not ttft["count"]:
            continue
        values = [r.ttft_s for r in sim.records if cls in ("all", r.residency)]
        out[cls] = {"count": ttft["count"], **sim.split[cls],
                    "ttft": {"p50": ttft["p50"], "p90": percentile(values, 90)}}
    return out


def compare(bench: Stats, plan: Stats) -> list[dict[str, Any]]:
    """One row per class and part: bench and plan p50 / p90, and the p50's relative error."""
    rows = []
    for cls in ("all", *RESIDENCY_CLASSES):
        if cls not in bench and cls not in plan:
            continue
        b, p = bench.get(cls, {}), plan.get(cls, {})
        for part in PARTS:
            bp, pp = b.get(part, {}), p.get(part, {})
            b50, p50 = bp.get("p50"), pp.get("p50")
            rows.append({"class": cls, "part": part, "bench_n": b.get("count", 0),
                         "plan_n": p.get("count", 0), "bench_p50_s": b50, "plan_p50_s": p50,
                         "bench_p90_s": bp.get("p90"), "plan_p90_s": pp.get("p90"),
                         "p50_error": (p50 - b50) / b50 if b50 and p50 is not None else None})
    return rows


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'class':<11} {'part':<8} {'n b/p':>7} {'bench p50':>10} {'plan p50':>10} "
          f"{'bench p90':>10} {'plan p90':>10} {'p50 err':>8}")
    for r in rows:
        err = "-" if r["p50_error"] is None else f"{r['p50_error']:+.0%}"
        cls = r["class"] if r["part"] == PARTS[0] else ""
        print(f"{cls:<11} {r['part']:<8} {r['bench_n']:>3}/{r['plan_n']:<3} "
              f"{ms(r['bench_p50_s']):>10} {ms(r['plan_p50_s']):>10} "
              f"{ms(r['bench_p90_s']):>10} {ms(r['plan_p90_s']):>10} {err:>8}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Bench the trace, measure this machine, simulate the same trace; print and report."""
    loaded = load_model(None)
    trace = make_trace(args, loaded.spec.vocab_size)
    name, knobs = config_knobs(args.config)
    config = EngineConfig.from_knobs(model=loaded.source, **knobs)
    bench = run_config(loaded, trace, name, knobs)
    model = shape_from_spec(loaded.spec, str(loaded.source))
    kv_dtype = kv_dtype_of(config)
    measured = resolve_hardware("this-machine")
    machine, pool = sim_machine(measured, config, model, kv_dtype)
    tier_on = config.offload.kv_offloading_size > 0
    offload, policy = config.offload, config.policy
    sim = simulate(trace.requests, model, machine, kv_dtype, SimConfig(
        device_sessions=args.device_sessions, preemption_mode=policy.preemption_mode,
        idle_offload_s=policy.idle_offload_s if tier_on else 0.0,
        load_policy=LoadPolicy.parse(offload.load_policy),
        max_load_gbps=offload.max_load_gbps if tier_on else None,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens))
    sizing = (f"{args.device_sessions} sessions (device_sessions)" if args.device_sessions
              else f"{pool['device_tokens']:,} tokens = {pool['device_kv_bytes'] / 1e6:.1f} MB "
                   f"{kv_dtype} KV (hbm_gib override, device_sessions unused)")
    print(f"trace: {trace.source}, {len(trace.requests)} requests; config {name}: "
          f"{pool['device_blocks']} blocks x {pool['block_size']} tokens")
    print(f"plan device pool: {sizing}; host pool {pool['host_pool_bytes'] / GIB:.2f} GiB; "
          f"{measured.description}")
    rows = compare(bench_stats(bench.records), plan_stats(sim))
    print_table(rows)
    busy = bench.engine.get("busy_s")  # the engine's time in steps, where it reports it
    print(f"compute busy: plan {sim.compute_busy_s:.2f} s ({sim.compute_utilisation:.0%} of "
          f"{sim.makespan_s:.1f} s), bench {'-' if busy is None else f'{busy:.2f} s'} "
          f"(wall {bench.wall_s:.1f} s)")
    return {"trace": trace.source,
            "config": name, "knobs": knobs, "pool": pool, "device_sessions": args.device_sessions,
            "hardware": asdict(machine), "rows": rows, "plan": sim.to_json(),
            "bench": {"wall_s": bench.wall_s, "engine": bench.engine,
                      "records": bench.records, "rejected": bench.rejected}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        doc = run(args)
    except KvtierError as e:
        print(f"plan_vs_bench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {write_result('plan_vs_bench', doc, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
