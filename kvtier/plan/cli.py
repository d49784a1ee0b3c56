"""`kvtier plan`: restore vs recompute, sessions per node and pinned memory for real hardware.

Primitives: `add_plan_args(subparsers)` registers the subcommand, `run_plan(args) -> int`
prints a table (or `--json`), and with `--trace` the simulated TTFT per residency class and
its queue / tier / compute split. The trace flags are `kvtier bench`'s, passed to the same
loader the same way, so plan and bench can replay one trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.trace import FORMATS
from kvtier.errors import ConfigError
from kvtier.plan.analysis import (
    ACTIVATION_FRACTION,
    HOST_USABLE_FRACTION,
    PlanResult,
    analyze,
)
from kvtier.plan.hardware import GIB, hardware_names, resolve_hardware
from kvtier.plan.models import KV_DTYPE_BYTES, MODELS, ModelShape, kv_dtype_bytes, resolve_model
from kvtier.tier import LoadPolicy

if TYPE_CHECKING:
    from kvtier.plan.simulate import SimResult

DEFAULT_CONTEXTS = "1024,8192,32768,131072"
# trace flag -> its default: set without --trace, it would do nothing
_TRACE_DEFAULTS = {"--format": "auto", "--scale-length": 1.0, "--time-scale": 1.0,
                   "--limit": None, "--device-sessions": None, "--idle-offload-s": 0.0,
                   "--load-policy": "auto", "--max-load-gbps": None, "--max-num-seqs": None,
                   "--clients": None}
# flag dest -> Hardware field it overrides
_OVERRIDES = {"hbm_gib": "hbm_gib", "host_gib": "host_gib", "link_gbps": "link_gbps",
              "prefill_tps": "prefill_tps", "flops": "flops", "mfu": "mfu",
              "hbm_gbps": "hbm_gbps", "gpus": "gpus", "transfer_overhead_s": "transfer_overhead_s"}


def add_plan_args(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on the top-level subparsers; it dispatches to `run_plan`."""
    p = subparsers.add_parser("plan", help="restore vs recompute and sessions per node on "
                                           "real hardware (analytic; --trace simulates)")
    p.add_argument("--model", default="llama-3.1-8b",
                   help=f"preset ({', '.join(MODELS)}) or a path to a HF config.json or its "
                        "directory")
    p.add_argument("--kv-dtype", default="fp16", help=f"{' | '.join(KV_DTYPE_BYTES)}")
    p.add_argument("--context", default=DEFAULT_CONTEXTS, help="token counts, N[,N...]")
    p.add_argument("--hardware", default="h100-sxm",
                   help=f"preset: {', '.join(hardware_names())} (this-machine measures now)")
    num = p.add_argument_group("override the preset (per GPU unless said)")
    num.add_argument("--hbm-gib", type=float, default=None, help="GPU memory per GPU")
    num.add_argument("--host-gib", type=float, default=None, help="host RAM of the node")
    num.add_argument("--link-gbps", type=float, default=None,
                     help="effective host->device GB/s per GPU")
    num.add_argument("--prefill-tps", type=float, default=None,
                     help="measured prefill tokens/s of this model (replaces FLOPs x MFU)")
    num.add_argument("--flops", type=float, default=None, help="dense FLOP/s, e.g. 989e12")
    num.add_argument("--mfu", type=float, default=None, help="prefill FLOPs utilisation 0..1")
    num.add_argument("--hbm-gbps", type=float, default=None, help="GPU memory GB/s")
    num.add_argument("--gpus", type=int, default=None, help="GPUs per node")
    num.add_argument("--transfer-overhead-s", type=float, default=None,
                     help="fixed cost of one wake, seconds")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallel size (default: smallest that leaves room for KV)")
    p.add_argument("--kv-offloading-size", type=float, default=None,
                   help=f"host pool GiB per replica (default: "
                        f"{HOST_USABLE_FRACTION * 100:.0f}%% of RAM split across replicas)")
    _add_trace_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)
    return p


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    """The simulation's flags; the loader's ones mean what they mean to `kvtier bench`."""
    sim = p.add_argument_group("simulate a trace")
    sim.add_argument("--trace", default=None, help="kvtier JSONL or Mooncake trace")
    sim.add_argument("--format", default="auto", choices=FORMATS)
    sim.add_argument("--scale-length", type=float, default=1.0,
                     help="Mooncake: shrink lengths (and the 512-token hash block) by F")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="stretch (>1) or compress (<1) arrivals and think times")
    sim.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    sim.add_argument("--device-sessions", type=int, default=None,
                     help="device pool holds N sessions (default: HBM bytes)")
    sim.add_argument("--idle-offload-s", type=float, default=0.0,
                     help="demote sessions idle this long to host, as the engine knob "
                          "(default 0: only under pressure)")
    sim.add_argument("--load-policy", default="auto",
                     help="restore or recompute a session found on host, as the engine's "
                          "knob: auto | always | never | threshold:TOKENS:INFLIGHT")
    sim.add_argument("--max-load-gbps", type=float, default=None,
                     help="cap host->device restores at this GB/s, as the engine's knob")
    sim.add_argument("--max-num-seqs", type=int, default=None,
                     help="turns running at once, as vLLM's knob (default: the pool bounds it)")
    sim.add_argument("--clients", type=int, default=None,
                     help="closed loop: at most N turns sent and unfinished, as a benchmark's "
                          "max concurrency (default: open loop, the trace's arrivals)")


