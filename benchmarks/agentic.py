"""Agentic replay: TTFT by residency of agent sessions that return after tool calls while a
noisy tenant floods the tiers, with no hints, with retention and with retention + prefetch;
and a noisy neighbour against a victim tenant, with and without tenant quotas.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/agentic.py [--quick] [--dir DIR] \
        [--seed N] [--out DIR]

(`--quick`: about 1.5 minutes on 2 cores; the default run is sized for about 10.) The embedded
SmolLM2-135M (float32, CPU) is loaded once; every run below builds a fresh engine on it with
a small device pool, a small host tier and a disk tier (a temp dir under --dir, default the
current directory) and replays the same seeded workload, in wall time:

  agent sessions  tenant and cache salt "agents": a shared system prompt + a first user
                  message, then turns. Each turn is greedy (a few tokens, ignore_eos); after
                  it a tool call runs for a scripted gap (seconds), and the next turn's
                  prompt is the whole context so far + the reply + the tool's result, so a
                  session grows to ~1-2k tokens (recomputing it costs seconds here; waking
                  it from host a fraction of that)
  noisy tenant    tenant and salt "noisy": distinct prompts (1 token out), --noisy-rps of
                  them per second of every gap (the same count in every run), written
                  through to host and disk like any other, so during the gaps the agents'
                  KV leaves the device, the host and (without retention) the disk
  driver          one request at a time. The noisy prompts a finished turn's gap calls for
                  are sent before any next turn; a turn is sent once its gap has passed and
                  nothing is in flight, so a TTFT is the turn's own wake or recompute, not
                  a queue behind another prefill (the wait is kept as late_s in the JSON).
                  Between requests the driver keeps calling engine.step() (what stages an
                  expected return) and the tool-call clocks keep running

Agentic modes (same workload, fresh engine and disk each):

  no-hints            KvHints(tenant="agents") only
  retention           + kv_retention_s on every turn: the agents' blocks are pinned (on
                      host while there is room for them, spilled to disk, never evicted by
                      the noisy tenant)
  retention+prefetch  + kv_expect_return_s = the tool call's gap: the engine stages the
                      session up from disk to host shortly before it returns

Noisy neighbour (same engine shape, a victim tenant instead of the agents): the victim pins
its system prompt once (kv_retention_s) and then runs chat sessions on it, unretained, while
the noisy tenant floods; run once without quotas and once with kv_tenant_quota (host and disk
GiB for every tenant, sized so the noisy tenant is over it) and kv_tenant_quotas giving the
victim the whole tiers: over its quota, the noisy tenant loses blocks first.

Table rows: per mode (or quota setting) and per residency of the turns that came back after
a gap (turn >= 1; first turns are in the JSON), the count n, TTFT p50 and p99 (nearest rank:
with n < 100 the p99 is the slowest turn) and the medians of the prompt's tokens, of those
found on the device (prefix cache), restored from the tier and recomputed although found
below (a declined or failed fetch); "all" pools the residencies. Under each mode: the noisy
prompts sent, the residency counts, token exactness, and the tenant's books at the end
(blocks held, retained and evicted in host/disk, retentions granted and refused by reason:
quota, full = retention may pin at most 80% of a tier). residency: resident (a prefix, at
least the shared system prompt, still in the device cache; the rest computed), host, disk
(fetched up to host, then restored), recomputed (found below but computed again), new
(nothing found). Exactness: the greedy tokens of each turn against the same turn (same
prompt) in the first mode / setting. Every reply (agents, victim and noisy) must be
non-empty. cores: this process's CPU seconds per wall second over the steps that had work (per
turn in the JSON); a run or a compute-bound turn (not a disk wake, which waits on I/O) under
0.75 of the torch threads is flagged: the machine was shared and its TTFTs are inflated.
Everything printed is measured in this run; JSON goes to benchmarks/results/agentic-*.json.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.model.loader import LoadedModel, load_model
from kvtier.output import RequestOutput
from kvtier.sequence import KvHints, SamplingParams

GIB = 1024**3
BLOCK = 16
WARMUP_TOKENS = 64
IDLE_SLEEP_S = 0.005  # the driver's pause between idle engine steps
CORES_SHARE = 0.75  # a run keeping fewer of the torch threads' cores busy is flagged
AGENTS, NOISY, VICTIM = "agents", "noisy", "victim"

# (default, --quick) per workload knob
SIZES: dict[str, tuple[Any, Any]] = {
    "sessions": (5, 3), "turns": (8, 4), "system": (512, 384), "first_user": (64, 64),
    "tool_min": (128, 128), "tool_max": (256, 224), "gap_min": (1.0, 1.0),
    "gap_max": (5.0, 2.5), "victim_sessions": (3, 2), "victim_turns": (6, 4),
    "victim_system": (768, 512), "user_min": (48, 48), "user_max": (96, 96),
    "victim_gap_min": (1.0, 0.5), "victim_gap_max": (3.0, 1.5),
}


@dataclass
class Session:
    """One scripted session: its opening prompt, the tokens each later turn appends after
    the reply (a tool's result or a user message), and the gap before each later turn."""

    name: str
    opening: list[int]
    appends: list[list[int]]
    gaps: list[float]
    start_s: float


@dataclass
class Workload:
    tenant: str
    sessions: list[Session]
    noisy_rps: float  # noisy prompts per second of every gap
    pin: list[int] | None = None  # a prefix the tenant retains once before the sessions


@dataclass
class Turn:
    """One finished turn, as the engine reported it."""

    session: str
    turn: int
    prompt_tokens: int
    prompt_digest: str
    residency: str
    ttft_s: float
    restored_tokens: int
    recomputed_tokens: int
    cached_tokens: int
    retention: float | str | None
    late_s: float  # how long after it was due the turn could be sent (one at a time)
    cores: float  # this process's CPU seconds per wall second while the turn was served
    output: list[int] = field(default_factory=list)


@dataclass
class Mode:
    name: str
    retention_s: float | None = None
    expect_return: bool = False
    knobs: dict[str, Any] = field(default_factory=dict)


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def sessions_of(rng: random.Random, vocab: int, prefix: list[int], count: int, turns: int,
                first: int, lo: int, hi: int, gap_lo: float, gap_hi: float,
                name: str) -> list[Session]:
    """`count` sessions opening with `prefix` + `first` tokens, each later turn appending
    lo..hi tokens after a gap of gap_lo..gap_hi s; starts spread over one mean gap."""
    mean_gap = (gap_lo + gap_hi) / 2
    return [Session(f"{name}-{i}", prefix + tokens(rng, first, vocab),
                    [tokens(rng, rng.randint(lo, hi), vocab) for _ in range(turns - 1)],
                    [rng.uniform(gap_lo, gap_hi) for _ in range(turns - 1)],
                    i * mean_gap / count) for i in range(count)]


def longest(session: Session, reply: int) -> int:
    """Tokens of the session's last turn, its reply included."""
    return len(session.opening) + sum(map(len, session.appends)) + reply * len(session.gaps) \
        + reply


def distinct_blocks(work: Workload, shared: int, reply: int) -> int:
    """Blocks of every session at its end, the shared prefix counted once."""
    return shared // BLOCK + sum((longest(s, reply) - shared) // BLOCK + 1
                                 for s in work.sessions)


