"""Drive the engine with a multi-turn trace, in real time, idle gaps included.

Each configuration replays the same trace on a fresh engine: sessions arrive at their
times, every turn sends the whole conversation so far plus the new user message, and the
next turn is sent only after the previous answer finished and the think time passed. While
no request is in flight the engine still steps, so idle sessions demote as they would in a
server. Per request it records TTFT, inter-token latency and where the state lived.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.errors import RequestError
from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams
from kvtier.tier import Residency

IDLE_TICK_S = 0.05  # how often an idle engine steps (demotion, transfer completion)
SAMPLE_S = 0.25  # link-utilisation timeline resolution


@dataclass
class ConfigRun:
    name: str
    knobs: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    link_timeline: list[dict[str, float]] = field(default_factory=list)
    wall_s: float = 0.0
    # requests the server refused: {"request": "sid/turn", "reason": ..., "prompt_tokens": n}
    rejected: list[dict[str, Any]] = field(default_factory=list)


class _LinkSampler:
    """Busy fraction of each direction of the host link per sampling interval."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.last_t = 0.0
        self.last = (0.0, 0.0)
        self.host_peak = 0

    def sample(self, t: float, out: list[dict[str, float]]) -> None:
        tier = self.engine.tier
        if not tier.enabled or t - self.last_t < SAMPLE_S:
            return
        s = tier.worker_report().link
        busy = (s.store.busy_s, s.load.busy_s)
        dt = t - self.last_t
        out.append({"t": t, "store_util": (busy[0] - self.last[0]) / dt,
                    "load_util": (busy[1] - self.last[1]) / dt})
        self.host_peak = max(self.host_peak, tier.report().host.used)
        self.last_t, self.last = t, busy


def run_config(loaded: LoadedModel, trace: Any, name: str, knobs: dict[str, Any],
               on_request: Callable[[], None] | None = None) -> ConfigRun:
    """Replay `trace` on a fresh engine built from `knobs`; one record per request."""
    run = ConfigRun(name, dict(knobs))
    engine = LLMEngine(EngineConfig.from_knobs(model=loaded.source, **knobs), loaded=loaded)
    sampler = _LinkSampler(engine)
    log = RequestLog()
    sessions = trace.sessions()
    due: list[tuple[float, str, int]] = [(reqs[0].arrival_s, sid, 0)
                                         for sid, reqs in sessions.items()]
    heapq.heapify(due)
    history: dict[str, list[int]] = {sid: [] for sid in sessions}
    in_flight: dict[str, tuple[str, int, float, int]] = {}
    start = time.perf_counter()
    try:
        while due or in_flight:
            now = time.perf_counter() - start
            while due and due[0][0] <= now:
                _, sid, turn = heapq.heappop(due)
                req = sessions[sid][turn]
                prompt = history[sid] + list(req.new_tokens)
                params = SamplingParams(max_tokens=req.output_tokens, temperature=0.0,
                                        ignore_eos=True)
                try:
                    rid = engine.add_request(prompt, params, request_id=f"{sid}/{turn}")
                except RequestError as e:  # e.g. the conversation outgrew the context
                    run.rejected.append({"request": f"{sid}/{turn}", "reason": str(e),
                                         "prompt_tokens": len(prompt)})
                    continue  # the session ends here, as a client would give up

                in_flight[rid] = (sid, turn, now, len(req.new_tokens))
                history[sid] = prompt
            if not in_flight:
                engine.step()  # idle: let demotion and transfers progress
                sampler.sample(time.perf_counter() - start, run.link_timeline)
                wait = due[0][0] - (time.perf_counter() - start) if due else 0.0
                time.sleep(min(max(wait, 0.0), IDLE_TICK_S))
                continue
            outputs = engine.step()
            t = time.perf_counter() - start
            sampler.sample(t, run.link_timeline)
            log.add(outputs)
            for out in outputs:
                sid, turn, sent, new = in_flight.pop(out.request_id)
                history[sid] = history[sid] + out.token_ids
                run.records.append(_record(name, sid, turn, sent, t, new, out))
                if turn + 1 < len(sessions[sid]):
                    heapq.heappush(due, (t + sessions[sid][turn + 1].arrival_s, sid, turn + 1))
                if on_request is not None:
                    on_request()
        run.wall_s = time.perf_counter() - start
        run.engine = engine_stats(engine, log)
        run.engine["host_peak_slots"] = sampler.host_peak
        run.engine["rejected_requests"] = len(run.rejected)
        run.engine["max_model_len"] = engine.max_model_len
    finally:
        engine.close()
    return run


def session_residency(residency: str, turn: int) -> str:
    """An engine's "new" on a session's later turn means no tier still held its earlier
    turns (tier off, or evicted everywhere): its state existed and was computed again.
    `residency` is a `Residency`, or the label another server reported; a record's label."""
    if residency == Residency.NEW and turn > 0:
        return Residency.RECOMPUTED.value
    return str(residency)


def _record(config: str, sid: str, turn: int, sent: float, finished: float, new: int,
            out: Any) -> dict[str, Any]:
    n = len(out.token_ids)
    decode = out.metrics.decode_s
    residency = session_residency(out.residency, turn)
    return {
        "config": config, "session_id": sid, "turn": turn,
        "context_tokens": len(out.prompt_token_ids), "new_tokens": new,
        "output_tokens": n, "ttft_s": out.metrics.ttft_s,
        "itl_s": decode / (n - 1) if decode is not None and n > 1 else None,
        "residency": residency, "restored_tokens": out.num_restored_tokens,
        "recomputed_tokens": out.num_recomputed_tokens, "cached_tokens": out.num_cached_tokens,
        "restore_bytes": out.restore_bytes, "restore_s": out.metrics.restore_s,
        "queue_s": out.metrics.queue_s, "tier_s": out.metrics.tier_s,
        "compute_s": out.metrics.compute_s, "arrival_s": sent, "finish_s": finished,
    }
