"""A bounded load test of `kvtier serve` on loopback: concurrent streaming sessions with idle
gaps, a fixed number of turns each; it starts its own server and stops by itself.

Checks: no errors, every response complete ([DONE] and a finish reason), device and host
pool accounting back to baseline afterwards; reports TTFT p50/p99 per residency class.
`--abuse 0.1` adds hostile clients beside the honest sessions: one request in ten is then
malformed, oversized, out of range, or a stream its client drops after the first chunk; the
honest sessions must still all complete (compare their TTFT with a run without --abuse).

    python benchmarks/serve_load.py [--model PATH] [--sessions 32] [--turns 3] [--out DIR]
        [--abuse 0.1] [--server-args "--kv-offloading-size 0.05 --disk-kv-path DIR ..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.engine.stats import summarize
from kvtier.server.launch import start_server

TOPICS = ["tides", "volcanoes", "bread", "bridges", "owls", "comets", "glaciers", "chess"]


async def session(client: httpx.AsyncClient, i: int, turns: int, gap: tuple[float, float],
                  max_tokens: int, rng: random.Random, records: list[dict[str, Any]],
                  errors: list[str]) -> None:
    messages = [{"role": "system", "content": f"You are assistant {i}. Be brief. " * 6}]
    await asyncio.sleep(rng.uniform(0, 2))  # staggered arrivals
    for turn in range(turns):
        messages.append({"role": "user",
                         "content": f"Turn {turn}: tell me one fact about {rng.choice(TOPICS)}."})
        body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.7, "seed": i * 100 + turn, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, text, finish, usage, done = None, "", None, None, False
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"session {i} turn {turn}: HTTP {r.status_code}")
                    return
                residency = r.headers.get("x-kvtier-residency", "unknown")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        if piece and ttft is None:
                            ttft = time.perf_counter() - start
                        text += piece
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as e:
            errors.append(f"session {i} turn {turn}: {type(e).__name__}: {e}")
            return
        if not done or finish is None or usage is None:
            errors.append(f"session {i} turn {turn}: incomplete response")
            return
        records.append({"session": i, "turn": turn, "residency": residency,
                        "ttft_s": ttft if ttft is not None else time.perf_counter() - start,
                        "completion_tokens": usage["completion_tokens"],
                        "restored_tokens": usage.get("restored_tokens", 0),
                        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
        messages.append({"role": "assistant", "content": text})
        await asyncio.sleep(rng.uniform(*gap))  # the user thinks: state goes cold


# What a careless or hostile client sends: (name, body or raw text, stream and drop it)
ABUSE: list[tuple[str, Any, bool]] = [
    ("bad json", '{"model": "default", "messages": [', False),
    ("deep nesting", '{"model": "default", "prompt": ' + "[" * 5000 + "]" * 5000 + "}", False),
    ("lone surrogate", '{"model": "default", "prompt": "\\ud800 hi", "max_tokens": 4}', False),
    ("infinite temperature", '{"model": "default", "prompt": "hi", "temperature": Infinity}',
     False),
    ("string max_tokens", {"model": "default", "prompt": "hi", "max_tokens": "9"}, False),
    ("unsupported parameter", {"model": "default", "prompt": "hi", "logit_bias": {"5": 9}},
     False),
    ("oversized body", {"model": "default", "prompt": "a" * (8 << 20)}, False),
    ("huge seed", {"model": "default", "prompt": "hi", "seed": 2**80}, False),
    ("dropped stream", {"model": "default", "prompt": "Tell me a long story.",
                        "max_tokens": 200, "stream": True}, True),
]


async def abuser(client: httpx.AsyncClient, n: int, spread_s: float, rng: random.Random,
                 outcomes: list[str]) -> None:
    """`n` hostile requests spread over `spread_s` seconds; each outcome recorded."""
    for _ in range(n):
        await asyncio.sleep(rng.uniform(0, 2 * spread_s / max(n, 1)))
        name, body, drop = rng.choice(ABUSE)
        content = body if isinstance(body, str) else json.dumps(body)
        headers = {"content-type": "application/json"}
        try:
            if drop:
                async with client.stream("POST", "/v1/completions", content=content,
                                         headers=headers) as r:
                    async for _line in r.aiter_lines():
                        break  # the client goes away after the first chunk
                outcomes.append(f"{name}: dropped")
            else:
                r = await client.post("/v1/completions", content=content, headers=headers)
                outcomes.append(f"{name}: {r.status_code}")
        except httpx.HTTPError as e:
            outcomes.append(f"{name}: {type(e).__name__}")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name in ("kvtier_device_blocks", "kvtier_host_slots"):
                out[f"{family.name}:{s.labels.get('state')}"] = s.value
            elif family.name in ("kvtier_requests_running", "kvtier_requests_waiting"):
                out[family.name] = s.value
    return out


async def drive(url: str, args: argparse.Namespace
                ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    abuse: list[str] = []
    limits = httpx.Limits(max_connections=args.sessions + 8)
    timeout = httpx.Timeout(args.request_timeout)
    honest = args.sessions * args.turns
    n_abuse = round(honest * args.abuse / (1 - args.abuse)) if args.abuse else 0
    spread = args.turns * (args.gap_min + args.gap_max) / 2 + 10  # about the honest run
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        tasks = [session(client, i, args.turns, (args.gap_min, args.gap_max), args.max_tokens,
                         random.Random(i), records, errors) for i in range(args.sessions)]
        tasks += [abuser(client, n_abuse // 4 + (k < n_abuse % 4), spread,
                         random.Random(1000 + k), abuse) for k in range(4 if n_abuse else 0)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.deadline)
    return records, errors, abuse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--gap-min", type=float, default=2.0)
    ap.add_argument("--gap-max", type=float, default=5.0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--deadline", type=float, default=900.0, help="the whole run stops by then")
    ap.add_argument("--abuse", type=float, default=0.0,
                    help="share of all requests that are hostile (e.g. 0.1)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--server-args", default="",
                    help="more `kvtier serve` flags, appended (later flags win), e.g. a disk tier")
    args = ap.parse_args()
    cmd = ["--num-device-blocks", "160", "--kv-offloading-size", "1.0",
           "--idle-offload-s", "1.5", "--max-num-seqs", "32", *shlex.split(args.server_args)]
    if args.model:
        cmd += ["--model", args.model]
    server, url = start_server(*cmd)
    try:
        baseline = gauges(url)
        start = time.perf_counter()
        records, errors, abuse = asyncio.run(drive(url, args))
        wall = time.perf_counter() - start
        time.sleep(3.0)  # let write-through stores land
        after = gauges(url)
    finally:
        server.terminate()
        server.wait(timeout=60)
    by_class: dict[str, list[float]] = {}
    for r in records:
        by_class.setdefault(r["residency"], []).append(r["ttft_s"])
    summary = {cls: summarize(v) for cls, v in sorted(by_class.items())}
    expected = args.sessions * args.turns
    checks = {
        "no_errors": not errors,
        "every_response_complete": len(records) == expected,
        "device_blocks_back_to_baseline": after.get("kvtier_device_blocks:used")
        == baseline.get("kvtier_device_blocks:used"),
        "host_slots_unpinned": after.get("kvtier_host_slots:pinned") == 0,
        "nothing_running": after.get("kvtier_requests_running") == 0
        and after.get("kvtier_requests_waiting") == 0,
    }
    print(f"{args.sessions} sessions x {args.turns} turns in {wall:.1f} s; "
          f"{len(records)}/{expected} complete; {len(errors)} errors")
    print(f"{'residency':<11} {'n':>4} {'p50 ms':>8} {'p99 ms':>8}")
    for cls, s in summary.items():
        print(f"{cls:<11} {s['count']:>4} {s['p50'] * 1e3:>8.0f} {s['p99'] * 1e3:>8.0f}")
    for name, ok in checks.items():
        print(f"check {name}: {'PASS' if ok else 'FAIL'}")
    for e in errors[:5]:
        print(f"error: {e}")
    outcomes = dict(sorted(Counter(abuse).items()))
    if abuse:
        print(f"{len(abuse)} hostile requests beside them: " + ", ".join(
            f"{k} x{v}" for k, v in outcomes.items()))
    path = write_result("serve_load", {"summary": summary, "checks": checks,
                                       "baseline": baseline, "after": after,
                                       "errors": errors, "wall_s": wall,
                                       "abuse": args.abuse, "abuse_outcomes": outcomes},
                        args.out)
    print(f"wrote {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