def parse_contexts(text: str) -> list[int]:
    """'1000,8000' -> [1000, 8000]; anything else -> ConfigError naming the bad piece."""
    out = []
    for piece in str(text).split(","):
        piece = piece.strip().replace("_", "")
        if not piece.isdigit() or int(piece) < 1:
            raise ConfigError(f"--context {text!r}: {piece!r} is not a positive token count; "
                              "give N[,N...], e.g. --context 1024,8192")
        out.append(int(piece))
    return out


def run_plan(args: argparse.Namespace) -> int:
    """Analyse (and with --trace simulate), then print; ConfigError on a bad flag."""
    def opt(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    kv_dtype = opt("kv_dtype", "fp16")
    kv_dtype_bytes(kv_dtype)
    _check_trace_flags(args)
    contexts = parse_contexts(opt("context", DEFAULT_CONTEXTS))
    model = resolve_model(opt("model", "llama-3.1-8b"))
    hardware = resolve_hardware(opt("hardware", "h100-sxm"),
                                **{field: opt(dest) for dest, field in _OVERRIDES.items()})
    result = analyze(model, hardware, kv_dtype, contexts, tensor_parallel=opt("tp"),
                     host_pool_gib=opt("kv_offloading_size"))
    sim = None
    if opt("trace"):
        from kvtier.plan.simulate import SimConfig, simulate

        config = SimConfig(device_sessions=opt("device_sessions"),
                           idle_offload_s=opt("idle_offload_s", 0.0),
                           load_policy=LoadPolicy.parse(opt("load_policy", "auto")),
                           max_load_gbps=opt("max_load_gbps"),
                           max_num_seqs=opt("max_num_seqs"), clients=opt("clients"))
        config.check()  # a bad knob is said before the trace is read
        requests = _load_trace(args, model)
        sim = simulate(requests, model, hardware, kv_dtype, config)
    if opt("json"):
        report = result.to_json()
        if sim is not None:
            report["simulation"] = sim.to_json()
        print(json.dumps(report, indent=2))
        return 0
    _print_plan(result)
    if sim is not None:
        _print_sim(sim, opt("trace"), result)
    return 0


def _check_trace_flags(args: argparse.Namespace) -> None:
    """A trace flag without --trace would be silently ignored: say so instead."""
    if getattr(args, "trace", None):
        return
    for flag, default in _TRACE_DEFAULTS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), default)
        if value != default:
            raise ConfigError(f"{flag} {value} applies to a simulated trace; add --trace FILE "
                              f"or drop {flag}")


def _load_trace(args: argparse.Namespace, model: ModelShape) -> list[Any]:
    """`kvtier bench`'s loader call with bench's flags; its TraceError names a bad value."""
    from kvtier.bench.trace import load_trace  # looked up per call (tests stand in for it)

    trace = load_trace(args.trace, model.vocab_size, getattr(args, "format", "auto"),
                       scale_length=getattr(args, "scale_length", 1.0),
                       time_scale=getattr(args, "time_scale", 1.0),
                       limit=getattr(args, "limit", None))
    return list(getattr(trace, "requests", trace))  # a Trace holds them in .requests


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _console() -> Any:
    from rich.console import Console

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)


