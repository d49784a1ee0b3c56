"""Offered load against what the machine serves: saturation, and the time scale for a target.

A replay whose offered load exceeds the machine's capacity measures its queue, not where the
state lived. `offered_load(trace)` is the work the trace asks for per second of its own
timeline; `saturation(...)` compares that (for the requests served) with what a run
achieved and with the engine's busy time; `auto_time_scale(...)` stretches a trace so that
a replay runs at a target utilisation, from a probe that measures the engine's busy seconds
on a sample of the trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.bench.trace import Trace, TraceError

TARGET_UTILISATION = 0.7
PROBE_SHARE = 0.25  # of the trace's requests, in whole sessions, first arrivals first
PROBE_MAX_REQUESTS = 16
SATURATED_QUEUE_SHARE = 0.5  # queue wait this much of all TTFT: the run measured its queue
SATURATED_BUSY = 0.9  # or the engine this busy while the trace asked for more than it served
SATURATED_OVERLOAD = 1.2
BURSTY_BUSY = 0.8  # a queue while the engine idles this much of the run: bursty arrivals


def span_at(trace: Trace, scale: float, service_s: float) -> float:
    """How long a replay at `scale` lasts when each turn takes `service_s` to serve: the
    longest session's start and think times (a later turn is sent a think time after the
    previous one finished) stretched, plus its turns' service."""
    return max((scale * (reqs[0].arrival_s + sum(r.arrival_s for r in reqs[1:]))
                + len(reqs) * service_s for reqs in trace.sessions().values()), default=0.0)


def nominal_span_s(trace: Trace) -> float:
    """How long the trace lasts on an infinitely fast server."""
    return span_at(trace, 1.0, 0.0)


def trace_tokens(trace: Trace) -> int:
    """The work the trace asks for, in tokens: every turn's new message plus its output."""
    return trace.total_input_tokens + trace.total_output_tokens


def offered_load(trace: Trace) -> float | None:
    """Tokens per second of the trace's own timeline; None for a trace with no duration."""
    span = nominal_span_s(trace)
    return trace_tokens(trace) / span if span > 0 else None


def rescale(trace: Trace, factor: float) -> Trace:
    """The same trace with every arrival and think time multiplied by `factor`."""
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in trace.requests]
    scale = trace.meta.get("time_scale", 1.0) * factor
    return Trace(requests, trace.source, {**trace.meta, "time_scale": scale})


def probe_sample(trace: Trace, burst: bool = True) -> Trace:
    """Whole sessions in order of first arrival, up to PROBE_SHARE of the requests (at most
    PROBE_MAX_REQUESTS, at least one session): with `burst` all sent at once with no think
    time, else at the trace's own times (from the first of them)."""
    sessions = sorted(trace.sessions().values(), key=lambda reqs: reqs[0].arrival_s)
    budget = min(PROBE_MAX_REQUESTS, max(1, round(PROBE_SHARE * len(trace.requests))))
    chosen: list[Any] = []
    t0 = sessions[0][0].arrival_s if sessions else 0.0
    for reqs in sessions:
        if chosen and len(chosen) + len(reqs) > budget:
            break
        chosen.extend(reqs)
    if burst:
        chosen = [dataclasses.replace(r, arrival_s=0.0) for r in chosen]
    else:
        chosen = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) if r.turn == 0 else r
                  for r in chosen]
    return Trace(chosen, f"probe of {trace.source}", {"probe_requests": len(chosen)})


def check_auto(trace: Trace, target: float) -> None:
    """Refuse, before any probe runs, a target or a trace no time scale can serve."""
    if not 0 < target <= 1:
        raise TraceError(f"--target-utilisation {target}: expected a fraction in (0, 1]")
    if nominal_span_s(trace) <= 0:
        raise TraceError("--time-scale auto: every request of this trace arrives at t=0, so "
                         "no time scale changes its load; give a numeric --time-scale")


def auto_time_scale(trace: Trace, probe_busy_s: float, probe: Trace,
                    target: float = TARGET_UTILISATION, service_s: float = 0.0
                    ) -> dict[str, float]:
    """The factor at which the trace keeps the machine `target` busy: the probe's busy
    seconds per token times the trace's tokens (its demand), over the replay's span at that
    factor, each turn taking `service_s` (a later turn waits for the one before)."""
    check_auto(trace, target)
    per_token = probe_busy_s / max(1, trace_tokens(probe))
    demand = per_token * trace_tokens(trace)
    lo, hi = 0.0, demand / (target * nominal_span_s(trace))  # at hi the span alone suffices
    for _ in range(60):  # span_at grows with the factor: bisect for demand / span = target
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if demand / max(span_at(trace, mid, service_s), 1e-9) > target \
            else (lo, mid)
    return {"factor": hi, "target_utilisation": target, "probe_busy_s": probe_busy_s,
            "probe_requests": len(probe.requests), "busy_s_per_token": per_token,
            "service_s": service_s, "nominal_span_s": nominal_span_s(trace)}


