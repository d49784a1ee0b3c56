"""Where `always` collapses, what the fixed rule gains and where `auto` lands, on GPUs this
machine does not have: `kvtier plan`'s simulator (the engine's own `LoadPolicy.decide`
over the queues) with hardware presets. Every number printed here is SIMULATED.

The load: a population of sessions twice what the device pool holds (so half of them live
on host at any time), each a prompt of CONTEXT tokens then follow-ups of --turn-tokens, each
answer --output tokens, sent by a closed loop of CLIENTS (a benchmark's max concurrency, no
think time: a session comes back once the clients went round the others). Per model, GPU,
context, restore rate and client count, every `load_policy` and the limit (a device that
holds every session) are simulated; TTFT mean and p99 of all turns and of the wakes (the
follow-ups), output tokens/s and the declines by reason are written to JSON; the table
prints the wakes' mean and p99 (the first turns are the same prefill under every policy).

Restore rate `link` is the preset's host link; a number is `max_load_gbps` in GB/s, the
restore path capped (a deployment's QoS, or a store behind a NIC of that rate: 1.25 = 10
Gbit/s; the simulator has no tier below host, so that is how a slower path is put in).

    python benchmarks/simulated_regimes.py [--models llama-3.1-8b,llama-3.1-70b]
        [--hardware h100-sxm,h200] [--contexts 8192,32768] [--clients 8,16,32,64]
        [--rates link,12.5,1.25] [--policies never,always,threshold:1024:8,auto]
        [--turns 4] [--turn-tokens 256] [--output 256] [--seed 0] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.engine.stats import percentile
from kvtier.errors import ConfigError
from kvtier.plan.analysis import analyze
from kvtier.plan.hardware import resolve_hardware
from kvtier.plan.models import resolve_model
from kvtier.plan.simulate import SimConfig, SimResult, SimTurn, simulate
from kvtier.tier import LoadPolicy

LIMIT = "limit"



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b")
    ap.add_argument("--hardware", default="h100-sxm,h200")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--clients", default="8,16,32,64")
    ap.add_argument("--rates", default="link,12.5,1.25",
                    help="restore path: link (the preset's) or max_load_gbps in GB/s")
    ap.add_argument("--policies", default="never,always,threshold:1024:8,auto")
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--turn-tokens", type=int, default=256, help="new tokens per follow-up")
    ap.add_argument("--output", type=int, default=256, help="output tokens per turn")
    ap.add_argument("--seed", type=int, default=0, help="draws the lengths")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's default on a GPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prefill tokens per step (chunked prefill), vLLM's default on an H100")
    ap.add_argument("--out", default=None, help="directory for the JSON (benchmarks/results)")
    return ap.parse_args(argv)


def population(sessions: int, context: int, turns: int, turn_tokens: int, output: int,
               seed: int = 0) -> list[SimTurn]:
    """`sessions` sessions all due at t=0 (a closed loop of clients sends them in order).
    Follow-up and answer lengths are uniform in [0.5, 1.5] x the given ones, drawn from
    `seed`: equal lengths would keep the clients in lockstep, waking in bursts."""
    rng = random.Random(seed)

    def about(n: int) -> int:
        return max(1, round(n * rng.uniform(0.5, 1.5)))

    return [SimTurn(s, k, 0.0, (1,) * (context if k == 0 else about(turn_tokens)), about(output))
            for s in range(sessions) for k in range(turns)]


def summary(sim: SimResult) -> dict[str, Any]:
    """Mean and p99 TTFT of all turns and of the follow-ups, tokens/s, where wakes came from."""
    every = [r.ttft_s for r in sim.records]
    wakes = [r.ttft_s for r in sim.records if r.turn > 0]
    return {"ttft_mean_s": sum(every) / len(every), "ttft_p99_s": percentile(every, 99),
            "wake_mean_s": sum(wakes) / len(wakes) if wakes else None,
            "wake_p99_s": percentile(wakes, 99),
            "restores": sim.restores, "declined": sim.declined,
            "classes": {c: v["count"] for c, v in sim.ttft.items() if c != "all"},
            "makespan_s": sim.makespan_s}


def run_cell(model_name: str, hw_name: str, context: int, rate: str, clients: int,
             args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    model, hardware = resolve_model(model_name), resolve_hardware(hw_name)
    plan = analyze(model, hardware, "fp16", [context])
    (ctx,) = plan.contexts
    device = max(1, ctx.sessions_device // plan.replicas)  # per replica: what one simulates
    host = int(plan.host_pool_bytes // ctx.session_bytes)
    sessions = max(2 * device, 2 * clients)
    turns = population(sessions, context, args.turns, args.turn_tokens, args.output, args.seed)
    cap = None if rate == "link" else float(rate)
    out_tokens = sum(t.output_tokens for t in turns)
    row: dict[str, Any] = {"model": model_name, "hardware": hw_name, "context": context,
                           "rate": rate, "clients": clients, "sessions": sessions,
                           "device_sessions": device, "host_sessions": host,
                           "tensor_parallel": plan.tensor_parallel,
                           "link_gbps": plan.calibration.link_gbps,
                           "restore_gbps": cap or plan.calibration.link_gbps,
                           "prefill_tps": plan.calibration.prefill_tokens_per_s,
                           "transfer_overhead_s": plan.calibration.transfer_overhead_s,
                           "alone_restore_s": ctx.restore_s if cap is None
                           else ctx.session_bytes / (cap * 1e9)
                           + plan.calibration.transfer_overhead_s,
                           "alone_recompute_s": ctx.recompute_s, "results": {}}
    for name in [*policies, LIMIT]:
        knobs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "clients": clients,
                                 "max_load_gbps": cap,
                                 "max_num_batched_tokens": args.max_num_batched_tokens}
        if name == LIMIT:
            knobs["device_sessions"] = sessions
        else:
            knobs["load_policy"] = LoadPolicy.parse(name)
        sim = simulate(turns, model, hardware, "fp16", SimConfig(**knobs))
        result = summary(sim)
        result["tok_per_s"] = out_tokens / sim.makespan_s if sim.makespan_s else 0.0
        row["results"][name] = result
    return row


def verdicts(row: dict[str, Any], policies: list[str]) -> dict[str, Any]:
    """One cell, judged on the wakes (the follow-ups: the first turns are the same prefill
    under every policy) and on tokens/s: auto against the best fixed policy on each, and
    `always` against `never` (above 1: restoring everything is worse than no tier)."""
    res = row["results"]
    fixed = [p for p in policies if p != "auto"]
    out: dict[str, Any] = {}
    if "auto" in res and fixed:
        for key, label in (("wake_mean_s", "auto_mean_vs_best"),
                           ("wake_p99_s", "auto_p99_vs_best")):
            best = min(res[p][key] or 0.0 for p in fixed)
            out[label] = (res["auto"][key] or 0.0) / best if best > 0 else None
        out["auto_tps_vs_best"] = res["auto"]["tok_per_s"] / max(res[p]["tok_per_s"] for p in fixed)
    if "always" in res and "never" in res and res["never"]["wake_p99_s"]:
        out["always_p99_vs_never"] = res["always"]["wake_p99_s"] / res["never"]["wake_p99_s"]
    return out


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def print_block(rows: list[dict[str, Any]], policies: list[str]) -> None:
    first = rows[0]
    print(f"\nSIMULATED {first['model']} on {first['hardware']} (TP {first['tensor_parallel']}), "
          f"{first['context']:,}-token sessions, restore path {first['restore_gbps']:.2f} GB/s "
          f"({'the preset link' if first['rate'] == 'link' else 'max_load_gbps'}); prefill "
          f"{first['prefill_tps']:,.0f} tok/s + attention; one session alone: restore "
          f"{fmt(first['alone_restore_s'])}, recompute {fmt(first['alone_recompute_s'])}; "
          f"device holds {first['device_sessions']} sessions, host {first['host_sessions']}")
    names = [*policies, LIMIT]
    print(f"{'clients':>7} {'sessions':>8} | " + " | ".join(f"{n:>24}" for n in names))
    print(f"{'':>7} {'':>8} | " + " | ".join(f"{'wake mean / p99 / tok/s':>24}" for _ in names))
    for row in rows:
        cells = []
        for n in names:
            r = row["results"][n]
            cells.append(f"{fmt(r['wake_mean_s']):>7} /{fmt(r['wake_p99_s']):>7} /"
                         f"{r['tok_per_s']:>6.0f}")
        print(f"{row['clients']:>7} {row['sessions']:>8} | " + " | ".join(
            f"{c:>24}" for c in cells))
        if row["sessions"] > row["device_sessions"] + row["host_sessions"]:
            print(f"{'':>18}^ {row['sessions']} sessions outgrow device + host "
                  f"({row['device_sessions']} + {row['host_sessions']}): wakes recompute")
    for row in rows:
        auto = row["results"].get("auto", {})
        print(f"  {row['clients']} clients: auto restored {auto.get('restores', '-')}, "
              f"declined {auto.get('declined', {})}; " + ", ".join(
                  f"{k} {v:.2f}x" for k, v in row["verdicts"].items() if v is not None))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        for p in policies:
            LoadPolicy.parse(p)
        contexts = [int(c) for c in args.contexts.split(",")]
        clients = [int(c) for c in args.clients.split(",")]
        rates = [r.strip() for r in args.rates.split(",")]
        for r in rates:
            if r != "link" and not float(r) > 0:
                raise ConfigError(f"--rates {r!r}: give link or GB/s > 0")
    except (ConfigError, ValueError) as exc:
        print(f"simulated_regimes: error: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for hw in args.hardware.split(","):
            for context in contexts:
                for rate in rates:
                    block = []
                    for c in clients:
                        row = run_cell(model, hw, context, rate, c, args, policies)
                        row["verdicts"] = verdicts(row, policies)
                        block.append(row)
                    print_block(block, policies)
                    rows.extend(block)
    path = write_result("simulated_regimes", {"simulated": True, "args": vars(args),
                                              "rows": rows}, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
