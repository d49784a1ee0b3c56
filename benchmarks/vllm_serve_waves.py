"""Does kvtier's tier come back after waves of streaming clients that drop at random (issue
42, item 14)? `vllm serve` with kvtier (a small host, a disk): a session S of 1024 tokens is
served, pushed out of vLLM's pool and kvtier's host by four other prompts, then `--waves`
waves of `--clients` concurrent streaming clients (random prompts of 300-900 tokens, each
dropping after 1, 3, 8 or 20 chunks, or reading to the end), then four more prompts, then S
returns: how many of its tokens came back from kvtier, from where, and what kvtier's
counters in /metrics say (restored, declined, misses by reason, store refusals).

    .venv/bin/python benchmarks/vllm_serve_waves.py [--waves 3] [--clients 16]
        [--rounds 1] [--hogs 0] [--reuse 0] [--disk-gib 4] [--host-gib 0.047] [--seed 0] [--out DIR]

`--rounds` repeats waves, evictors and S's return on one server (a round's wake from disk
is what a later round's planner remembers); `--hogs` runs that many busy processes beside
the server for the whole run, the loaded 2-core machine the issue saw; `--reuse` is the
chance a wave's client sends a prompt sent before (S's among them) instead of a new one,
so clients walk away from wakes too.

Needs the vLLM environment (bash scripts/vllm_env.sh). SmolLM2-135M float32, vLLM's pool 24
blocks of 128 tokens, 8 sequences at once. JSON goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from common import write_result  # noqa: E402
from vllm_run import VLLM_PYTHON, VllmServer, prompts  # noqa: E402

DROPS = (None, 0, 1, 3, 8, 20)  # chunks read before the client goes away (None: to the end)
KEPT = ("restored_tokens_total", "declined_tokens_total", "declined_total", "miss_blocks_total",
        "store_refused_total", "written_blocks_total", "fetched_blocks_total")


def kvtier_counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvtier") and any(k in line for k in KEPT):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def complete(url: str, ids: list[int]) -> dict[str, Any]:
    import httpx

    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "default", "prompt": ids, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


async def streamer(client: Any, url: str, ids: list[int], drop_after: int | None) -> str:
    try:
        async with client.stream("POST", f"{url}/v1/completions", json={
                "model": "default", "prompt": ids, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            n = 0
            if drop_after == 0:  # gone once the response began: mid-prefill, mid-wake
                return "dropped"
            async for _ in r.aiter_lines():
                n += 1
                if drop_after is not None and n >= drop_after:
                    return "dropped"
        return "done"
    except Exception as e:  # a client's view: whatever ended its stream
        return type(e).__name__


async def wave(url: str, clients: int, rng: random.Random, seen: list[list[int]],
               reuse: float) -> list[str]:
    """`clients` streams at once: with chance `reuse` a prompt sent before (S among them:
    a wake from host or disk that its client may walk away from), else a new random one."""
    import httpx

    sent = []
    for _ in range(clients):
        if seen and rng.random() < reuse:
            sent.append(rng.choice(seen))
        else:
            sent.append([rng.randrange(100, 49000) for _ in range(rng.choice([300, 600, 900]))])
            seen.append(sent[-1])
    async with httpx.AsyncClient(timeout=300) as client:
        return list(await asyncio.gather(*[
            streamer(client, url, ids, rng.choice(DROPS)) for ids in sent]))


def hog() -> None:
    """A process that only burns CPU: the other load of a loaded machine."""
    while True:
        sum(i * i for i in range(10_000))


def one_round(url: str, session: list[int], args: argparse.Namespace, rng: random.Random,
              seed: int, seen: list[list[int]]) -> dict[str, Any]:
    """Waves of dropping clients, four evictors, then S back: what came back, from where."""
    waves = []
    for _ in range(args.waves):
        began = time.perf_counter()
        ends = asyncio.run(wave(url, args.clients, rng, seen, args.reuse))
        waves.append({"seconds": round(time.perf_counter() - began, 2),
                      "dropped": ends.count("dropped"), "done": ends.count("done"),
                      "other": len(ends) - ends.count("dropped") - ends.count("done")})
        time.sleep(1.0)
    for ids in prompts(n_evictors=4, seed=seed)[1:5]:
        complete(url, ids)
    time.sleep(3.0)
    began = time.perf_counter()
    back = complete(url, session)
    params = back.get("kv_transfer_params") or {}
    return {"waves": waves, "session": {
        "restored_tokens": params.get("kvtier_restored_tokens"),
        "residency": params.get("kvtier_residency"),
        "cached_tokens": back["usage"]["prompt_tokens_details"]["cached_tokens"],
        "seconds": round(time.perf_counter() - began, 2)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--hogs", type=int, default=0)
    ap.add_argument("--reuse", type=float, default=0.0)
    ap.add_argument("--disk-gib", type=float, default=4.0)
    ap.add_argument("--host-gib", type=float, default=0.047)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    work = Path(tempfile.mkdtemp(prefix="kvtier-waves-"))
    rng = random.Random(args.seed)
    try:
        model = export_hf(load_model(None), work / "hf")
        connector = {"kv_offloading_size": args.host_gib, "disk_kv_path": str(work / "kv"),
                     "disk_kv_size": args.disk_gib}
        server = VllmServer(model, connector, blocks=24, log_path=work / "vllm.log",
                            max_num_seqs=8).start()
        hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hogs)]
        for h in hogs:
            h.start()
        try:
            session, *others = prompts(n_evictors=4)[:5]
            complete(server.url, session)
            for ids in others:
                complete(server.url, ids)
            seen = [session, *others]
            rounds = [one_round(server.url, session, args, rng, seed=7 + i, seen=seen)
                      for i in range(args.rounds)]
            counters = kvtier_counters(server.url)
        finally:
            for h in hogs:
                h.terminate()
            server.close()
        log = [line for line in (work / "vllm.log").read_text(errors="replace").splitlines()
               if "kvtier" in line and ("WARNING" in line or "slow" in line)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"args": vars(args), "rounds": rounds, "counters": counters, "log": log}
    print(f"{'round':>5} {'wave':>4} {'seconds':>8} {'dropped':>8} {'done':>5} {'other':>6}")
    for r, one in enumerate(rounds):
        for i, w in enumerate(one["waves"]):
            print(f"{r:>5} {i:>4} {w['seconds']:>8} {w['dropped']:>8} {w['done']:>5} "
                  f"{w['other']:>6}")
    for r, one in enumerate(rounds):
        s = one["session"]
        print(f"round {r}: session back in {s['seconds']} s, restored {s['restored_tokens']} "
              f"tokens from {s['residency']} (vLLM's cached_tokens {s['cached_tokens']})")
    for name, value in sorted(counters.items()):
        print(f"  {name} {value:g}")
    for line in log[-20:]:
        print(f"  log: {line[-200:]}")
    print(f"wrote {write_result('vllm_serve_waves', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