def probe_time_scale(trace: Trace, replay: Callable[[Trace], Any], target: float,
                     say: Callable[[str], None]) -> dict[str, Any]:
    """Measure this machine on a sample of the trace twice: sent at once (a first guess at
    its cost), then at its own times stretched by that guess (the cost at about the target's
    batching, which a burst understates, and each turn's service time); the time scale for
    `target` from the second. `replay(trace)` runs a trace on a fresh engine (a ConfigRun)."""
    check_auto(trace, target)
    burst = probe_sample(trace)
    say(f"probing this machine with {len(burst.requests)} requests of the trace, sent at once")
    first = auto_time_scale(trace, run_busy_s(replay(burst)), burst, target)
    paced = rescale(probe_sample(trace, burst=False), first["factor"])
    say(f"first guess {first['factor']:.3g}; probing again with them at that scale")
    run = replay(paced)
    service = [r["finish_s"] - r["arrival_s"] for r in run.records]
    auto = auto_time_scale(trace, run_busy_s(run), paced, target,
                           sum(service) / len(service) if service else 0.0)
    auto["first_guess"] = first["factor"]
    say(f"{auto['probe_busy_s']:.1f} s busy for {len(paced.requests)} requests, "
        f"{auto['service_s']:.2f} s per turn -> time scale {auto['factor']:.3g} for "
        f"{target:.0%} utilisation")
    return auto


def run_busy_s(run: Any) -> float:
    """A run's engine busy seconds; for a server, which does not say, its wall time."""
    busy = run.engine.get("busy_s")
    return run.wall_s if busy is None else busy


def saturation(records: Sequence[dict[str, Any]], busy_s: float | None, wall_s: float,
               span_s: float, time_scale: float) -> dict[str, Any]:
    """How loaded the run was: utilisation, queue wait's share of TTFT, the tokens/s the
    trace offered (for the requests served, over its nominal `span_s`) against what the run
    achieved (over its wall time), and, when saturated, the time scale to try."""
    split = [r for r in records if r.get("queue_s") is not None and r["ttft_s"] is not None]
    ttft = sum(r["ttft_s"] for r in split)
    queue_share = sum(r["queue_s"] for r in split) / ttft if ttft > 0 else None
    tokens = sum(r.get("new_tokens", 0) + r["output_tokens"] for r in records)
    offered = tokens / span_s if span_s > 0 and records else None
    achieved = tokens / wall_s if wall_s > 0 and records else None
    overload = offered / achieved if offered and achieved else None
    utilisation = busy_s / wall_s if busy_s is not None and wall_s > 0 else None
    saturated = bool(
        (queue_share is not None and queue_share >= SATURATED_QUEUE_SHARE)
        or (utilisation is not None and utilisation >= SATURATED_BUSY
            and overload is not None and overload >= SATURATED_OVERLOAD))
    suggest = (time_scale * max(overload, 1.0) / TARGET_UTILISATION
               if saturated and overload else None)
    return {"utilisation": utilisation, "queue_share": queue_share,
            "offered_tokens_per_s": offered, "achieved_tokens_per_s": achieved,
            "overload": overload, "saturated": saturated, "time_scale": time_scale,
            "suggested_time_scale": suggest}


def saturation_message(s: dict[str, Any]) -> str:
    """The saturation flag in words: what share of TTFT was queueing, why, and what to do."""
    busy, share = s["utilisation"], s["queue_share"]
    text = "the run is saturated" if share is None else f"queue wait is {share:.0%} of TTFT"
    if busy is not None and busy < BURSTY_BUSY:
        text += (f" although the engine was busy only {busy:.0%} of the run: the trace's "
                 "arrivals come in bursts this machine cannot absorb")
    elif busy is not None:
        text += f" and the engine was busy {busy:.0%} of the run"
    if s["overload"] is not None and s["overload"] >= SATURATED_OVERLOAD:
        text += f"; the offered load is {s['overload']:.1f}x what this machine served"
    if s["suggested_time_scale"] is not None:
        text += (f"; try --time-scale {s['suggested_time_scale']:.3g} (or --time-scale auto)"
                 " so TTFT shows where the state lived rather than the queue")
    return text
