"""`kvtier bench --url` against `vllm serve`, without and with kvtier's connector: the same
multi-turn trace with idle gaps, TTFT split by residency, and what the server's /metrics says
of kvtier. vLLM's server tells no residency, only cached prompt tokens (its own prefix cache
plus what a connector loaded, `--enable-prompt-tokens-details`): a later turn is "cached"
when at least half of its session's earlier context was reused, else "recomputed".

The pool is small (10 blocks of 128 tokens, SmolLM2-135M float32, 2 cores) so that the
sessions' idle gaps let other sessions evict them from vLLM's own cache.

    python benchmarks/vllm_serve.py [--sessions 8] [--blocks 10] [--out DIR]
Needs the vLLM environment: bash scripts/vllm_env.sh.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from common import write_result  # noqa: E402
from vllm_run import VLLM_PYTHON, VllmServer  # noqa: E402

KVTIER = ROOT / ".venv" / "bin" / "kvtier"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "vllm+kvtier": {"kv_offloading_size": 1.0},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", default="3,4")
    ap.add_argument("--think-s", default="4,8")
    ap.add_argument("--arrival-rate", type=float, default=0.5)
    ap.add_argument("--blocks", type=int, default=10, help="vLLM's pool, 128-token blocks")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-serve-"))
    model = export_hf(load_model(None), tmp / "smollm2-135m")
    rows: dict[str, Any] = {}
    for name, connector in CONFIGS.items():
        server = VllmServer(model, connector, args.blocks, tmp / f"{name}.log",
                            max_model_len=args.max_model_len).start()
        try:
            out = tmp / name
            cmd = [str(KVTIER), "bench", "--url", server.url, "--served-model", "default",
                   "--name", name, "--sessions", str(args.sessions), "--turns", args.turns,
                   "--think-s", args.think_s, "--arrival-rate", str(args.arrival_rate),
                   "--out", str(out)]
            subprocess.run(cmd, check=True, timeout=3600)
            results = json.loads((out / "results.json").read_text())
            rows[name] = {"summary": results["summaries"][name], "metrics": server.metrics(),
                          "command": " ".join(cmd[1:])}
        finally:
            server.close()
    summary = report(rows)
    path = write_result("vllm_serve", {"rows": rows, "summary": summary,
                                       "blocks": args.blocks}, args.out)
    print(f"wrote {path}")
    return 0


def report(rows: dict[str, Any]) -> dict[str, Any]:
    classes = sorted({c for r in rows.values() for c, n in r["summary"]["residency_counts"].items()
                      if n})
    print(f"{'config':<12} {'requests':>8} {'TTFT p50 ms':>12} "
          + " ".join(f"{c + ' p50 ms (n)':>22}" for c in classes))
    out: dict[str, Any] = {}
    for name, r in rows.items():
        s = r["summary"]
        cells = []
        for c in classes:
            t = s["ttft_s"].get(c) or {}
            cells.append(f"{_ms(t.get('p50')):>14} ({t.get('count', 0):>3})")
        print(f"{name:<12} {s['requests']:>8} {_ms(s['ttft_s']['all']['p50']):>12} "
              + " ".join(f"{cell:>22}" for cell in cells))
        out[name] = {"ttft_p50_s": s["ttft_s"]["all"]["p50"],
                     "residency_counts": s["residency_counts"],
                     "cached_tokens": s["cached_tokens"]}
    kv = rows.get("vllm+kvtier", {}).get("metrics", {})
    if kv:
        print("vllm serve /metrics: " + ", ".join(
            f"{k.split('{')[0].removeprefix('vllm:kvtier_')}={v:g}" for k, v in sorted(kv.items())
            if k.endswith("_total") or "_total{" in k))
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    sys.exit(main())
