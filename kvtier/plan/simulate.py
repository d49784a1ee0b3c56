"""A discrete-event simulation of a multi-turn trace on one serving replica, split by residency.

Primitives: `simulate(requests, model, hardware, kv_dtype, SimConfig) -> SimResult`. Pinned
between events: a device KV pool and a host tier (both LRU over whole sessions), the link
(full duplex, as PCIe is: restores queue FIFO host -> device, at most `max_load_gbps`; stores
of evicted sessions queue FIFO device -> host) and the engine, which runs steps.
Per turn of a session, at its arrival:

    resident    its KV is on the device: prefill the new tokens only
    host        its KV is in the host tier and `load_policy` picks restore: wait for the
                link, copy it back, then prefill the new tokens
    recomputed  its KV was evicted everywhere (or `load_policy` declined the restore, the
                reason counted): prefill the whole context again
    new         the session's first turn: prefill its prompt

The restore-or-recompute verdict is the engine's own code (`LoadPolicy.decide`), given what
queues ahead of the turn as the engine counts it: loads not landed and their whole bytes
(the engine does not see a load's progress), and prefill tokens admitted and not computed.
Making room evicts the least recently used idle sessions to the host tier; a restore into
that room starts once their stores are out. A turn is admitted, first come first served,
only when the running sessions leave room for it (idle ones can always be evicted) and fewer
than `max_num_seqs` run, as the engine waits for device blocks; a turn too large for any
room runs alone rather than deadlock. With `clients` the load is a closed loop (a
benchmark's max concurrency): at most that many turns are sent and unfinished, the next
waits for one to end and its TTFT counts from when it is sent. With `idle_offload_s` a
session idle that long moves to the host tier (a store) even without pressure, as the
engine's knob does.

The engine runs one step at a time, as vLLM's and kvtier's schedulers do: a step takes the
ready prefills first come first served by admission (a turn whose restore is in flight
keeps its place, as vLLM's waiting-for-KV requests do), chunked at `max_num_batched_tokens`,
and gives one output token to every decoding session; a turn that becomes ready waits for
the running step. A prefill chunk costs the planner's `prefill_s` (linear + causal
attention over what is already cached). On a GPU a step costs the larger of its prefill
compute and one read of the weights and the running sessions' KV from HBM (decode is
memory bound); on hardware with `shared_compute` (a CPU) it costs a fixed part (the measured
cost of a step, at least one weight stream) + its prefill + rows x the measured cost of a
row.

Each TTFT splits as `kvtier bench` measures it: queue (arrival -> admitted, plus the wait
for the step that takes its first chunk once the turn is ready), tier (admitted -> prior
state ready: link wait + transfer + wake overhead of a restore) and compute (the prefill,
in steps shared with others, up to the first token). A recomputed turn's tier part is
the prefill of its prior context alone, `prefill_s(context, 0)`: the cost model is additive,
so what is left is what its new tokens cost on that prefix.
Deterministic: no clocks, no randomness; ties break by the order events were made.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvtier.config import PreemptionMode
from kvtier.errors import ConfigError
from kvtier.plan.analysis import (
    HOST_USABLE_FRACTION,
    pick_tensor_parallel,
    planner_for,
    usable_hbm_bytes,
)
from kvtier.plan.hardware import GIB, Hardware
from kvtier.plan.models import ModelShape
from kvtier.plan.session_lru import SessionLru
from kvtier.plan.simrecords import SimRecord, SimResult, SimTurn, TurnRequest, summarize
from kvtier.tier import Ahead, LoadPolicy, Residency

__all__ = ["SimConfig", "SimRecord", "SimResult", "SimTurn", "TurnRequest", "simulate"]



@dataclass(frozen=True)
class SimConfig:
    """The serving knobs a simulation runs under, named as the engine's and vLLM's."""

    device_sessions: int | None = None  # the device pool holds N sessions (None: HBM bytes)
    # swap | recompute force every wake's side; auto: load_policy decides
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    idle_offload_s: float = 0.0  # demote sessions idle this long (0: only under pressure)
    load_policy: LoadPolicy = field(default_factory=LoadPolicy)  # restore or recompute a
    # session found on host: the engine's own rule
    max_load_gbps: float | None = None  # cap on host -> device restores, GB/s (None: link)
    max_num_seqs: int | None = None  # turns running at once (None: only the pool bounds it)
    # prefill tokens one engine step takes (chunked prefill; None: every ready prefill whole)
    max_num_batched_tokens: int | None = None
    clients: int | None = None  # closed loop: turns sent and unfinished (None: open loop)

    def __post_init__(self) -> None:
        """A mode given as the user's string becomes the enum here, once."""
        try:
            object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        except ValueError:
            raise ConfigError(f"preemption_mode={self.preemption_mode!r}; choose "
                              "auto, swap or recompute") from None

    def check(self) -> None:
        """ConfigError naming the knob and the value."""
        if not isinstance(self.load_policy, LoadPolicy):
            raise ConfigError(f"load_policy={self.load_policy!r}: parse it first "
                              "(LoadPolicy.parse)")
        for name in ("device_sessions", "max_num_seqs", "max_num_batched_tokens", "clients"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1 (or unset)")
        if not (isinstance(self.idle_offload_s, (int, float)) and self.idle_offload_s >= 0):
            raise ConfigError(f"idle_offload_s={self.idle_offload_s!r} must be >= 0 (0 = off)")
        cap = self.max_load_gbps
        if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < float("inf")):
            raise ConfigError(f"max_load_gbps={cap!r} must be a number of GB/s > 0 (or unset)")


