"""Does a wake stall the streams decoding beside it? `vllm serve` with kvtier's connector: a
few streams decode (TPOT measured token by token) while several sessions whose prefixes were
pushed out of vLLM's pool are sent again, at once, and woken: from host, from host + disk,
or recomputed (load_policy never). The same streams alone, and beside the same sessions
served from vLLM's own cache (a pool that kept them: no wake at all), are the baselines.

    python benchmarks/wake_tpot.py [--streams 2] [--sessions 4] [--repeats 3]
                                   [--regime MODEL@HARDWARE[:TOKENS]] [--out DIR]
`--regime` caps kvtier's restores (`max_load_gbps`, `regime.py`) so that a session restores as
many times faster than it recomputes as on that GPU, and compares its wakes run inside the
step that admits them (`async_loading=never`) with `auto` (beside the streams' steps).
Needs bash scripts/vllm_env.sh. Prints TPOT p50/p99 of the streams per case, and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
from regime import Regime, on_plain_vllm  # noqa: E402
from vllm_run import VLLM_PYTHON, VllmServer  # noqa: E402

SESSION_TOKENS = 1024  # 8 blocks of 128
STREAM_PROMPT, STREAM_OUTPUT = 64, 96
# the pool holds the woken sessions and the streams at once (so none waits for room), but
# not the fillers that push the sessions out; the limit's pool keeps every session
POOL, LIMIT_POOL, FILLERS = 40, 96, 6


def cases(tmp: Path, capped: Regime | None = None
          ) -> dict[str, tuple[int, dict[str, Any] | None]]:
    """name -> (vLLM's pool in blocks, kvtier's connector config or None)."""
    if capped is not None:  # the link is the bottleneck: where the wake runs is what counts
        host = {"kv_offloading_size": 1.0, "max_load_gbps": capped.cap_gbps}
        return {"device (no wake)": (LIMIT_POOL, None),
                "host, in the step": (POOL, {**host, "async_loading": "never"}),
                "host, auto": (POOL, host),
                "recomputed": (POOL, {**host, "load_policy": "never"})}
    return {"device (no wake)": (LIMIT_POOL, None),
            "host": (POOL, {"kv_offloading_size": 1.0}),
            "host+disk": (POOL, {"kv_offloading_size": 0.17, "disk_kv_path": str(tmp / "kv"),
                                 "disk_kv_size": 2}),
            "recomputed": (POOL, {"kv_offloading_size": 1.0, "load_policy": "never"})}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else 0.0


async def stream(client: Any, prompt: list[int]) -> list[float]:
    """One streamed completion: the gaps between its output tokens after the first (s)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": STREAM_OUTPUT,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    if len(stamps) < STREAM_OUTPUT // 2:
        raise RuntimeError(f"a stream answered {len(stamps)} chunks of {STREAM_OUTPUT}")
    return [b - a for a, b in itertools.pairwise(stamps)]


async def complete(client: Any, prompt: list[int], tokens: int = 1) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


async def one_case(url: str, sessions: list[list[int]], fillers: list[list[int]],
                   streams: list[list[int]], wake: bool) -> dict[str, Any]:
    """Sessions computed, pushed out by fillers, then the streams decode; with `wake`, the
    sessions are sent again once the streams are past their first tokens."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for s in sessions:
            await complete(client, s)
        for f in fillers:
            await complete(client, f)
        tasks = [asyncio.create_task(stream(client, p)) for p in streams]
        woken: list[str] = []
        if wake:
            await asyncio.sleep(0.5)  # the streams are decoding
            woken = await asyncio.gather(*(complete(client, s, 4) for s in sessions))
        gaps = [g for t in await asyncio.gather(*tasks) for g in t]
    return {"gaps_s": gaps, "woken_answers": woken}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--regime", default=None,
                    help="MODEL@HARDWARE[:TOKENS]: restores as that GPU's ratio (regime.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-wake-tpot-"))
    loaded = load_model(None)
    model = export_hf(loaded, tmp / "smollm2-135m")
    capped = None
    if args.regime:
        capped = on_plain_vllm(args.regime, SESSION_TOKENS, model,
                               loaded.spec.kv_bytes_per_token(4),  # the server runs float32
                               tmp / "regime.log", blocks=POOL, max_model_len=2048,
                               max_num_seqs=8)
    rows: dict[str, Any] = {}
    for name, (blocks, connector) in cases(tmp, capped).items():
        server = VllmServer(model, connector, blocks, tmp / f"{name}.log",
                            max_model_len=2048, max_num_seqs=8).start()
        try:
            alone, beside, answers = [], [], []
            for rep in range(args.repeats):
                rng = random.Random(rep)
                sessions = [tokens(rng, SESSION_TOKENS) for _ in range(args.sessions)]
                fillers = [tokens(rng, SESSION_TOKENS) for _ in range(FILLERS)]
                streams = [tokens(rng, STREAM_PROMPT) for _ in range(args.streams)]
                alone += asyncio.run(one_case(server.url, [], [], streams, False))["gaps_s"]
                got = asyncio.run(one_case(server.url, sessions, fillers, streams, True))
                beside += got["gaps_s"]
                answers.append(got["woken_answers"])
            metrics = server.metrics()
        finally:
            server.close()
        rows[name] = {"alone_ms": _stats(alone), "beside_wakes_ms": _stats(beside),
                      "answers": answers,
                      "restored_tokens": metrics.get(
                          'vllm:kvtier_restored_tokens_total{engine="0",model_name="default"}')}
    base = rows["device (no wake)"]["beside_wakes_ms"]["p99"]
    top = rows["device (no wake)"]["beside_wakes_ms"]["max"]
    print(f"{'case':>18} {'alone p50':>9} {'p99':>6} {'beside p50':>10} {'p99':>6} {'max':>6} "
          f"{'vs device p99':>13} {'max':>6} {'vs alone p99':>12}")
    for name, r in rows.items():
        a, b = r["alone_ms"], r["beside_wakes_ms"]
        r["p99_vs_device"], r["p99_vs_alone"] = b["p99"] / base, b["p99"] / a["p99"]
        r["max_vs_device"] = b["max"] / top
        print(f"{name:>18} {a['p50']:>9.1f} {a['p99']:>6.1f} {b['p50']:>10.1f} {b['p99']:>6.1f} "
              f"{b['max']:>6.0f} {r['p99_vs_device']:>12.2f}x {r['max_vs_device']:>5.2f}x "
              f"{r['p99_vs_alone']:>11.2f}x")
    ref = rows["device (no wake)"]["answers"]
    for name, r in rows.items():
        r["answers_equal_device"] = r["answers"] == ref
        if r["answers"] != ref:
            print(f"{name}: the woken sessions' answers differ from vLLM's own cache's")
    if capped is not None:
        print(capped.line())
    path = write_result("wake_tpot", {"rows": rows, "streams": args.streams,
                                      "sessions": args.sessions, "repeats": args.repeats,
                                      "regime": capped.to_json() if capped else None},
                        args.out)
    print(f"wrote {path}")
    return 0


def _stats(gaps: list[float]) -> dict[str, float]:
    ms = [g * 1000 for g in gaps]
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms, default=0.0),
            "mean": statistics.fmean(ms) if ms else 0.0, "n": len(ms)}


if __name__ == "__main__":
    sys.exit(main())
