"""kvtier under vLLM on CPU, side by side in one run: plain vLLM against vLLM with kvtier's
host tier, on SmolLM2-135M (float32: bf16 is slow on a CPU without AVX-512 BF16), 2 cores.

  wake     TTFT of a follow-up to a 2048-token session whose KV vLLM's pool has evicted:
           kvtier restores it from host, plain vLLM recomputes it (target: >= 10x faster)
  no hit   decode and prefill of prompts that share nothing: what storing every full block
           costs when nothing is ever hit (target: within 5%)

    python benchmarks/vllm_connector.py [--repeats 3] [--out DIR]
Needs the vLLM environment: bash scripts/vllm_env.sh.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "scripts" / "vllm_driver.py"
KV_BYTES_PER_BLOCK = 30 * 3 * 128 * 2 * 64 * 4  # SmolLM2-135M, float32, 128-token blocks
SESSION, FOLLOW_UP = 2048, 16
HOST = {"kv_offloading_size": 1.0}
MARK = "KVTIER_RESULT "  # the driver's result line (vLLM logs to stdout as well)


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
    for name, connector in (("vllm", None), ("vllm+kvtier host", HOST)):
        wake = drive(model, {"connector": connector, "blocks": 48, "max_model_len": 4096,
                             "prompts": prompts, "max_tokens": 1})
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
            "nohit_request_s": [r["seconds"] for r in gen],
            "nohit_tokens": sum(len(r["tokens"]) for r in gen),
        }
    base, tier = rows["vllm"], rows["vllm+kvtier host"]
    ttft_b, ttft_t = (statistics.median(r["wake_ttft_s"]) for r in (base, tier))
    step_b, step_t = (statistics.median(r["nohit_request_s"]) for r in (base, tier))
    summary = {"wake_speedup": ttft_b / ttft_t, "nohit_cost": step_t / step_b - 1}
    print(f"{'config':<18} {'start s':>8} {'wake TTFT ms (p50)':>19} {'cached':>7} "
          f"{'restored':>9} {'no-hit request s (p50)':>23}")
    for name, r in rows.items():
        print(f"{name:<18} {r['start_s']:8.1f} {statistics.median(r['wake_ttft_s']) * 1e3:19.0f} "
              f"{statistics.median(r['wake_cached_tokens']):7.0f} "
              f"{statistics.median(r['wake_restored_tokens']):9.0f} "
              f"{statistics.median(r['nohit_request_s']):23.3f}")
    print(f"woken {SESSION}-token session: kvtier {summary['wake_speedup']:.1f}x faster than "
          f"vLLM's recompute (target >= 10x: "
          f"{'PASS' if summary['wake_speedup'] >= 10 else 'MISS'})")
    print(f"no hits, storing every block: {summary['nohit_cost']:+.1%} per request (target "
          f"within 5%: {'PASS' if summary['nohit_cost'] <= 0.05 else 'MISS'})")
    path = write_result("vllm_connector", {"rows": rows, "summary": summary,
                                           "session_tokens": SESSION}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