@dataclass
class _Session:
    turns: list[TurnRequest]
    context: int = 0  # tokens of KV the session holds between turns
    next_turn: int = 0  # index into `turns` of the turn to arrive next
    where: str | None = None  # "device", "host" or None
    last_finish: float = -1.0  # when its last turn ended: an idle demotion's ticket


@dataclass
class _Admitted:
    """A turn between its arrival and its first token, with the instants its split needs."""

    req: TurnRequest
    arrival_s: float
    residency: Residency
    context: int
    total_tokens: int  # the session's context once this turn's output is done
    order: int = 0  # admission order: a step takes ready prefills first come first served
    prefill_left: int = 0  # tokens of its prefill no step has taken yet
    prefill_done: int = 0  # tokens in its cache before the next chunk (attention's reach)
    recompute_share_s: float = 0.0  # of that, rebuilding the prior context (tier time)
    admitted_s: float = 0.0  # its restore could start (a running step deferred it)
    link_wait_s: float = 0.0
    ready_s: float = 0.0  # its prior state is in place: it may be computed
    start_s: float = 0.0  # a step took its first chunk
    started: bool = False


class _Sim:
    """The event loop's state; one instance per `simulate` call."""

    def __init__(self, model: ModelShape, hardware: Hardware, kv_dtype: str,
                 config: SimConfig) -> None:
        tp = pick_tensor_parallel(model, hardware)
        self.planner = planner_for(model, hardware, tp)
        calibration = self.planner.calibration
        self.store_bps = calibration.link_gbps * 1e9  # device -> host, never capped
        if config.max_load_gbps is not None:  # the engine plans its restores at the cap
            calibration.link_gbps = min(calibration.link_gbps, config.max_load_gbps)
        self.load_bps = calibration.link_gbps * 1e9
        self.per_token = model.kv_bytes_per_token(kv_dtype)
        self.config = config
        self.wake_overhead_s = hardware.transfer_overhead_s
        self.hbm_bps = tp * hardware.hbm_gbps * 1e9
        self.weights = model.weights_bytes
        replicas = hardware.gpus // tp
        self.device = SessionLru(usable_hbm_bytes(hardware, tp) - self.weights,
                                 config.device_sessions)
        self.host = SessionLru(hardware.host_gib * GIB * HOST_USABLE_FRACTION / replicas)
        self.idle_offload_s = config.idle_offload_s
        self.events: list[tuple[float, int, str, Hashable, float]] = []
        self.seq = 0
        self.up_free = self.down_free = 0.0  # the link's two FIFOs: free from then on
        self.link_busy = self.compute_busy = 0.0
        self.landing: list[tuple[float, int]] = []  # restores not landed: (end, bytes)
        self.uncomputed: dict[Hashable, int] = {}  # admitted turns' prefill tokens, not run
        self.declined: dict[str, int] = {}  # turns whose restore was declined, by reason
        self.sent = 0  # turns sent and unfinished (bounded by `clients`)
        self.held_back: deque[Hashable] = deque()  # turns due, waiting for a client
        self.stores = self.restores = self.idle_demotions = 0
        self.busy: set[Hashable] = set()
        self.waiting: deque[tuple[Hashable, float]] = deque()  # turns sent, not yet admitted
        self.sessions: dict[Hashable, _Session] = {}
        self.pending: dict[Hashable, _Admitted] = {}
        self.records: list[SimRecord] = []
        self.shared = hardware.shared_compute
        self.step_fixed_s = hardware.step_fixed_s
        self.context_token_s = hardware.context_token_s
        # One decode row: measured where known, else one prefill token's worth.
        self.row_s = hardware.decode_row_s or 1 / self.planner.calibration.prefill_tokens_per_s
        self.admitted = 0  # turns admitted so far: each one's `order`
        self.prefill_queue: list[Hashable] = []  # ready turns with prefill left
        self.in_step: list[tuple[Hashable, int]] = []  # the step now running: (turn, chunk)
        # restores awaiting a step boundary: session, bytes, when their room is out
        self.deferred: list[tuple[Hashable, int, float]] = []
        self.decoding: dict[Hashable, int] = {}  # session -> output tokens still to come
        self.first_token: dict[Hashable, float] = {}
        self.stepping = False

    def push(self, t: float, kind: str, sid: Hashable, value: float = 0.0) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, sid, value))
        self.seq += 1

    def store(self, t: float, nbytes: int) -> float:
        """Queue a store on the device -> host FIFO: when it is out."""
        self.down_free = max(t, self.down_free) + nbytes / self.store_bps
        return self.down_free

    def load(self, t: float, nbytes: int) -> tuple[float, float]:
        """Queue a restore on the host -> device FIFO, at most `max_load_gbps`: (start, end)."""
        start = max(t, self.up_free)
        self.up_free = start + nbytes / self.load_bps
        self.link_busy += nbytes / self.load_bps
        return start, self.up_free

    def ahead(self, t: float) -> Ahead:
        """What a restore decided at `t` queues behind, as the engine counts it."""
        while self.landing and self.landing[0][0] <= t:
            heapq.heappop(self.landing)
        return Ahead(loads=len(self.landing), link_bytes=sum(n for _, n in self.landing),
                     compute_tokens=sum(self.uncomputed.values()))

    def restores_now(self, t: float, context: int, nbytes: int) -> bool:
        """The engine's verdict on a session found on host: restore (True) or recompute,
        a declined restore counted by its reason."""
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode is PreemptionMode.SWAP
        _, reason = self.config.load_policy.decide(self.planner, context, nbytes,
                                                   self.ahead(t))
        if reason is not None:
            self.declined[reason.value] = self.declined.get(reason.value, 0) + 1
        return reason is None

    def chunk_s(self, tokens: int, cached: int) -> float:
        """A prefill chunk's share of a step; the measured per-context-token cost where known."""
        if self.context_token_s:
            return self.planner.prefill_s(tokens, 0) + cached * self.context_token_s
        return self.planner.prefill_s(tokens, cached)

    def to_host(self, t: float, sid: Hashable, size: int) -> None:
        """Store a session leaving the device, dropping idle host sessions to fit it."""
        for dropped in self.host.victims(size, self.busy):
            self.host.pop(dropped)
            self.sessions[dropped].where = None
        if self.host.fits(size):
            self.store(t, size)
            self.stores += 1
            self.host.put(sid, size)
            self.sessions[sid].where = "host"
        else:
            self.sessions[sid].where = None

    def make_room(self, t: float, nbytes: int) -> float:
        """Evict idle sessions until `nbytes` fit: when the stores that freed it are out."""
        out = t
        for victim in self.device.victims(nbytes, self.busy):
            self.to_host(t, victim, self.device.pop(victim))
            out = max(out, self.down_free)
        return out

    def idle(self, t: float, sid: Hashable, since: float) -> None:
        """`idle_offload_s` after a turn ended: demote the session if it is still idle there
        and the host tier can hold it (the engine keeps the device copy otherwise)."""
        s = self.sessions[sid]
        if sid in self.busy or s.where != "device" or s.last_finish != since:
            return
        size = self.device.items[sid]
        if size > self.host.capacity:
            return
        self.device.pop(sid)
        self.to_host(t, sid, size)
        self.idle_demotions += 1

    def arrive(self, t: float, sid: Hashable) -> None:
        """A turn is due: sent if a client is free (else it waits for one), then it waits,
        first come first served, until the device has room."""
        if self.config.clients is not None and self.sent >= self.config.clients:
            self.held_back.append(sid)
            return
        self.sent += 1
        self.sessions[sid].next_turn += 1
        self.waiting.append((sid, t))
        self.admit_waiting(t)

    def admit_waiting(self, t: float) -> None:
        """Admit waiting turns in order while the running sessions leave room for the next
        (idle sessions can always be evicted); a turn that no room could hold runs alone."""
        while self.waiting:
            sid, arrival = self.waiting[0]
            need = self.tokens_after_turn(sid) * self.per_token
            if self.busy and not self.device.room_beside(need, self.busy):
                return
            cap = self.config.max_num_seqs
            if cap is not None and len(self.busy) >= cap:
                return
            self.waiting.popleft()
            self.admit(t, sid, arrival)

    def tokens_after_turn(self, sid: Hashable) -> int:
        """The session's context once its current turn's output is done."""
        s = self.sessions[sid]
        req = s.turns[s.next_turn - 1]
        return s.context + len(req.new_tokens) + req.output_tokens

    def admit(self, t: float, sid: Hashable, arrival: float) -> None:
        s = self.sessions[sid]
        req = s.turns[s.next_turn - 1]
        new, ctx = len(req.new_tokens), s.context
        held = ctx * self.per_token
        self.busy.add(sid)
        if s.where == "device":
            residency, tokens, cached = Residency.RESIDENT, new, ctx
            self.device.pop(sid)
        elif s.where == "host" and self.restores_now(t, ctx, held):
            self.host.pop(sid)
            residency, tokens, cached = Residency.HOST, new, ctx
        else:
            if s.where == "host":
                self.host.pop(sid)
            residency, tokens, cached = Residency.RECOMPUTED if ctx else Residency.NEW, ctx + new, 0
        after = self.tokens_after_turn(sid)
        total = after * self.per_token
        room_at = self.make_room(t, total)
        self.device.put(sid, total)
        s.where = "device"
        self.uncomputed[sid] = tokens
        share = self.planner.prefill_s(ctx, 0) if residency is Residency.RECOMPUTED else 0.0
        self.admitted += 1
        self.pending[sid] = _Admitted(req, arrival, residency, ctx, after, self.admitted,
                                      tokens, cached, share, t)
        if residency is not Residency.HOST:
            self.push(t, "ready", sid)
        elif self.shared and self.stepping:
            # kvtier's engine admits between steps: the restore starts when the running step
            # ends, and the woken turn computes in the step after its load lands.
            self.deferred.append((sid, held, room_at))
        else:
            self.restore(t, sid, held, room_at)

    def restore(self, t: float, sid: Hashable, held: int, room_at: float) -> None:
        """Load `held` bytes once the room made for them is out and the link is free."""
        start, end = self.load(max(t, room_at), held)
        heapq.heappush(self.landing, (end, held))
        self.restores += 1
        p = self.pending[sid]
        p.admitted_s, p.link_wait_s = t, start - t
        self.push(end + self.wake_overhead_s, "ready", sid)

    def ready(self, t: float, sid: Hashable) -> None:
        """Its prior state is in place: its prefill queues for the next step."""
        self.pending[sid].ready_s = t
        self.prefill_queue.append(sid)
        self.start_step(t)

    def record(self, sid: Hashable, first: float, finish: float) -> SimRecord:
        """The turn's record: its TTFT split at the instants its `_Admitted` noted."""
        p = self.pending[sid]
        share = p.recompute_share_s
        return SimRecord(
            session_id=sid, turn=p.req.turn, residency=p.residency, arrival_s=p.arrival_s,
            ttft_s=first - p.arrival_s, context=p.context, link_wait_s=p.link_wait_s,
            finish_s=finish, queue_s=(p.admitted_s - p.arrival_s) + (p.start_s - p.ready_s),
            tier_s=(p.ready_s - p.admitted_s) + share, compute_s=(first - p.start_s) - share)

    def start_step(self, t: float) -> None:
        """One engine step: ready prefills first come first served (chunked at
        `max_num_batched_tokens`) and one token for every decoding session. A CPU pays a
        fixed part, the prefill and a cost per decode row; a GPU the larger of the prefill's
        compute and one read of the weights and the running sessions' KV."""
        if self.stepping or not (self.prefill_queue or self.decoding):
            return
        budget = self.config.max_num_batched_tokens or (1 << 62)
        self.prefill_queue.sort(key=lambda sid: self.pending[sid].order)
        prefill = 0.0
        for sid in self.prefill_queue:  # later arrivals wait for the next step
            if budget <= 0:
                break
            p = self.pending[sid]
            chunk = min(p.prefill_left, budget)
            budget -= chunk
            if not p.started:  # its first chunk
                p.started, p.start_s = True, t
            prefill += self.chunk_s(chunk, p.prefill_done)
            self.in_step.append((sid, chunk))
        if self.shared:
            fixed = max(self.weights / self.hbm_bps, self.step_fixed_s)
            cost = fixed + prefill + len(self.decoding) * self.row_s
        else:
            running = sum(self.pending[sid].total_tokens for sid in self.decoding)
            cost = max(prefill, (self.weights + running * self.per_token) / self.hbm_bps)
        self.compute_busy += cost
        self.stepping = True
        self.push(t + cost, "step", None)

    def step_end(self, t: float) -> None:
        self.stepping = False
        for sid, held, room_at in self.deferred:
            self.restore(t, sid, held, room_at)
        self.deferred = []
        done: list[Hashable] = []
        for sid in list(self.decoding):
            self.decoding[sid] -= 1
            if self.decoding[sid] <= 0:
                del self.decoding[sid]
                done.append(sid)
        for sid, chunk in self.in_step:
            p = self.pending[sid]
            p.prefill_left -= chunk
            p.prefill_done += chunk
            self.uncomputed[sid] -= chunk
            if p.prefill_left > 0:
                continue
            self.prefill_queue.remove(sid)
            self.first_token[sid] = t
            del self.uncomputed[sid]
            if p.req.output_tokens > 1:
                self.decoding[sid] = p.req.output_tokens - 1
            else:
                done.append(sid)
        self.in_step = []
        for sid in done:
            self.records.append(self.record(sid, self.first_token.pop(sid), t))
            self.finish(t, sid)
        self.start_step(t)

    def finish(self, t: float, sid: Hashable) -> None:
        s, p = self.sessions[sid], self.pending.pop(sid)
        s.context = p.total_tokens
        s.last_finish = t
        self.busy.discard(sid)
        self.sent -= 1
        if self.held_back:  # a client is free: it sends the turn that waited longest
            self.arrive(t, self.held_back.popleft())
        self.admit_waiting(t)
        if self.idle_offload_s > 0:
            self.push(t + self.idle_offload_s, "idle", sid, t)
        if s.next_turn < len(s.turns):
            self.push(t + max(0.0, s.turns[s.next_turn].arrival_s), "arrive", sid)

    def run(self) -> None:
        """Pop events in time order until none are left."""
        while self.events:
            t, _, kind, sid, value = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(t, sid)
            elif kind == "ready":
                self.ready(t, sid)
            elif kind == "step":
                self.step_end(t)
            elif kind == "idle":
                self.idle(t, sid, value)
            else:
                self.finish(t, sid)


def simulate(requests: Sequence[TurnRequest], model: ModelShape, hardware: Hardware,
             kv_dtype: str = "fp16", config: SimConfig = SimConfig()) -> SimResult:
    """Replay `requests` (every turn of every session) under `config` and report TTFT per
    residency class; ConfigError on a bad knob."""
    config.check()
    sim = _Sim(model, hardware, kv_dtype, config)
    for req in requests:
        sim.sessions.setdefault(req.session_id, _Session([])).turns.append(req)
    for sid, s in sim.sessions.items():
        s.turns.sort(key=lambda r: r.turn)
        sim.push(max(0.0, s.turns[0].arrival_s), "arrive", sid)
    sim.run()
    return summarize(sim.records, sim.link_busy, sim.stores, sim.restores, sim.compute_busy,
                     sim.idle_demotions, sim.declined)
