"""The vLLM deployments beyond one worker and full attention, each in one run of its own
model: tensor parallel 2 (a tiny random Llama, 2 KV heads: one per rank) and a Gemma-3-style
hybrid model (five sliding-window layers to one global, vLLM's hybrid allocator on: six KV
cache groups), and 8-bit demotion (int8) on the Llama. Tiny random models because SmolLM2's
3 KV heads do not split over 2 ranks and it has no windows; their TTFTs are small, so read
the ratios.

Per deployment, TTFT of a follow-up to a session:
  vLLM hit      vLLM's own prefix hit (its pool still holds the session): the limit
  kvtier host   vLLM's pool evicted the session; kvtier restores it from host
  recompute     plain vLLM with the same pool: the session evicted and recomputed
and for 8-bit the first-token logprob deviation and greedy agreement against the exact hit.

    python benchmarks/vllm_deployments.py [--repeats 3] [--out DIR]
(`benchmarks/vllm_connector.py` runs it too, after its own rows.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
# the tiny models' recipe and the vLLM driver's runner, shared with the connector's tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from common import write_result
from tiny_models import BLOCK_SIZE, VOCAB, kv_bytes_per_block
from vllm_run import ROOT, VLLM_PYTHON, parse, run_vllm

SESSION, FOLLOW_UP, EVICTORS = 1024, 16, 3
HOST = {"kv_offloading_size": 0.25, "enable_residency_details": True}
# (name, model kind, driver spec, extra connector knobs); pools of ~1.5 sessions
DEPLOYMENTS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("tp2", "llama", {"tensor_parallel_size": 2, "blocks": 48,
                      "kv_bytes_per_block": kv_bytes_per_block("llama", 2)}, {}),
    # under the hybrid allocator a pool block is one group's page (one layer, one head),
    # shared by six groups: 288 pages hold a session (34 global + 3 per window group) and
    # its follow-up, not the three sessions after it
    ("gemma3 hybrid", "gemma3", {"hybrid": True, "blocks": 288,
                                 "kv_bytes_per_block": kv_bytes_per_block("gemma3") // 6}, {}),
    ("int8", "llama", {"blocks": 48, "kv_bytes_per_block": kv_bytes_per_block("llama")},
     {"kv_offload_dtype": "int8"}),
]
ENV = {"tp2": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}


def prompts(repeats: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Per repeat: a session, its follow-up at once (vLLM's own hit), sessions that evict it,
    the same follow-up again (kvtier's restore, or a recompute): one prompt, three paths."""
    rng = random.Random(0)
    out, hits, wakes = [], [], []
    for _ in range(repeats):
        session = [rng.randrange(10, VOCAB) for _ in range(SESSION)]
        follow = session + [rng.randrange(10, VOCAB) for _ in range(FOLLOW_UP)]
        out += [session, follow]
        hits.append(len(out) - 1)
        out += [[rng.randrange(10, VOCAB) for _ in range(SESSION)] for _ in range(EVICTORS)]
        out.append(follow)
        wakes.append(len(out) - 1)
    return out, hits, wakes


def tiny(kind: str, directory: Path) -> Path:
    path = directory / kind
    if not path.exists():
        subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "integrations" / "tiny_models.py"),
                        kind, str(path)], check=True, capture_output=True)
    return path


def measure(repeats: int, directory: Path) -> dict[str, Any]:
    batch, hits, wakes = prompts(repeats)
    rows: dict[str, Any] = {}
    for name, kind, spec, knobs in DEPLOYMENTS:
        model = tiny(kind, directory)
        common = {**spec, "prompts": batch, "max_tokens": 1, "block_size": BLOCK_SIZE,
                  "max_model_len": SESSION + 2 * FOLLOW_UP + BLOCK_SIZE}
        env = ENV.get(name, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        ours = parse(run_vllm(VLLM_PYTHON, model, {**common, "connector": {**HOST, **knobs}},
                              env=env).stdout)["results"]
        plain = parse(run_vllm(VLLM_PYTHON, model, {**common, "connector": None},
                               env=env).stdout)["results"]
        woken = [ours[i] for i in wakes]
        row = {"vllm_hit_s": [ours[i]["seconds"] for i in hits],
               "kvtier_s": [r["seconds"] for r in woken],
               "recompute_s": [plain[i]["seconds"] for i in wakes],
               "kvtier_cached": [r["cached"] for r in woken],
               "kvtier_residency": [(r["kv_transfer_params"] or {}).get("kvtier_residency")
                                    for r in woken]}
        exact = [ours[i] for i in hits]  # the same prompt through vLLM's own (exact) hit
        row["greedy_agree"] = [w["tokens"][0] == e["tokens"][0] for w, e in zip(woken, exact)]
        row["first_logprob_dev"] = [_deviation(w, e) for w, e in zip(woken, exact)]
        if knobs.get("kv_offload_dtype"):
            row["lossy"] = [(r["kv_transfer_params"] or {}).get("kvtier_lossy") for r in woken]
        rows[name] = row
    return rows


def _deviation(woken: dict[str, Any], exact: dict[str, Any]) -> float | None:
    """|logprob(woken's greedy token) in woken - the same token's in exact|, where exact's
    top 5 hold it; None where they do not."""
    token = str(woken["tokens"][0])
    a, b = woken["logprobs"][0].get(token), exact["logprobs"][0].get(token)
    return None if a is None or b is None else abs(a - b)


def report(rows: dict[str, Any]) -> dict[str, Any]:
    print(f"\n{'deployment':<14} {'vLLM hit ms':>11} {'kvtier ms':>10} {'recompute ms':>13} "
          f"{'kvtier/hit':>11} {'recompute/kvtier':>17} {'cached':>7} {'from':>6}")
    summary: dict[str, Any] = {}
    for name, r in rows.items():
        hit, ours = statistics.median(r["vllm_hit_s"]), statistics.median(r["kvtier_s"])
        recompute = statistics.median(r["recompute_s"])
        where = "/".join(sorted({str(x) for x in r["kvtier_residency"]}))
        print(f"{name:<14} {hit * 1e3:11.1f} {ours * 1e3:10.1f} {recompute * 1e3:13.1f} "
              f"{ours / hit:10.2f}x {recompute / ours:16.1f}x "
              f"{statistics.median(r['kvtier_cached']):7.0f} {where:>6}")
        summary[name] = {"kvtier_over_hit": ours / hit, "recompute_over_kvtier": recompute / ours}
    for name, r in rows.items():  # against vLLM's own hit of the same prompt
        devs = [d for d in r["first_logprob_dev"] if d is not None]
        agree = sum(r["greedy_agree"]) / len(r["greedy_agree"])
        lossy = (f"tagged lossy {sum(map(bool, r['lossy']))}/{len(r['lossy'])}; "
                 if "lossy" in r else "")
        print(f"{name}: {lossy}first token as vLLM's own hit: {agree:.0%}; |first-token "
              f"logprob deviation| max {max(devs, default=float('nan')):.2e}")
        summary[name].update(greedy_agreement=agree, max_logprob_dev=max(devs, default=None))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    rows = measure(args.repeats, Path(tempfile.mkdtemp(prefix="kvtier-deploy-bench-")))
    summary = report(rows)
    path = write_result("vllm_deployments", {"rows": rows, "summary": summary,
                                             "session_tokens": SESSION}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
