"""A discrete-event simulation of a multi-turn trace on one serving replica, split by residency.

Primitives: `simulate(requests, model, hardware, kv_dtype) -> SimResult`. Pinned between
events: a device KV pool and a host tier (both LRU over whole sessions), one link (a FIFO
shared by restores and by the stores of evicted sessions) and one compute server (a FIFO
of prefills). Per turn of a session, at its arrival:

    resident    its KV is on the device: prefill the new tokens only
    host        its KV is in the host tier and the planner picks restore: wait for the link,
                copy it back, then prefill the new tokens
    recomputed  its KV was evicted everywhere (or the planner picked recompute): prefill the
                whole context again
    new         the session's first turn: prefill its prompt

Making room evicts the least recently used idle sessions to the host tier (a store on the
link, queued before the restore that needed the room). A turn that finds only busy sessions
to evict still runs: the pool overcommits rather than deadlocks. Prefill takes the planner's
`prefill_s` (linear + causal attention over the cached prefix), at least one memory-bound
forward (weights / HBM bandwidth). Decode is memory bound: each output token costs
(weights + the session's KV bytes) / HBM bandwidth, and runs beside prefills (continuous
batching), so it delays the session's next turn, not the server. On hardware with
`shared_compute` (a CPU) the server instead runs engine steps: each step takes every queued
prefill plus one row per decoding session and costs a fixed part (the measured cost of a
step, at least one weight stream) + their prefill time + rows x the measured cost of a row,
so a short prefill waits for the running step and shares it.
Deterministic: no clocks, no randomness; ties break by the order events were made.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from kvtier.errors import ConfigError
from kvtier.plan.analysis import (
    HOST_USABLE_FRACTION,
    pick_tensor_parallel,
    planner_for,
    usable_hbm_bytes,
)
from kvtier.plan.hardware import GIB, Hardware
from kvtier.plan.models import ModelShape
from kvtier.sequence import RESIDENCY_CLASSES
from kvtier.stats import percentile


class TurnRequest(Protocol):
    """One turn of a session, as `kvtier.bench.trace.TraceRequest` has it."""

    @property
    def session_id(self) -> Hashable: ...
    @property
    def turn(self) -> int: ...
    @property
    def arrival_s(self) -> float: ...  # turn 0: absolute; later: think time after the last
    @property
    def new_tokens(self) -> Sequence[int]: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True)
class SimRecord:
    session_id: Hashable
    turn: int
    residency: str
    arrival_s: float
    ttft_s: float
    context: int  # tokens of prior state the turn found (0 for a new session)
    link_wait_s: float  # time queued behind other transfers before its restore started
    finish_s: float  # last output token


@dataclass(frozen=True)
class SimResult:
    records: tuple[SimRecord, ...]
    ttft: dict[str, dict[str, float | int | None]]  # class -> count, p50, p99
    link_busy_s: float
    stores: int
    restores: int
    makespan_s: float

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft, "link_busy_s": self.link_busy_s, "stores": self.stores,
                "restores": self.restores, "makespan_s": self.makespan_s,
                "requests": [asdict(r) for r in self.records]}


class _Lru:
    """Sessions' KV bytes in recency order, bounded by bytes or by a count of sessions."""

    def __init__(self, capacity_bytes: float, max_sessions: int | None = None) -> None:
        self.capacity, self.max_sessions = capacity_bytes, max_sessions
        self.items: OrderedDict[Hashable, int] = OrderedDict()
        self.used = 0

    def put(self, key: Hashable, nbytes: int) -> None:
        """Insert as most recent (the key must not be present)."""
        self.items[key] = nbytes
        self.used += nbytes

    def pop(self, key: Hashable) -> int:
        nbytes = self.items.pop(key)
        self.used -= nbytes
        return nbytes

    def fits(self, nbytes: int) -> bool:
        if self.max_sessions is not None:
            return len(self.items) + 1 <= self.max_sessions
        return self.used + nbytes <= self.capacity

    def victims(self, nbytes: int, busy: set[Hashable]) -> list[Hashable]:
        """Idle sessions to drop, least recent first, until `nbytes` fits (or none are left)."""
        chosen: list[Hashable] = []
        used, count = self.used, len(self.items)
        for key, size in self.items.items():
            if self.max_sessions is not None:
                if count + 1 <= self.max_sessions:
                    break
            elif used + nbytes <= self.capacity:
                break
            if key not in busy:
                chosen.append(key)
                used, count = used - size, count - 1
        return chosen


@dataclass
class _Session:
    turns: list[TurnRequest]
    context: int = 0  # tokens of KV the session holds between turns
    next_turn: int = 0  # index into `turns` of the turn to arrive next
    where: str | None = None  # "device", "host" or None


