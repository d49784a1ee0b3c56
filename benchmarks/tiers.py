"""Tier wake-up: TTFT of a 16-token follow-up whose session KV lives in host memory, on disk or
in Redis, against recomputing it, and a disk too slow to be worth reading.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/tiers.py \
        [--contexts 512,2048,4096] [--repeats 3] [--dir DIR] [--slow-gbps X] [--out DIR]

(`--contexts 512,2048` for a quick run.) The embedded SmolLM2-135M (float32, CPU) is loaded
once. Per context length L, every repeat is a fresh random session of L tokens, so nothing is
cached from an earlier repeat, and the follow-up is session + 16 new tokens, greedy, a few
tokens decoded. Rows:

  recompute  an engine with no tier computes session + follow-up from scratch (the baseline)
  host       engine A serves the session, its KV is demoted to the host tier
             (`demote_cached`), then the follow-up: residency "host"
  disk       A had a disk tier (and the Redis tier) too and is closed: a clean shutdown writes
             the cache down. Engine B opens the same disk dir and serves a follow-up of each
             session: residency "disk". The slot file's pages are dropped from the page cache
             (fdatasync + POSIX_FADV_DONTNEED) before each wake, so the bytes come off the disk
  remote     engine C with only the Redis tier (a redis-server this script starts on
             loopback) serves a follow-up of each session: residency "remote"
  disk-slow  engine D on the same disk dir with `disk_kv_max_gbps` capped so reading the KV
             is ~4x slower than recomputing it (cap from the recompute row's measured prefill
             rate, or --slow-gbps): the planner must decline the fetch (residency
             "new"/"recomputed", nothing restored) and TTFT must stay near recompute's

A writes every session once; B, C and D each start empty (a restart), so each of their wakes
finds its session only in the tier under test, and each follow-up's new tokens differ.

Per row: median TTFT, speedup vs recompute, residency seen (flagged when not the expected
one), restored tokens, wake GB/s (restored bytes over fetch + host->device load seconds),
the fetch hop's own GB/s (tier -> host, from the tier I/O thread's timing), the planner's
tier GB/s estimate when it decided, its predicted restore vs recompute seconds, and the cores
this process kept busy during the follow-up (a compute-bound row well under the thread count
is flagged: the machine was shared then; a VM host's own contention does not show). Beside
them, raw bandwidths measured in the same run: a host tensor copy, the planner's disk probe
(`measure_disk_gbps`) and a 128 MiB cold read in block-sized preads on the same directory,
and Redis (`measure_remote_gbps`). JSON goes to benchmarks/results/tiers-*.json.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_peak_gbps, write_result
from disk_layout import drop_cache, resident_fraction
from local_redis import LocalRedis

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel, load_model
from kvtier.output import RequestOutput
from kvtier.sequence import SamplingParams
from kvtier.tier.planner import Decision
from kvtier.tier.stores.disk.file import FILE_NAME
from kvtier.tier.stores.disk.probe import measure_disk_gbps
from kvtier.tier.stores.redis.probe import measure_remote_gbps
from kvtier.tier.stores.redis.store import RedisStore

GIB = 1024**3
BLOCK = 16
FOLLOW_UP = 16  # tokens of the new user message
WARMUP_TOKENS = 64
SLOW_FACTOR = 4.0  # disk-slow: reading the KV takes this many times the measured recompute
SLOW_TTFT_TOLERANCE = 1.25  # disk-slow TTFT within this factor of recompute's
COLD_READ_MIB = 128
BANDWIDTH_SAMPLES = 5
TIERS = ("recompute", "host", "disk", "remote", "disk-slow")
EXPECTED = {"recompute": ("new",), "host": ("host",), "disk": ("disk",),
            "remote": ("remote",), "disk-slow": ("new", "recomputed")}


@dataclass
class Sample:
    """One follow-up turn: what the engine reported and what the planner thought beforehand."""

    ttft_s: float
    residency: str
    restored_tokens: int
    restore_bytes: int
    load_s: float  # host -> device (RequestMetrics.restore_s)
    cores: float  # CPU seconds of this process per wall second during the request
    fetch_s: float = 0.0  # tier -> host, the tier I/O thread's job time
    fetch_bytes: int = 0
    fetched_blocks: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    tier_gbps_before: float | None = None  # the planner's estimate when it decided
    predicted_choice: str | None = None
    predicted_restore_s: float | None = None
    predicted_recompute_s: float | None = None
    page_cache_share: float | None = None  # of the disk slot file, just before the wake


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def ask(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = engine.add_request(prompt, params)
    return engine.run_to_completion([rid])[rid]


def measured(engine: LLMEngine, prompt: list[int], params: SamplingParams
             ) -> tuple[RequestOutput, float]:
    """The request's output, and the cores this process kept busy meanwhile (CPU seconds
    of all its threads over wall seconds): well under the thread count means the machine
    was shared at that moment."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = ask(engine, prompt, params)
    return out, (time.process_time() - cpu) / (time.perf_counter() - wall)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_or_none(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def filesystem_of(path: Path) -> dict[str, str]:
    """The mount holding `path` (longest mount point that prefixes it) from /proc/mounts."""
    resolved = str(path.resolve())
    best = {"mount": "?", "fstype": "unknown", "device": "?"}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"].replace("?", "")):
            best = {"mount": mount, "fstype": parts[2], "device": parts[0]}
    return best


def cold_read_gbps(directory: Path, block_bytes: int, mib: int = COLD_READ_MIB) -> float:
    """Read GB/s of `mib` MiB read cold in block-sized preads (as the disk tier reads slots)."""
    return measure_disk_gbps(directory, block_bytes, blocks=max(1, (mib << 20) // block_bytes))


def raw_bandwidths(directory: Path, block_bytes: int, url: str | None) -> dict[str, Any]:
    """This minute's ceilings: host copy, the disk under `directory`, Redis."""
    out: dict[str, Any] = {"host_copy_gbps": copy_peak_gbps()}
    probes = [measure_disk_gbps(directory, block_bytes) for _ in range(BANDWIDTH_SAMPLES)]
    out["disk_probe_gbps"] = median(probes)
    out["disk_probe_samples_gbps"] = probes
    out["disk_cold_read_gbps"] = cold_read_gbps(directory, block_bytes)
    out["redis_gbps"] = None
    if url is not None:
        store = RedisStore(url, os.urandom(16))
        try:
            if store.ping():
                samples = [measure_remote_gbps(store, block_bytes)
                           for _ in range(BANDWIDTH_SAMPLES)]
                out["redis_gbps"] = median(samples)
                out["redis_samples_gbps"] = samples
        finally:
            store.close()
    return out


class Bench:
    """Engines built on the one loaded model, and the per-context measurement."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, contexts: list[int],
                 root: Path, redis: LocalRedis) -> None:
        self.loaded = loaded
        self.vocab = loaded.spec.vocab_size
        self.repeats = args.repeats
        self.slow_gbps: float | None = args.slow_gbps
        self.params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
        self.root = root
        self.redis = redis
        self.rng = random.Random(args.seed)
        self.blocks = max(contexts) // BLOCK * 2 + 64
        self.base = {"num_device_blocks": self.blocks, "max_num_batched_tokens": 8192}
        self.block_bytes = 0  # set by build(): bytes of one 16-token KV block
        self.recompute_engine = self.build()

    def build(self, **knobs: Any) -> LLMEngine:
        engine = LLMEngine(EngineConfig.from_knobs(**self.base, **knobs), loaded=self.loaded)
        self.block_bytes = engine.runner.block_bytes
        ask(engine, tokens(self.rng, WARMUP_TOKENS, self.vocab), self.params)  # warm-up
        engine.drain()
        return engine

    def finish(self, engine: LLMEngine) -> dict[str, Any] | None:
        """Close (a clean shutdown: writes the cache down); its deep-tier stats."""
        stats = self.deep_stats(engine)
        engine.close()
        return stats

    @staticmethod
    def deep_stats(engine: LLMEngine) -> dict[str, Any] | None:
        if not engine.tier.enabled:
            return None
        engine.drain()
        return engine_stats(engine, RequestLog())["tiers_below_host"]

    def sizes(self, length: int) -> tuple[float, float]:
        """GiB of host memory and disk: every session of this context with room to spare."""
        per_session = (length // BLOCK + 4) * self.block_bytes
        need = (self.repeats + 1) * per_session
        return max(0.25, 1.5 * need / GIB), max(0.25, 2.0 * need / GIB)

    def measure(self, length: int) -> dict[str, Any]:
        repeats, vocab, rng = self.repeats, self.vocab, self.rng
        samples: dict[str, list[Sample]] = {t: [] for t in TIERS}
        notes: list[str] = []
        n_blocks = length // BLOCK
        nbytes = n_blocks * self.block_bytes
        bytes_per_token = self.block_bytes / BLOCK

        for _ in range(repeats):
            out, cores = measured(self.recompute_engine, tokens(rng, length + FOLLOW_UP, vocab),
                                  self.params)
            samples["recompute"].append(self.sample(out, cores))

        directory = self.root / f"ctx-{length}"
        directory.mkdir(mode=0o700)
        host_gib, disk_gib = self.sizes(length)
        disk = {"disk_kv_path": str(directory), "disk_kv_size": disk_gib}
        remote = {"remote_kv_url": self.redis.url} if self.redis.url else {}
        self.redis.flush()

        # A: the sessions' first turns, written through to host, disk and Redis; host row.
        a = self.build(kv_offloading_size=host_gib, **disk, **remote)
        sessions = [tokens(rng, length, vocab) for _ in range(repeats)]
        for session in sessions:
            ask(a, session, self.params)
            assert a.tier.enabled
            a.drain()  # a user thinks for seconds: the write-through has landed
            a.demote_cached()  # the session went idle: its KV is on host only
            decision = a.tier.manager.decide(length, nbytes)
            link = a.tier.report().calibration["link_gbps"]
            out, cores = measured(a, session + tokens(rng, FOLLOW_UP, vocab), self.params)
            samples["host"].append(self.sample(out, cores, decision))
            samples["host"][-1].tier_gbps_before = link
            a.demote_cached()
        a_stats = self.finish(a)

        slot_file = directory / FILE_NAME
        # B: a restart on the same disk dir; the sessions live on disk only.
        b = self.build(kv_offloading_size=host_gib, **disk)
        samples["disk"] = self.wake_deep(b, "disk", sessions, nbytes, slot_file)
        b_stats = self.finish(b)

        c_stats = None
        if self.redis.url:
            c = self.build(kv_offloading_size=host_gib, **remote)
            samples["remote"] = self.wake_deep(c, "remote", sessions, nbytes, None)
            c_stats = self.finish(c)
        else:
            notes.append(f"remote skipped: {self.redis.reason}")

        recompute_ttft = median([s.ttft_s for s in samples["recompute"]])
        measured_tps = (length + FOLLOW_UP) / recompute_ttft
        cap = self.slow_gbps or bytes_per_token * measured_tps / SLOW_FACTOR / 1e9
        d = self.build(kv_offloading_size=host_gib, disk_kv_max_gbps=cap, **disk)
        samples["disk-slow"] = self.wake_deep(d, "disk", sessions, nbytes, slot_file)
        d_stats = self.finish(d)

        bandwidth = raw_bandwidths(directory, self.block_bytes, self.redis.url)
        self.redis.flush()
        shutil.rmtree(directory, ignore_errors=True)
        return {
            "context": length, "kv_bytes": nbytes, "bytes_per_token": bytes_per_token,
            "host_gib": host_gib, "disk_gib": disk_gib, "slow_cap_gbps": cap,
            "slow_cap_from": "--slow-gbps" if self.slow_gbps else
            f"recompute row's {measured_tps:.0f} tokens/s / {SLOW_FACTOR:g}",
            "raw": bandwidth, "notes": notes,
            "deep_stats": {"A_writer": a_stats, "B_disk": b_stats, "C_remote": c_stats,
                           "D_disk_slow": d_stats},
            "samples": {t: [asdict(s) for s in ss] for t, ss in samples.items()},
            "rows": {t: summarize(t, ss, recompute_ttft) for t, ss in samples.items() if ss},
        }

    def wake_deep(self, engine: LLMEngine, tier: str, sessions: list[list[int]], nbytes: int,
                  slot_file: Path | None) -> list[Sample]:
        """A follow-up of every session on an engine that holds them only in `tier`."""
        assert engine.tier.enabled
        manager = engine.tier.manager
        out_samples = []
        for session in sessions:
            before = self.deep_stats(engine) or {}
            share = None
            if slot_file is not None:
                drop_cache([slot_file])
                share = resident_fraction([slot_file])
            gbps = engine.tier.report().calibration["tier_gbps"].get(tier)
            decision = manager.decide(len(session), nbytes, "auto", tier)
            out, cores = measured(engine, session + tokens(self.rng, FOLLOW_UP, self.vocab),
                                  self.params)
            after = self.deep_stats(engine) or {}
            sample = self.sample(out, cores, decision)
            sample.tier_gbps_before = gbps
            sample.page_cache_share = share
            sample.fetch_bytes = sum(delta(before.get("fetched_bytes", {}),
                                           after.get("fetched_bytes", {})).values())
            sample.fetch_s = sum(delta(before.get("fetch_seconds", {}),
                                       after.get("fetch_seconds", {})).values())
            sample.fetched_blocks = delta(before.get("fetched_blocks", {}),
                                          after.get("fetched_blocks", {}))
            sample.misses = delta(before.get("misses", {}), after.get("misses", {}))
            out_samples.append(sample)
        return out_samples

    @staticmethod
    def sample(out: RequestOutput, cores: float, decision: Decision | None = None) -> Sample:
        assert out.metrics.ttft_s is not None
        s = Sample(out.metrics.ttft_s, str(out.residency), out.num_restored_tokens,
                   out.restore_bytes, out.metrics.restore_s, cores)
        if decision is not None:
            s.predicted_choice = decision.choice
            s.predicted_restore_s = decision.restore_s
            s.predicted_recompute_s = decision.recompute_s
        return s


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def summarize(tier: str, samples: list[Sample], recompute_ttft: float) -> dict[str, Any]:
    ttft = median([s.ttft_s for s in samples])
    seen = sorted({s.residency for s in samples})
    wake = [s.restore_bytes / (s.fetch_s + s.load_s) / 1e9 for s in samples
            if s.restore_bytes and s.fetch_s + s.load_s > 0]
    fetch = [s.fetch_bytes / s.fetch_s / 1e9 for s in samples if s.fetch_s > 0]
    gbps = [s.tier_gbps_before for s in samples if s.tier_gbps_before is not None]
    choices = sorted({s.predicted_choice for s in samples if s.predicted_choice})
    restored = [s.restored_tokens for s in samples]
    ok = all(s.residency in EXPECTED[tier] for s in samples)
    if tier == "disk-slow":
        ok = ok and not any(restored)
    return {
        "ttft_s": ttft, "ttft_samples_s": [s.ttft_s for s in samples],
        "speedup_vs_recompute": recompute_ttft / ttft,
        "residency_seen": seen, "residency_expected": list(EXPECTED[tier]), "residency_ok": ok,
        "restored_tokens": median([float(r) for r in restored]),
        "load_s": median([s.load_s for s in samples]),
        "cores": median([s.cores for s in samples]),
        "cores_min": min(s.cores for s in samples),
        "fetch_s": median([s.fetch_s for s in samples]) if fetch else None,
        "wake_gbps": median_or_none(wake),
        "fetch_gbps": median_or_none(fetch),
        "planner_tier_gbps": median_or_none(gbps),
        "planner_choice": choices,
        "predicted_restore_s": median_or_none([s.predicted_restore_s for s in samples]),
        "predicted_recompute_s": median_or_none([s.predicted_recompute_s for s in samples]),
        "page_cache_share_max": max((s.page_cache_share for s in samples
                                     if s.page_cache_share is not None), default=None),
        "misses": dict(sum((Counter(s.misses) for s in samples), Counter())),
    }


def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None or x != x else format(x * scale, spec)


def report(results: list[dict[str, Any]], fs: dict[str, str], directory: Path,
           threads: int) -> list[str]:
    """Print the table; return the flags: a residency or a decision that was not expected,
    a write or fetch that failed, a compute-bound sample that did not get its cores."""
    flags: list[str] = []
    print(f"disk dir {directory} on {fs['fstype']} ({fs['device']} at {fs['mount']})")
    head = (f"{'ctx':>5} {'tier':<9} {'TTFT ms':>8} {'speedup':>7} {'residency':<11} "
            f"{'restored':>8} {'wake GB/s':>9} {'fetch GB/s':>10} {'planner GB/s':>12} "
            f"{'choice':<9} {'pred rest ms':>12} {'pred recomp ms':>14} {'cores':>5}")
    for r in results:
        print()
        raw = r["raw"]
        print(f"context {r['context']}: KV {r['kv_bytes'] / 1e6:.1f} MB; raw GB/s: host copy "
              f"{raw['host_copy_gbps']:.1f}, disk probe {raw['disk_probe_gbps']:.2f}, disk cold "
              f"read {raw['disk_cold_read_gbps']:.2f}, Redis {fmt(raw['redis_gbps'], '.2f')}; "
              f"disk-slow cap {r['slow_cap_gbps']:.4f} GB/s ({r['slow_cap_from']})")
        print(head)
        for tier, row in r["rows"].items():
            seen = "/".join(row["residency_seen"])
            mark = "" if row["residency_ok"] else " !"
            per_sample = [(x["residency"], x["restored_tokens"])
                          for x in r["samples"][tier]]
            if not row["residency_ok"]:
                flags.append(f"context {r['context']} {tier}: (residency, restored tokens) per "
                             f"repeat {per_sample}; expected "
                             f"{'/'.join(row['residency_expected'])}")
            if row["misses"]:
                flags.append(f"context {r['context']} {tier}: blocks not served {row['misses']}")
            if tier in ("recompute", "disk-slow") and row["cores_min"] < 0.75 * threads:
                ttfts = ", ".join(f"{t * 1e3:.0f}" for t in row["ttft_samples_s"])
                flags.append(f"context {r['context']} {tier}: a compute-bound repeat kept only "
                             f"{row['cores_min']:.2f} of {threads} cores busy (machine shared?); "
                             f"TTFTs {ttfts} ms")
            print(f"{r['context']:>5} {tier:<9} {row['ttft_s'] * 1e3:>8.1f} "
                  f"{row['speedup_vs_recompute']:>6.1f}x {seen + mark:<11} "
                  f"{row['restored_tokens']:>8.0f} {fmt(row['wake_gbps'], '.2f'):>9} "
                  f"{fmt(row['fetch_gbps'], '.2f'):>10} "
                  f"{fmt(row['planner_tier_gbps'], '.3f'):>12} "
                  f"{'/'.join(row['planner_choice']) or '-':<9} "
                  f"{fmt(row['predicted_restore_s'], '.1f', 1e3):>12} "
                  f"{fmt(row['predicted_recompute_s'], '.1f', 1e3):>14} "
                  f"{row['cores']:>5.2f}")
        share = r["rows"].get("disk", {}).get("page_cache_share_max")
        if share is not None:
            print(f"disk slot file pages in the page cache before a disk wake: at most "
                  f"{share:.1%}")
        for note in r["notes"]:
            print(f"note: {note}")
        slow = r["rows"].get("disk-slow")
        if slow is not None:
            recompute_s = r["rows"]["recompute"]["ttft_s"]
            ratio = slow["ttft_s"] / recompute_s
            at_cap = r["kv_bytes"] / (r["slow_cap_gbps"] * 1e9) / recompute_s
            close = ratio <= SLOW_TTFT_TOLERANCE
            print(f"disk-slow: the planner declined the fetch in every repeat (nothing "
                  f"restored): {'PASS' if slow['residency_ok'] else 'MISS'}; TTFT {ratio:.2f}x "
                  f"recompute's (<= {SLOW_TTFT_TOLERANCE:g}x: {'PASS' if close else 'MISS'}), "
                  f"where reading the KV at the cap would take {at_cap:.1f}x recompute's TTFT")
            if not close:
                flags.append(f"context {r['context']} disk-slow: TTFT {ratio:.2f}x recompute's "
                             f"(the same prefill on another engine; cores "
                             f"{slow['cores_min']:.2f}-{slow['cores']:.2f})")
        for who, stats in r["deep_stats"].items():
            failures = (stats or {}).get("write_failures") or {}
            if any(failures.values()):
                flags.append(f"context {r['context']} {who}: write failures {failures}")
    print()
    print("speedup = recompute TTFT / tier TTFT (medians); wake GB/s = restored bytes / "
          "(fetch + host->device load s); fetch GB/s = tier -> host hop alone; planner GB/s = "
          "its tier estimate when it decided (host: link); pred = the planner's restore and "
          "recompute seconds for that decision; cores = this process's CPU seconds per wall "
          "second during the follow-up (median)")
    for flag in flags:
        print(f"FLAG {flag}")
    return flags


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=4, help="greedy tokens per follow-up")
    ap.add_argument("--dir", default=".",
                    help="where the disk tier's temp dir is made (default: the current dir)")
    ap.add_argument("--slow-gbps", type=float, default=None,
                    help="disk-slow cap; default: 1/4 of the measured recompute rate's bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    contexts = [int(x) for x in args.contexts.split(",")]
    for length in contexts:
        if length < BLOCK or length % BLOCK:
            ap.error(f"--contexts: {length} must be a positive multiple of {BLOCK}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-", dir=args.dir)).resolve()
    fs = filesystem_of(root)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        print(f"warning: {root} is on {fs['fstype']}: the disk rows measure RAM, not a disk")
    redis = LocalRedis()
    if redis.server is None:
        print(f"remote row skipped: {redis.reason}")
    try:
        loaded = load_model(None)
        bench = Bench(loaded, args, contexts, root, redis)
        results = []
        for length in contexts:
            t = time.perf_counter()
            results.append(bench.measure(length))
            print(f"context {length} measured in {time.perf_counter() - t:.0f}s", flush=True)
        bench.recompute_engine.close()
    finally:
        redis.close()
        shutil.rmtree(root, ignore_errors=True)

    print(f"model {loaded.source}; {args.repeats} repeats; torch threads "
          f"{torch.get_num_threads()}")
    flags = report(results, fs, root, torch.get_num_threads())
    wall = time.perf_counter() - started
    path = write_result("tiers", {
        "model": loaded.source, "contexts": contexts, "repeats": args.repeats,
        "follow_up_tokens": FOLLOW_UP, "decode_tokens": args.decode,
        "disk_dir": str(root), "filesystem": fs, "redis": redis.reason or "redis-server on "
        "127.0.0.1 started by this script", "wall_s": wall, "flags": flags, "results": results,
    }, args.out)
    print(f"wrote {path} ({wall:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