def _print_plan(r: PlanResult) -> None:
    from rich.table import Table

    m, hw, c = r.model, r.hardware, r.calibration
    console = _console()
    console.print(f"[bold]kvtier plan[/bold]: {m.name} on {hw.name}, KV {r.kv_dtype}")
    console.print(f"  hardware: {hw.description}")
    console.print(
        f"  model: {m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}, "
        f"{m.num_params / 1e9:.2f}B params ({m.weights_bytes / GIB:.1f} GiB bf16 weights)")
    console.print(f"  layout: tensor parallel {r.tensor_parallel}, {r.replicas} replica(s) per "
                  f"{hw.gpus}-GPU node")
    console.print(f"  KV per token: {r.kv_bytes_per_token:,} B ({_bytes(r.kv_bytes_per_token)})")
    prefill = (f"{hw.prefill_tps:,.0f} tok/s measured" if hw.prefill_tps else
               f"{c.prefill_tokens_per_s:,.0f} tok/s ({r.tensor_parallel} x "
               f"{hw.flops / 1e12:.3g} TFLOPS x MFU {hw.mfu:.2g})")
    console.print(
        f"  restore: link {c.link_gbps:.3g} GB/s ({r.tensor_parallel} x {hw.link_gbps:.3g}) + "
        f"{_seconds(c.transfer_overhead_s)} per wake (incl. the one-token forward)")
    console.print(f"  recompute: {prefill} + causal attention "
                  f"{c.attention_s_per_token2:.3g} s x T^2/2")
    table = Table(title="restore vs recompute, per session")
    for col in ("context", "KV / session", "transfer", "restore", "recompute", "speedup",
                "decision", "sessions/node HBM", "+ host tier"):
        table.add_column(col, justify="left" if col == "decision" else "right")
    for p in r.contexts:
        table.add_row(f"{p.context:,}", _bytes(p.session_bytes), _seconds(p.transfer_s),
                      _seconds(p.restore_s),
                      _seconds(p.recompute_s), f"{p.speedup:.1f}x", p.decision,
                      f"{p.sessions_device:,}", f"{p.sessions_with_tier:,}")
    console.print(table)
    cross = ("restore never wins" if r.crossover_tokens is None
             else f"restore wins above ~{r.crossover_tokens:,.0f} tokens")
    console.print(f"  crossover: {cross}")
    console.print(
        f"  HBM for KV: {max(r.kv_room_bytes, 0) / GIB:.1f} GiB per replica (after weights and "
        f"{ACTIVATION_FRACTION:.0%} for activations)")
    share = r.pinned_bytes / (hw.host_gib * GIB)
    console.print(
        f"  pinned host memory to reserve: {r.pinned_bytes / GIB:.1f} GiB "
        f"({r.host_pool_bytes / GIB:.1f} GiB kv_offloading_size x {r.replicas}), "
        f"{share:.0%} of {hw.host_gib:.1f} GiB RAM")
    for w in r.warnings:
        console.print(f"  [yellow]warning:[/yellow] {w}")


def _print_sim(sim: SimResult, path: str, plan: PlanResult) -> None:
    from rich.table import Table

    table = Table(title=f"simulated TTFT by residency ({Path(path).name})")
    for col in ("class", "requests", "p50", "p99"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for cls, s in sim.ttft.items():
        if s["count"]:
            table.add_row(cls, str(s["count"]), _seconds(s["p50"]), _seconds(s["p99"]))
    console = _console()
    console.print(table)
    console.print(_split_table(sim))
    console.print(
        f"  one replica ({plan.tensor_parallel} GPU(s), 1 of {plan.replicas} per node) serves "
        f"the whole trace; last token at {_seconds(sim.makespan_s)}")
    console.print(f"  compute: busy {_seconds(sim.compute_busy_s)}, "
                  f"{sim.compute_utilisation:.0%} of the makespan")
    console.print(f"  link: {sim.restores} restores, {sim.stores} stores"
                  f" ({sim.idle_demotions} idle demotions), restores busy "
                  f"{_seconds(sim.link_busy_s)}")
    if sim.declined:
        console.print("  restores declined (recomputed): " + ", ".join(
            f"{reason} {n}" for reason, n in sorted(sim.declined.items())))


def _split_table(sim: SimResult) -> Any:
    """Where each class's TTFT goes (queue / tier / compute), as `kvtier bench` splits it."""
    from rich.table import Table

    table = Table(title="simulated TTFT split (p50 / p90)")
    for col in ("class", "requests", "queue", "tier", "compute", "TTFT p50"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for cls, s in sim.ttft.items():
        if not s["count"]:
            continue
        parts = sim.split[cls]
        cells = [f"{_seconds(parts[k]['p50'])} / {_seconds(parts[k]['p90'])}"
                 for k in ("queue", "tier", "compute")]
        table.add_row(cls, str(s["count"]), *cells, _seconds(s["p50"]))
    return table