@dataclass(frozen=True)
class _Admitted:
    """A turn between its arrival and its first token."""

    req: TurnRequest
    arrival_s: float
    residency: str
    context: int
    link_wait_s: float
    total_tokens: int  # the session's context once this turn's output is done
    prefill_s: float = 0.0  # the prefill's own compute, before the one-forward floor


class _Sim:
    """The event loop's state; one instance per `simulate` call."""

    def __init__(self, model: ModelShape, hardware: Hardware, kv_dtype: str,
                 device_sessions: int | None, mode: str) -> None:
        tp = pick_tensor_parallel(model, hardware)
        self.planner = planner_for(model, hardware, tp)
        self.per_token = model.kv_bytes_per_token(kv_dtype)
        self.link_bps = self.planner.calibration.link_gbps * 1e9
        self.wake_overhead_s = hardware.transfer_overhead_s
        self.hbm_bps = tp * hardware.hbm_gbps * 1e9
        self.weights = model.weights_bytes
        replicas = hardware.gpus // tp
        self.device = _Lru(usable_hbm_bytes(hardware, tp) - self.weights, device_sessions)
        self.host = _Lru(hardware.host_gib * GIB * HOST_USABLE_FRACTION / replicas)
        self.mode = mode
        self.events: list[tuple[float, int, str, Hashable, float]] = []
        self.seq = 0
        self.link_free = self.server_free = self.link_busy = 0.0
        self.stores = self.restores = 0
        self.busy: set[Hashable] = set()
        self.sessions: dict[Hashable, _Session] = {}
        self.pending: dict[Hashable, _Admitted] = {}
        self.records: list[SimRecord] = []
        self.shared = hardware.shared_compute
        self.step_fixed_s = hardware.step_fixed_s
        self.context_token_s = hardware.context_token_s
        # One decode row: measured where known, else one prefill token's worth.
        self.row_s = hardware.decode_row_s or 1 / self.planner.calibration.prefill_tokens_per_s
        self.prefill_queue: list[Hashable] = []
        self.in_step: list[Hashable] = []  # the prefills of the step now running
        self.deferred: list[tuple[Hashable, int, float]] = []  # restores awaiting a boundary
        self.decoding: dict[Hashable, int] = {}  # session -> output tokens still to come
        self.first_token: dict[Hashable, float] = {}
        self.stepping = False

    def push(self, t: float, kind: str, sid: Hashable, value: float = 0.0) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, sid, value))
        self.seq += 1

    def link(self, t: float, nbytes: int) -> tuple[float, float]:
        """Queue a copy on the FIFO link: (start, end)."""
        start = max(t, self.link_free)
        self.link_free = start + nbytes / self.link_bps
        self.link_busy += nbytes / self.link_bps
        return start, self.link_free

    def compute_s(self, tokens: int, cached: int) -> float:
        return max(self.planner.prefill_s(tokens, cached), self.weights / self.hbm_bps)

    def step_prefill_s(self, tokens: int, cached: int) -> float:
        """A prefill's share of a step; the measured per-context-token cost where known."""
        if self.context_token_s:
            return self.planner.prefill_s(tokens, 0) + cached * self.context_token_s
        return self.planner.prefill_s(tokens, cached)

    def make_room(self, t: float, nbytes: int) -> None:
        for victim in self.device.victims(nbytes, self.busy):
            size = self.device.pop(victim)
            state = self.sessions[victim]
            for dropped in self.host.victims(size, self.busy):
                self.host.pop(dropped)
                self.sessions[dropped].where = None
            if self.host.fits(size):
                self.link(t, size)
                self.stores += 1
                self.host.put(victim, size)
                state.where = "host"
            else:
                state.where = None

    def arrive(self, t: float, sid: Hashable) -> None:
        s = self.sessions[sid]
        req = s.turns[s.next_turn]
        s.next_turn += 1
        new, ctx = len(req.new_tokens), s.context
        held = ctx * self.per_token
        self.busy.add(sid)
        ready, wait = t, 0.0
        if s.where == "device":
            residency, tokens, cached = "resident", new, ctx
            self.device.pop(sid)
        elif s.where == "host" and self.planner.decide(ctx, held, self.mode).choice == "restore":
            self.host.pop(sid)
            residency, tokens, cached = "host", new, ctx
        else:
            if s.where == "host":
                self.host.pop(sid)
            residency, tokens, cached = ("recomputed" if ctx else "new"), ctx + new, 0
        work = self.compute_s(tokens, cached)
        total = (ctx + new + req.output_tokens) * self.per_token
        self.make_room(t, total)
        self.device.put(sid, total)
        s.where = "device"
        self.pending[sid] = _Admitted(req, t, residency, ctx, wait,
                                      ctx + new + req.output_tokens,
                                      self.step_prefill_s(tokens, cached))
        if residency != "host":
            self.push(ready, "ready", sid, work)
        elif self.shared and self.stepping:
            # The engine admits between steps: the restore starts when the running step
            # ends, and the woken turn computes in the step after its load lands.
            self.deferred.append((sid, held, work))
        else:
            self.restore(t, sid, held, work)

    def restore(self, t: float, sid: Hashable, held: int, work: float) -> None:
        start, end = self.link(t, held)
        self.restores += 1
        p = self.pending[sid]
        self.pending[sid] = replace(p, link_wait_s=start - p.arrival_s)
        self.push(end + self.wake_overhead_s, "ready", sid, work)

    def ready(self, t: float, sid: Hashable, work: float) -> None:
        if self.shared:
            self.prefill_queue.append(sid)
            self.start_step(t)
            return
        p = self.pending[sid]
        start = max(t, self.server_free)
        self.server_free = first = start + work
        step = (self.weights + p.total_tokens * self.per_token) / self.hbm_bps
        finish = first + p.req.output_tokens * step
        self.records.append(SimRecord(sid, p.req.turn, p.residency, p.arrival_s,
                                      first - p.arrival_s, p.context, p.link_wait_s, finish))
        self.push(finish, "finish", sid)

    def start_step(self, t: float) -> None:
        """Shared compute: one engine step over every queued prefill and every decode row."""
        if self.stepping or not (self.prefill_queue or self.decoding):
            return
        self.in_step, self.prefill_queue = self.prefill_queue, []  # later arrivals wait
        prefill = sum(self.pending[sid].prefill_s for sid in self.in_step)
        fixed = max(self.weights / self.hbm_bps, self.step_fixed_s)
        cost = fixed + prefill + len(self.decoding) * self.row_s
        self.stepping = True
        self.push(t + cost, "step", None)

    def step_end(self, t: float) -> None:
        self.stepping = False
        for sid, held, work in self.deferred:
            self.restore(t, sid, held, work)
        self.deferred = []
        done: list[Hashable] = []
        for sid in list(self.decoding):
            self.decoding[sid] -= 1
            if self.decoding[sid] <= 0:
                del self.decoding[sid]
                done.append(sid)
        for sid in self.in_step:
            self.first_token[sid] = t
            if self.pending[sid].req.output_tokens > 1:
                self.decoding[sid] = self.pending[sid].req.output_tokens - 1
            else:
                done.append(sid)
        self.in_step = []
        for sid in done:
            p = self.pending[sid]
            first = self.first_token.pop(sid)
            self.records.append(SimRecord(sid, p.req.turn, p.residency, p.arrival_s,
                                          first - p.arrival_s, p.context, p.link_wait_s, t))
            self.finish(t, sid)
        self.start_step(t)

    def finish(self, t: float, sid: Hashable) -> None:
        s, p = self.sessions[sid], self.pending.pop(sid)
        s.context = p.total_tokens
        self.busy.discard(sid)
        if s.next_turn < len(s.turns):
            self.push(t + max(0.0, s.turns[s.next_turn].arrival_s), "arrive", sid)