def percentile(xs: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the samples at or below it."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(turns: list[Turn]) -> dict[str, dict[str, Any]]:
    """Per residency (and "all") of the turns after a gap: n, TTFT p50/p99, restored."""
    back = [t for t in turns if t.turn > 0]
    groups: dict[str, list[Turn]] = {"all": back}
    for t in sorted(back, key=lambda t: t.residency):
        groups.setdefault(t.residency, []).append(t)
    return {name: {"n": len(ts), "ttft_p50_s": statistics.median([t.ttft_s for t in ts]),
                   "ttft_p99_s": percentile([t.ttft_s for t in ts], 0.99),
                   "prompt_tokens_p50": statistics.median([t.prompt_tokens for t in ts]),
                   "device_p50": statistics.median([t.cached_tokens for t in ts]),
                   "restored_p50": statistics.median([t.restored_tokens for t in ts]),
                   "recomputed_p50": statistics.median([t.recomputed_tokens for t in ts])}
            for name, ts in groups.items() if ts}


def exactness(reference: list[Turn], other: list[Turn]) -> dict[str, int]:
    """Turns of `other` whose prompt equals the reference's same turn: how many, and how
    many of those got the same greedy tokens."""
    ref = {(t.session, t.turn): t for t in reference}
    same_prompt = [(ref[(t.session, t.turn)], t) for t in other
                   if (t.session, t.turn) in ref
                   and ref[(t.session, t.turn)].prompt_digest == t.prompt_digest]
    return {"turns": len(other), "same_prompt": len(same_prompt),
            "equal_tokens": sum(1 for a, b in same_prompt if a.output == b.output)}


class Replay:
    """The engines on one loaded model, and the wall-time replay of a workload on one."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace, root: Path) -> None:
        self.loaded = loaded
        self.vocab = loaded.spec.vocab_size
        self.args = args
        self.root = root
        self.reply = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0,
                                    ignore_eos=True)
        self.noisy_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.runs = 0
        self.busy_cpu = self.busy_wall = 0.0  # over the replay's steps that had work

    def noisy_prompt(self, i: int) -> list[int]:
        """The noisy tenant's i-th prompt: the same in every run, distinct from the others."""
        return tokens(random.Random(f"{self.args.seed}-noisy-{i}"), self.args.noisy_tokens,
                      self.vocab)

    def build(self, knobs: dict[str, Any]) -> tuple[LLMEngine, Path]:
        self.runs += 1
        directory = self.root / f"run-{self.runs}"
        directory.mkdir(mode=0o700)
        engine = LLMEngine(EngineConfig.from_knobs(**knobs, disk_kv_path=str(directory)),
                           loaded=self.loaded)
        warm = engine.add_request(tokens(random.Random(-1), WARMUP_TOKENS, self.vocab),
                                  self.noisy_params, cache_salt="warmup")
        engine.run_to_completion([warm])
        engine.drain()
        return engine, directory

    def run(self, work: Workload, mode: Mode, knobs: dict[str, Any]) -> dict[str, Any]:
        """Replay `work` on a fresh engine under `mode`; the turns and the tier's books."""
        engine, directory = self.build({**knobs, **mode.knobs})
        started = time.perf_counter()
        self.busy_cpu = self.busy_wall = 0.0
        empty: Counter[str] = Counter()
        pin = None
        if work.pin is not None:  # the tenant's retained system prompt, once, before the rest
            hints = KvHints(tenant=work.tenant, retention_s=self.args.retention_s)
            rid = engine.add_request(work.pin, self.reply, cache_salt=work.tenant, hints=hints)
            out = engine.run_to_completion([rid])[rid]
            engine.drain()
            pin = {"residency": str(out.residency), "ttft_s": out.metrics.ttft_s,
                   "retention": out.retention}
            empty[work.tenant] += not out.token_ids
        turns, noisy_sent, over = self.replay(engine, work, mode, empty)
        engine.drain()
        report = engine.tier.report()
        stats = engine_stats(engine, RequestLog())
        wall = time.perf_counter() - started
        cores = self.busy_cpu / self.busy_wall if self.busy_wall else float("nan")
        engine.close()
        shutil.rmtree(directory, ignore_errors=True)
        return {"mode": mode.name, "knobs": {**knobs, **mode.knobs}, "wall_s": wall,
                "cores": cores, "load_avg_1m": os.getloadavg()[0],
                "pin": pin, "noisy_prompts": noisy_sent, "empty_replies": dict(empty),
                "unfinished": over, "rows": summarize(turns),
                "tenants": {k: {f: dict(v) if isinstance(v, dict) else v
                                for f, v in vars(c).items()}
                            for k, c in report.tenants.items()},
                "store_refused": report.transfers.store_refused,
                "tiers_below_host": stats.get("tiers_below_host"),
                "turns": [asdict(t) for t in turns]}

    def replay(self, engine: LLMEngine, work: Workload, mode: Mode, empty: Counter[str]
               ) -> tuple[list[Turn], int, list[str]]:
        args = self.args
        t0 = time.perf_counter()
        due = {s.name: t0 + s.start_s for s in work.sessions}
        context = {s.name: list(s.opening) for s in work.sessions}
        turn_of = {s.name: 0 for s in work.sessions}
        by_name = {s.name: s for s in work.sessions}
        agent: tuple[str, str, float] | None = None  # (request id, session, late by s)
        turn_cpu = turn_wall = 0.0
        noisy: set[str] = set()
        owed, noisy_sent = 0, 0  # noisy prompts the gaps so far call for, and sent
        turns: list[Turn] = []
        deadline = t0 + args.max_run_s
        while (due or agent) and time.perf_counter() < deadline:
            now = time.perf_counter()
            if agent is None and not noisy:
                ready = [name for name, at in due.items() if at <= now]
                if owed:  # the flood of the gaps so far goes first
                    rid = engine.add_request(self.noisy_prompt(noisy_sent), self.noisy_params,
                                             cache_salt=NOISY, hints=KvHints(tenant=NOISY))
                    noisy.add(rid)
                    noisy_sent += 1
                    owed -= 1
                elif ready:
                    name = min(ready, key=lambda n: due[n])
                    s, k = by_name[name], turn_of[name]
                    expect = (s.gaps[k] if mode.expect_return and k < len(s.gaps) else None)
                    hints = KvHints(tenant=work.tenant, retention_s=mode.retention_s,
                                    expect_return_s=expect)
                    rid = engine.add_request(context[name], self.reply, cache_salt=work.tenant,
                                             hints=hints)
                    agent = (rid, name, now - due.pop(name))
                    turn_cpu, turn_wall = time.process_time(), time.perf_counter()
            busy = engine.has_unfinished()
            cpu, wall = time.process_time(), time.perf_counter()
            outs = engine.step()
            if busy:
                self.busy_cpu += time.process_time() - cpu
                self.busy_wall += time.perf_counter() - wall
            for out in outs:
                if out.request_id in noisy:
                    empty[NOISY] += not out.token_ids
                    noisy.discard(out.request_id)
                elif agent is not None and out.request_id == agent[0]:
                    empty[work.tenant] += not out.token_ids
                    name, late = agent[1], agent[2]
                    cores = ((time.process_time() - turn_cpu)
                             / max(time.perf_counter() - turn_wall, 1e-9))
                    turns.append(self.turn(out, name, turn_of[name], late, cores))
                    agent = None
                    s, k = by_name[name], turn_of[name]
                    if k < len(s.gaps):  # the tool call (or the user) takes its gap
                        context[name] = context[name] + out.token_ids + s.appends[k]
                        due[name] = time.perf_counter() + s.gaps[k]
                        turn_of[name] = k + 1
                        owed += round(work.noisy_rps * s.gaps[k])
            if not busy:
                time.sleep(IDLE_SLEEP_S)
        unfinished = sorted(due) + ([agent[1]] if agent else [])
        while engine.has_unfinished():  # what is still in flight finishes (not counted)
            engine.step()
        return turns, noisy_sent, unfinished

    @staticmethod
    def turn(out: RequestOutput, session: str, k: int, late: float, cores: float) -> Turn:
        assert out.metrics.ttft_s is not None
        return Turn(session, k, len(out.prompt_token_ids), digest(out.prompt_token_ids),
                    str(out.residency), out.metrics.ttft_s, out.num_restored_tokens,
                    out.num_recomputed_tokens, out.num_cached_tokens, out.retention,
                    late, cores, out.token_ids)


def gib(blocks: int, block_bytes: int) -> float:
    """GiB holding `blocks` blocks (half a block spare against rounding down)."""
    return (blocks + 0.5) * block_bytes / GIB


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def print_rows(title: str, results: list[dict[str, Any]]) -> list[str]:
    """The table of one experiment; returns its flags."""
    flags: list[str] = []
    print(title)
    print(f"{'mode':<20} {'residency':<11} {'n':>4} {'TTFT p50 ms':>11} {'p99 ms':>8} "
          f"{'prompt':>6} {'device':>6} {'restored':>8} {'recomputed':>10}")
    for r in results:
        for res, row in r["rows"].items():
            print(f"{r['mode']:<20} {res:<11} {row['n']:>4} {fmt_ms(row['ttft_p50_s']):>11} "
                  f"{fmt_ms(row['ttft_p99_s']):>8} {row['prompt_tokens_p50']:>6.0f} "
                  f"{row['device_p50']:>6.0f} {row['restored_p50']:>8.0f} "
                  f"{row['recomputed_p50']:>10.0f}")
        counts = ", ".join(f"{k} {v['n']}" for k, v in r["rows"].items() if k != "all")
        eq = r["exactness"]
        print(f"{'':<20} {r['noisy_prompts']} noisy prompts, {r['wall_s']:.0f}s, cores "
              f"{r['cores']:.2f}, load {r['load_avg_1m']:.1f}; residency "
              f"{counts}; tokens equal to {results[0]['mode']}: {eq['equal_tokens']}/"
              f"{eq['same_prompt']} same-prompt turns (of {eq['turns']})")
        if eq["equal_tokens"] != eq["same_prompt"]:
            flags.append(f"{r['mode']}: {eq['same_prompt'] - eq['equal_tokens']} turns with "
                         f"the same prompt as {results[0]['mode']} got other tokens")
        if any(r["empty_replies"].values()):
            flags.append(f"{r['mode']}: empty replies {r['empty_replies']}")
        slow = [t for t in r["turns"] if t["residency"] not in ("disk", "remote")
                and t["cores"] < CORES_SHARE * torch.get_num_threads()]
        if slow:
            flags.append(f"{r['mode']}: {len(slow)} of {len(r['turns'])} turns were served "
                         f"with < {CORES_SHARE * torch.get_num_threads():.1f} cores busy in "
                         "this process (machine shared? their TTFTs are inflated)")
        if r["cores"] < CORES_SHARE * torch.get_num_threads():
            flags.append(f"{r['mode']}: this process kept only {r['cores']:.2f} of "
                         f"{torch.get_num_threads()} cores busy over the run (load average "
                         f"{r['load_avg_1m']:.1f}): the machine was shared, TTFTs inflated")
        if r["unfinished"]:
            flags.append(f"{r['mode']}: sessions cut by --max-run-s: {r['unfinished']}")
    return flags


def tenant_line(r: dict[str, Any], tenant: str) -> str:
    t = r["tenants"].get(tenant) or {}
    held, kept, ev = t.get("held", {}), t.get("retained", {}), t.get("evictions", {})
    refused = t.get("retention_refused", {})
    return (f"{tenant}: held host/disk {held.get('host', 0)}/{held.get('disk', 0)}, retained "
            f"{kept.get('host', 0)}/{kept.get('disk', 0)}, evicted {ev.get('host', 0)}/"
            f"{ev.get('disk', 0)} blocks; retentions granted {t.get('retention_granted', 0)}"
            f", refused {dict(refused) or 0}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload (~2 minutes)")
    for name, (default, quick) in SIZES.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None,
                        help=f"default {default}, --quick {quick}")
    ap.add_argument("--reply-tokens", type=int, default=4, help="greedy tokens per turn")
    ap.add_argument("--noisy-tokens", type=int, default=384, help="tokens per noisy prompt")
    ap.add_argument("--noisy-rps", type=float, default=1.5,
                    help="noisy prompts per second of every agent gap (sent before the next "
                    "turn)")
    ap.add_argument("--flood-rps", type=float, default=4.0,
                    help="the same in the noisy-neighbour run (per second of a victim's gap)")
    ap.add_argument("--host-share", type=float, default=0.75,
                    help="host tier = this share of the agents' distinct blocks")
    ap.add_argument("--disk-share", type=float, default=1.2,
                    help="disk tier = this share of the agents' distinct blocks")
    ap.add_argument("--retention-s", type=float, default=900.0)
    ap.add_argument("--max-run-s", type=float, default=300.0,
                    help="a replay stops after this long (its cut sessions are flagged)")
    ap.add_argument("--dir", default=".", help="where the disk tier's temp dir is made")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name, (default, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    if args.turns < 2 or args.victim_turns < 2:
        ap.error("--turns and --victim-turns must be >= 2 (a turn after a gap)")

    started = time.perf_counter()
    loaded = load_model(None)
    vocab = loaded.spec.vocab_size
    rng = random.Random(args.seed)
    system = tokens(rng, args.system, vocab)
    agents = Workload(AGENTS, sessions_of(
        rng, vocab, system, args.sessions, args.turns, args.first_user, args.tool_min,
        args.tool_max, args.gap_min, args.gap_max, "agent"), args.noisy_rps)
    victim_system = tokens(rng, args.victim_system, vocab)
    victim = Workload(VICTIM, sessions_of(
        rng, vocab, victim_system, args.victim_sessions, args.victim_turns, args.user_min,
        args.user_min, args.user_max, args.victim_gap_min, args.victim_gap_max, "victim"),
        args.flood_rps, pin=victim_system)

    probe = LLMEngine(EngineConfig.from_knobs(num_device_blocks=64), loaded=loaded)
    block_bytes = probe.runner.block_bytes
    probe.close()
    reply, noisy_blocks = args.reply_tokens, args.noisy_tokens // BLOCK + 1
    biggest = max(longest(s, reply) for w in (agents, victim) for s in w.sessions)
    device = biggest // BLOCK + 1 + 2 * noisy_blocks
    agent_blocks = distinct_blocks(agents, args.system, reply)
    host = max(int(args.host_share * agent_blocks), biggest // BLOCK + 8)
    disk = max(int(args.disk_share * agent_blocks), host + noisy_blocks)
    agent_knobs = {"num_device_blocks": device, "batch_invariant": True,
                   "kv_offloading_size": gib(host, block_bytes),
                   "disk_kv_size": gib(disk, block_bytes)}
    # Noisy neighbour: room for all of the victim's blocks and two noisy prompts in each
    # tier; the quota leaves the noisy tenant those two prompts' worth.
    victim_blocks = distinct_blocks(victim, args.victim_system, reply)
    room = 2 * noisy_blocks
    victim_knobs = {"num_device_blocks": device, "batch_invariant": True,
                    "kv_offloading_size": gib(victim_blocks + room, block_bytes),
                    "disk_kv_size": gib(victim_blocks + 2 * room, block_bytes)}
    whole = {"host": gib(victim_blocks + room, block_bytes),
             "disk": gib(victim_blocks + 2 * room, block_bytes)}
    quota = {"kv_tenant_quota": {"host": gib(room, block_bytes),
                                 "disk": gib(room, block_bytes)},
             "kv_tenant_quotas": {VICTIM: whole}}

    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-agentic-", dir=args.dir)).resolve()
    replay = Replay(loaded, args, root)
    agent_modes = [Mode("no-hints"), Mode("retention", args.retention_s),
                   Mode("retention+prefetch", args.retention_s, expect_return=True)]
    victim_modes = [Mode("no-quota"), Mode("quota", knobs=quota)]
    try:
        agentic = []
        for mode in agent_modes:
            agentic.append(replay.run(agents, mode, agent_knobs))
            print(f"agentic {mode.name}: {agentic[-1]['wall_s']:.0f}s", flush=True)
        neighbour = []
        for mode in victim_modes:
            neighbour.append(replay.run(victim, mode, victim_knobs))
            print(f"noisy neighbour {mode.name}: {neighbour[-1]['wall_s']:.0f}s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for results in (agentic, neighbour):
        ref = [Turn(**t) for t in results[0]["turns"]]
        for r in results:
            r["exactness"] = exactness(ref, [Turn(**t) for t in r["turns"]])

    print()
    print(f"model {loaded.source}; torch threads {torch.get_num_threads()}; block "
          f"{block_bytes / 1e6:.2f} MB; device pool {device} blocks; noisy prompts "
          f"{args.noisy_tokens} tokens, {args.noisy_rps:g} per second of an agent's gap, "
          f"{args.flood_rps:g} of a victim's")
    print(f"agents: {args.sessions} sessions x {args.turns} turns, system prompt "
          f"{args.system}, tool results {args.tool_min}-{args.tool_max} tokens, gaps "
          f"{args.gap_min:g}-{args.gap_max:g} s, last turn <= "
          f"{max(longest(s, reply) for s in agents.sessions)} tokens; {agent_blocks} distinct "
          f"blocks; host {host} blocks, disk {disk}")
    print()
    flags = print_rows("agentic replay: TTFT of the turns after a tool call", agentic)
    for r in agentic:
        print(f"  {r['mode']:<20} {tenant_line(r, AGENTS)}; store refused "
              f"{r['store_refused']}")
    print()
    print(f"noisy neighbour: victim {args.victim_sessions} sessions x {args.victim_turns} "
          f"turns on a retained {args.victim_system}-token system prompt, user messages "
          f"{args.user_min}-{args.user_max} tokens, gaps {args.victim_gap_min:g}-"
          f"{args.victim_gap_max:g} s; tiers hold the victim's {victim_blocks} blocks + "
          f"{room} (host) / {2 * room} (disk); quota: {room} blocks per tenant, the victim "
          f"all")
    flags += print_rows("victim TTFT", neighbour)
    for r in neighbour:
        print(f"  {r['mode']:<20} {tenant_line(r, VICTIM)}")
        print(f"  {'':<20} {tenant_line(r, NOISY)}")
    wall = time.perf_counter() - started
    for flag in flags:
        print(f"FLAG {flag}")
    path = write_result("agentic", {
        "model": loaded.source, "quick": args.quick, "args": vars(args),
        "block_bytes": block_bytes, "device_blocks": device, "host_blocks": host,
        "disk_blocks": disk, "agent_distinct_blocks": agent_blocks,
        "victim_distinct_blocks": victim_blocks, "wall_s": wall, "flags": flags,
        "agentic": agentic, "noisy_neighbour": neighbour,
    }, args.out)
    print(f"wrote {path} ({wall:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
