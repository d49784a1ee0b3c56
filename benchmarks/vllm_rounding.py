"""What a restored answer under vLLM must be compared with (issue 47): one prompt A of 1,024
tokens, computed whole and over a cached prefix (vLLM's own hit, and kvtier's restore from
host after four prompts pushed A out of vLLM's 24-block pool), with and without kvtier. Prints,
per pair, whether tokens and top-5 logprobs are equal bit for bit, and the largest logprob
difference. On CPUs where vLLM's CPU attention kernel rounds a prefill over cached keys
differently from a whole prompt, "whole vs hit" differs by ~1e-5 nats while every restore
equals the hit exactly: the hit is the reference for a restore.

    python benchmarks/vllm_rounding.py [--out DIR]      (needs bash scripts/vllm_env.sh)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from common import write_result  # noqa: E402
from vllm_run import ONE_PROCESS, VLLM_PYTHON, parse, prompts, run_vllm  # noqa: E402

PAIRS = [("plain whole", "plain hit"), ("plain hit", "kvtier restored"),
         ("plain whole", "kvtier whole"), ("plain whole", "kvtier restored")]


def answers(model: Path) -> dict[str, dict[str, Any]]:
    a, *evictors = prompts(n_evictors=4)[:5]
    plain = parse(run_vllm(VLLM_PYTHON, model, {"connector": None, "blocks": 24,
                                                "prompts": [a, a]}, env=ONE_PROCESS).stdout)
    tier = parse(run_vllm(VLLM_PYTHON, model, {"connector": {"kv_offloading_size": 0.25},
                                               "blocks": 24, "prompts": [a, *evictors, a]},
                          env=ONE_PROCESS).stdout)
    restored = tier["results"][-1]
    assert restored["kv_transfer_params"]["kvtier_restored_tokens"] == 7 * 128, restored
    assert plain["results"][1]["cached"] == 7 * 128
    return {"plain whole": plain["results"][0], "plain hit": plain["results"][1],
            "kvtier whole": tier["results"][0], "kvtier restored": restored}


def compare(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
    """Bit-for-bit equality of tokens and top-5 logprobs, and the largest logprob gap."""
    gap = max((abs(sx[t] - sy[t]) for sx, sy in zip(x["logprobs"], y["logprobs"])
               for t in sx if t in sy), default=0.0)
    return {"tokens_equal": x["tokens"] == y["tokens"],
            "bit_for_bit": (x["tokens"], x["logprobs"]) == (y["tokens"], y["logprobs"]),
            "max_logprob_diff": gap}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    model = export_hf(load_model(None), Path(tempfile.mkdtemp(prefix="kvtier-round-")) / "m")
    got = answers(model)
    rows = [{"pair": f"{x} vs {y}", **compare(got[x], got[y])} for x, y in PAIRS]
    print(f"{'pair':<36} {'tokens':>7} {'bit for bit':>12} {'max |dlogprob|':>15}")
    for r in rows:
        print(f"{r['pair']:<36} {r['tokens_equal']!s:>7} {r['bit_for_bit']!s:>12} "
              f"{r['max_logprob_diff']:>15.3g}")
    path = write_result("vllm-rounding", {"rows": rows, "answers": got}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