def simulate(requests: Sequence[TurnRequest], model: ModelShape, hardware: Hardware,
             kv_dtype: str = "fp16", device_sessions: int | None = None, mode: str = "auto"
             ) -> SimResult:
    """Replay `requests` (every turn of every session) and report TTFT per residency class.

    `device_sessions` bounds the device pool by a count of sessions instead of HBM bytes;
    `mode` is the engine's preemption_mode (auto | swap | recompute) handed to the planner.
    """
    if mode not in ("auto", "swap", "recompute"):
        raise ConfigError(f"mode={mode!r}; choose auto, swap or recompute")
    if device_sessions is not None and device_sessions < 1:
        raise ConfigError(f"device_sessions={device_sessions} must be >= 1 (or None for HBM)")
    sim = _Sim(model, hardware, kv_dtype, device_sessions, mode)
    for req in requests:
        sim.sessions.setdefault(req.session_id, _Session([])).turns.append(req)
    for sid, s in sim.sessions.items():
        s.turns.sort(key=lambda r: r.turn)
        sim.push(max(0.0, s.turns[0].arrival_s), "arrive", sid)
    while sim.events:
        t, _, kind, sid, value = heapq.heappop(sim.events)
        if kind == "arrive":
            sim.arrive(t, sid)
        elif kind == "ready":
            sim.ready(t, sid, value)
        elif kind == "step":
            sim.step_end(t)
        else:
            sim.finish(t, sid)
    ttft: dict[str, dict[str, float | int | None]] = {}
    for cls in ("all", *RESIDENCY_CLASSES):
        values = [r.ttft_s for r in sim.records if cls in ("all", r.residency)]
        ttft[cls] = {"count": len(values), "p50": percentile(values, 50),
                     "p99": percentile(values, 99)}
    return SimResult(
        records=tuple(sim.records), ttft=ttft, link_busy_s=sim.link_busy, stores=sim.stores,
        restores=sim.restores, makespan_s=max((r.finish_s for r in sim.records), default=0.0),
    )
