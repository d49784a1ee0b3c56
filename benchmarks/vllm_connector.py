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
           host <= 1.15x, disk and Redis <= 1.3x) and to the recompute.
  no hit   decode and prefill of prompts that share nothing: what storing every full block
           (and writing it on to disk or Redis) costs when nothing is ever hit (target: 5%)

  deployments   tensor parallel 2, a Gemma-3-style hybrid model and int8 demotion, each
           against vLLM's own prefix hit and its recompute (benchmarks/vllm_deployments.py)

    python benchmarks/vllm_connector.py [--repeats 3] [--out DIR] [--no-deployments]
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
from tiers import Redis

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
LIMIT_TARGETS = {"host": 1.15, "disk": 1.3, "redis": 1.3}


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
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-deployments", action="store_true",
                    help="skip the tensor-parallel, hybrid and int8 rows")
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-bench-"))
    model = export_hf(load_model(None), tmp / "smollm2-135m")
    rng = random.Random(0)
    prompts, follow_at = wake_prompts(rng, args.repeats)
    nohit = [[rng.randrange(100, 49000) for _ in range(512)] for _ in range(8)]
    rows: dict[str, Any] = {}
    redis = Redis()
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("vllm", None), (OWN_HIT, None), ("vllm+kvtier host", HOST),
        ("vllm+kvtier disk", {**SMALL_HOST, "disk_kv_path": str(tmp / "kv"), "disk_kv_size": 2})]
    if redis.url:
        configs.append(("vllm+kvtier redis", {**SMALL_HOST, "remote_kv_url": redis.url}))
    else:
        print(f"redis row skipped: {redis.reason}")
    for name, connector in configs:
        redis.flush()
        if connector and "disk_kv_path" in connector:
            shutil.rmtree(connector["disk_kv_path"], ignore_errors=True)
        pool = OWN_HIT_BLOCKS if name == OWN_HIT else 48
        wake = drive(model, {"connector": connector, "blocks": pool, "max_model_len": 4096,
                             "prompts": prompts, "max_tokens": 1})
        if name == OWN_HIT:  # the limit: no no-hit run (it is plain vLLM's)
            rows[name] = {"start_s": wake["started_s"],
                          "wake_ttft_s": [wake["results"][i]["seconds"] for i in follow_at],
                          "wake_cached_tokens": [wake["results"][i]["cached"]
                                                 for i in follow_at],
                          "wake_restored_tokens": [0] * len(follow_at),
                          "wake_residency": ["vllm"] * len(follow_at),
                          "nohit_request_s": [], "nohit_tokens": 0}
            continue
        decode = drive(model, {"connector": connector, "blocks": 48, "max_model_len": 4096,
                               "prompts": nohit, "max_tokens": 64})
        woken = [wake["results"][i] for i in follow_at]
        gen = decode["results"]
        rows[name] = {
            "start_s": wake["started_s"],
            "wake_ttft_s": [r["seconds"] for r in woken],
            "wake_cached_tokens": [r["cached"] for r in woken],
            "wake_restored_tokens": [(r["kv_transfer_params"] or {}).get(
                "kvtier_restored_tokens", 0) for r in woken],
            "wake_residency": [(r["kv_transfer_params"] or {}).get("kvtier_residency", "none")
                               for r in woken],
            "nohit_request_s": [r["seconds"] for r in gen],
            "nohit_tokens": sum(len(r["tokens"]) for r in gen),
        }
    redis.close()
    summary = report(rows)
    deployed: dict[str, Any] = {}
    if not args.no_deployments:
        from vllm_deployments import measure
        from vllm_deployments import report as report_deployments

        deployed["rows"] = measure(args.repeats, tmp / "tiny")
        deployed["summary"] = report_deployments(deployed["rows"])
    path = write_result("vllm_connector", {"rows": rows, "summary": summary,
                                           "session_tokens": SESSION,
                                           "deployments": deployed}, args.out)
    print(f"wrote {path}")
    return 0


def report(rows: dict[str, Any]) -> dict[str, Any]:
    """The table, the targets, and the summary for the JSON."""
    ttft_b = statistics.median(rows["vllm"]["wake_ttft_s"])
    step_b = statistics.median(rows["vllm"]["nohit_request_s"])
    limit = statistics.median(rows[OWN_HIT]["wake_ttft_s"])
    print(f"{'config':<18} {'start s':>8} {'wake TTFT ms (p50)':>19} {'x own hit':>10} "
          f"{'cached':>7} {'restored':>9} {'from':>7} {'no-hit request s (p50)':>23}")
    summary: dict[str, Any] = {"own_hit_ttft_s": limit}
    for name, r in rows.items():
        ttft = statistics.median(r["wake_ttft_s"])
        step = statistics.median(r["nohit_request_s"]) if r["nohit_request_s"] else None
        where = "/".join(sorted(set(r["wake_residency"])))
        print(f"{name:<18} {r['start_s']:8.1f} {ttft * 1e3:19.0f} {ttft / limit:10.2f} "
              f"{statistics.median(r['wake_cached_tokens']):7.0f} "
              f"{statistics.median(r['wake_restored_tokens']):9.0f} {where:>7} "
              f"{'-' if step is None else f'{step:.3f}':>23}")
        if name not in ("vllm", OWN_HIT):
            tier = name.split()[-1]
            summary[f"wake_speedup_{tier}"] = ttft_b / ttft
            summary[f"wake_vs_own_hit_{tier}"] = ttft / limit
            summary[f"nohit_cost_{tier}"] = (step or 0) / step_b - 1
    for key, value in summary.items():
        if key.startswith("wake_vs_own_hit"):
            tier = key.split("_")[-1]
            target = LIMIT_TARGETS[tier]
            print(f"woken from {tier}: {value:.2f}x vLLM's own prefix hit (target <= "
                  f"{target}x: {'PASS' if value <= target else 'MISS'})")
        elif key == "own_hit_ttft_s":
            continue
        elif key.startswith("wake"):
            print(f"woken {SESSION}-token session from {key.split('_')[-1]}: {value:.1f}x faster "
                  f"than vLLM's recompute (target >= 10x: {'PASS' if value >= 10 else 'MISS'})")
        else:
            print(f"no hits, storing every block ({key.split('_')[-1]}): {value:+.1%} per "
                  f"request (target within 5%: {'PASS' if value <= 0.05 else 'MISS'})")
    return summary


if __name__ == "__main__":
    sys.exit(main())
