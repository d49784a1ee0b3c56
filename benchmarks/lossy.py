"""Lossy demotion: what `kv_offload_dtype=int8|fp8` saves in bytes below host, and what it
costs in logits, against exact blocks.

A session of natural text (this repository's own docs, tokenized) is served by engine A
with a disk tier and closed (its KV goes down in the given encoding); engine B on the same
directory wakes it from disk for a follow-up. The follow-up's answer is compared with a
run that never left the device: the first token's top-20 logprobs (max and mean absolute
deviation over the tokens both runs rank), whether the top token agrees, and how many of
the greedy tokens agree before the first divergence. Bytes per block as stored below host
are printed beside the exact block size, and a host-tier wake of the same session (demoted
to host, then the follow-up) is timed per encoding: 8-bit slots hold 4x the blocks but cost
an encode on the way down and a decode on the way up.

    python benchmarks/lossy.py [--contexts 512,2048] [--new-tokens 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel, load_model
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams

ENCODINGS = ("exact", "int8", "fp8")
TOP = 20
FOLLOW_UP = "\nSummarise the section above in one sentence."


def corpus(loaded: LoadedModel, n: int) -> list[int]:
    """`n` tokens of natural text: the project's docs, repeated as needed."""
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text() for p in (root / "docs/architecture.md",
                                                root / "README.md"))
    ids = loaded.tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def serve(loaded: LoadedModel, prompt: list[int], params: SamplingParams, **knobs: Any
          ) -> tuple[RequestOutput, dict[str, Any]]:
    engine = LLMEngine(EngineConfig.from_knobs(model=loaded.source, **knobs), loaded=loaded)
    try:
        rid = engine.add_request(prompt, params)
        out = engine.run_to_completion([rid])[rid]
        engine.drain()
        return out, engine_stats(engine, RequestLog())["tiers_below_host"] or {}
    finally:
        engine.close()


def host_wake(loaded: LoadedModel, session: list[int], follow: list[int],
              **knobs: Any) -> tuple[float, int]:
    """TTFT (s) of `follow` after `session` was demoted to the host tier; host slots per GiB."""
    engine = LLMEngine(EngineConfig.from_knobs(model=loaded.source, kv_offloading_size=0.5,
                                               batch_invariant=True, **knobs), loaded=loaded)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.run_to_completion([engine.add_request(session, params)])
        assert engine.tier.enabled
        engine.drain()
        engine.demote_cached()
        rid = engine.add_request(follow, params)
        out = engine.run_to_completion([rid])[rid]
        assert out.residency == "host", out.residency
        return out.metrics.ttft_s or 0.0, int(engine.tier.report().host.capacity / 0.5)
    finally:
        engine.close()


def deviation(got: RequestOutput, want: RequestOutput) -> dict[str, Any]:
    """First-token logprob deviation and greedy agreement of `got` against `want`."""
    assert got.logprobs and want.logprobs
    first_got, first_want = got.logprobs[0], want.logprobs[0]
    shared = first_got.keys() & first_want.keys()
    diffs = [abs(first_got[t] - first_want[t]) for t in shared]
    agree = 0
    for a, b in zip(got.token_ids, want.token_ids):
        if a != b:
            break
        agree += 1
    return {"first_token_max_abs_logprob_diff": max(diffs) if diffs else None,
            "first_token_mean_abs_logprob_diff": statistics.fmean(diffs) if diffs else None,
            "first_token_ranked_in_both": len(shared),
            "top1_agrees": got.token_ids[:1] == want.token_ids[:1],
            "greedy_tokens_agreeing": agree, "greedy_tokens": len(want.token_ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where the disk tiers live (default: ./)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    loaded = load_model(None)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    print(f"{'context':>7} {'encoding':>8} {'bytes/block':>11} {'saved':>6} {'residency':>9} "
          f"{'max|dlogp|':>10} {'mean|dlogp|':>11} {'top1':>5} {'greedy agree':>12} "
          f"{'host wake ms':>12} {'slots/GiB':>9}")
    for n in contexts:
        session = corpus(loaded, n)
        follow = session + loaded.tokenizer.encode(FOLLOW_UP)
        reference, _ = serve(loaded, follow, params, batch_invariant=True)
        for encoding in ENCODINGS:
            with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
                knobs: dict[str, Any] = {"kv_offloading_size": 0.5, "disk_kv_path": tmp,
                                         "disk_kv_size": 0.5, "batch_invariant": True}
                if encoding != "exact":
                    knobs["kv_offload_dtype"] = encoding
                _, written = serve(loaded, session, first_params, **knobs)
                out, fetched = serve(loaded, follow, params, **knobs)
            blocks = written["written_blocks"]["disk"]
            per_block = written["written_bytes"]["disk"] / blocks
            exact = out.restore_bytes / max(1, out.num_restored_tokens // 16)
            row = {"context": n, "encoding": encoding, "residency": out.residency,
                   "lossy": out.lossy, "restored_tokens": out.num_restored_tokens,
                   "stored_bytes_per_block": per_block, "exact_bytes_per_block": exact,
                   "bytes_saved_fraction": 1 - per_block / exact,
                   "fetched_bytes": fetched["fetched_bytes"].get("disk", 0),
                   **deviation(out, reference)}
            extra = {"kv_offload_dtype": encoding} if encoding != "exact" else {}
            ttft, per_gib = host_wake(loaded, session, follow, **extra)
            row.update(host_wake_ttft_s=ttft, host_slots_per_gib=per_gib)
            rows.append(row)
            top1 = "yes" if row["top1_agrees"] else "no"
            print(f"{n:>7} {encoding:>8} {per_block:>11,.0f} {row['bytes_saved_fraction']:>6.0%} "
                  f"{out.residency:>9} {row['first_token_max_abs_logprob_diff']:>10.4f} "
                  f"{row['first_token_mean_abs_logprob_diff']:>11.4f} {top1:>5} "
                  f"{row['greedy_tokens_agreeing']:>5}/{row['greedy_tokens']:<6} "
                  f"{ttft * 1e3:>12.1f} {per_gib:>9,}")
    path = write_result("lossy", {"rows": rows, "top_logprobs": TOP,
                                  "model": loaded.source}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
