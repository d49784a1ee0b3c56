"""`kvtier bench`: one trace, several configurations side by side, split by residency."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench.provenance import git_sha, hardware
from kvtier.engine.flags import add_engine_args, engine_knobs
from kvtier.errors import ConfigError

# The default run: a device pool that holds a few sessions, a host pool ~10x larger, and
# sessions that think between turns long enough for idle demotion to matter.
DEFAULT_BASE = {"num_device_blocks": 128, "max_num_batched_tokens": 1024}
DEFAULT_CONFIGS = {
    "tier-off": {"kv_offloading_size": 0.0},
    "tier-auto": {"kv_offloading_size": 1.0, "preemption_mode": "auto", "idle_offload_s": 2.0},
}


def add_bench_args(sub: Any) -> None:
    p = sub.add_parser("bench", help="multi-turn trace with idle gaps, TTFT by residency")
    p.add_argument("--trace", default=None, help="JSONL (kvtier schema) or Mooncake trace")
    p.add_argument("--format", default="auto", choices=("auto", "jsonl", "mooncake"))
    p.add_argument("--scale-length", type=float, default=1.0,
                   help="Mooncake: shrink lengths (and the 512-token hash block) by F")
    p.add_argument("--time-scale", default="1.0", metavar="F|auto",
                   help="stretch (>1) or compress (<1) arrivals and think times; auto: "
                        "measure this machine on a sample of the trace, then stretch it so "
                        "the replay runs at --target-utilisation")
    p.add_argument("--target-utilisation", type=float, default=0.7,
                   help="with --time-scale auto: the engine's busy fraction to aim for")
    p.add_argument("--limit", type=int, default=None, help="first N requests of a trace file")
    p.add_argument("--sessions", type=int, default=16, help="generator: number of sessions")
    p.add_argument("--turns", default="3,5", help="generator: turns per session, LO,HI")
    p.add_argument("--think-s", default="3,8", help="generator: think time median,p90 (s)")
    p.add_argument("--arrival-rate", type=float, default=0.8, help="generator: sessions/s")
    p.add_argument("--trace-seed", type=int, default=0, help="generator seed")
    p.add_argument("--config", action="append", default=[], metavar="NAME:KNOB=V,...",
                   help="an extra configuration (repeatable), e.g. swap:preemption_mode=swap")
    p.add_argument("--only", action="store_true", help="run only the --config ones")
    p.add_argument("--url", default=None,
                   help="drive a running OpenAI-compatible server instead of an in-process "
                        "engine (its own configuration; --config does not apply)")
    p.add_argument("--api-key", default=None, help="with --url: the bearer key")
    p.add_argument("--served-model", default="default", help="with --url: the model name")
    p.add_argument("--name", default="remote", help="with --url: the run's name in the report")
    p.add_argument("--out", default=None, help="output directory (kvtier-bench-<timestamp>)")
    add_engine_args(p)
    p.set_defaults(func=run_bench)


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """'name:knob=value,knob=value' -> (name, knobs) with numbers and booleans parsed."""
    name, _, rest = text.partition(":")
    if not name or not rest:
        raise ConfigError(f"--config {text!r}: expected NAME:KNOB=VALUE[,KNOB=VALUE...]")
    knobs: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--config {text!r}: {item!r} is not KNOB=VALUE")
        knobs[key.strip().replace("-", "_")] = _value(value.strip())
    return name, knobs


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _pair(text: str, kind: type, flag: str) -> tuple[Any, Any]:
    try:
        lo, hi = (kind(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected two numbers, LO,HI") from None
    return lo, hi


def run_bench(args: argparse.Namespace) -> int:
    from kvtier.bench import report
    from kvtier.bench.html_report import write_html
    from kvtier.bench.load import (
        nominal_span_s,
        offered_load,
        probe_time_scale,
        rescale,
        saturation,
    )
    from kvtier.bench.run import run_config
    from kvtier.bench.trace import generate, load_trace
    from kvtier.model.loader import load_model

    time_scale = _time_scale(args.time_scale)
    loaded = load_model(args.model)
    vocab = loaded.spec.vocab_size
    if args.trace:
        trace = load_trace(args.trace, vocab, fmt=args.format, scale_length=args.scale_length,
                           limit=args.limit)
    else:
        trace = generate(num_sessions=args.sessions, turns=_pair(args.turns, int, "--turns"),
                         arrival_rate=args.arrival_rate,
                         think_s=_pair(args.think_s, float, "--think-s"),
                         first_tokens=(150, 300), turn_tokens=(20, 60), output_tokens=(8, 24),
                         vocab_size=vocab, seed=args.trace_seed)
    base = {**DEFAULT_BASE, **engine_knobs(args)}
    configs = {} if args.only else {k: dict(v) for k, v in DEFAULT_CONFIGS.items()}
    for text in args.config:
        name, knobs = parse_config(text)
        configs[name] = knobs
    if not configs:
        raise ConfigError("--only with no --config: nothing to run")
    if args.url and args.config:
        raise ConfigError("--config does not apply with --url: the server has its own")
    out_dir = Path(args.out or f"kvtier-bench-{time.strftime('%Y%m%d-%H%M%S')}")

    def replay(t: Any, name: str, knobs: dict[str, Any]) -> Any:
        if args.url:
            from kvtier.bench.remote import run_remote

            return run_remote(args.url, t, name, args.served_model, args.api_key)
        return run_config(loaded, t, name, knobs)

    auto = None
    if time_scale is None:  # --time-scale auto
        knobs = {**base, **next(iter(configs.values()))}
        auto = probe_time_scale(trace, lambda t: replay(t, "probe", knobs),
                                args.target_utilisation,
                                lambda text: print(f"--time-scale auto: {text}", flush=True))
        time_scale = auto["factor"]
    if time_scale != 1.0:
        trace = rescale(trace, time_scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.url:
        runs = [replay(trace, args.name, {})]
    else:
        runs = _run_all(loaded, trace, base, configs, run_config)
    span = nominal_span_s(trace)
    scale_length = args.scale_length if trace.meta.get("format") == "mooncake" else None
    summaries = {r.name: report.summarize_config(
        r.records, r.engine,
        saturation(r.records, r.engine.get("busy_s"), r.wall_s, span, time_scale),
        r.rejected, scale_length) for r in runs}
    report.print_table(summaries)
    meta = {"command": " ".join(["kvtier", *sys.argv[1:]]), "git_sha": git_sha(),
            "hardware": hardware(),
            "model": loaded.source, "trace": trace.source, "base_knobs": base,
            "configs": {r.name: {**base, **r.knobs} for r in runs},
            "wall_s": {r.name: r.wall_s for r in runs}, "time_scale": time_scale,
            "time_scale_auto": auto, "offered_tokens_per_s": offered_load(trace),
            "nominal_span_s": span,
            "refused": {r.name: r.rejected for r in runs}}
    records = [rec for r in runs for rec in r.records]
    report.write_json(out_dir / "results.json", {
        "meta": meta, "summaries": summaries, "records": records,
        "engine": {r.name: r.engine for r in runs},
        "link_timeline": {r.name: r.link_timeline for r in runs}})
    write_html(out_dir / "report.html", summaries, records,
               {**meta, "link_timeline": {r.name: r.link_timeline for r in runs}})
    print(f"wrote {out_dir / 'results.json'} and {out_dir / 'report.html'}")
    print(json.dumps({"wall_s": meta["wall_s"]}))
    return 0


def _time_scale(text: str) -> float | None:
    """--time-scale: a finite number >= 0, or "auto" (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise ConfigError(f"--time-scale {text!r}: expected a number >= 0 (1 = as recorded) "
                          "or auto")
    return value


def _run_all(loaded: Any, trace: Any, base: dict[str, Any], configs: dict[str, dict[str, Any]],
             run_config: Any) -> list[Any]:
    from rich.progress import Progress

    runs = []
    total = len(trace.requests)
    with Progress(transient=False) as progress:
        for name, knobs in configs.items():
            task = progress.add_task(f"{name}", total=total)
            runs.append(run_config(loaded, trace, name, {**base, **knobs},
                                   on_request=lambda t=task: progress.advance(t)))
    return runs
