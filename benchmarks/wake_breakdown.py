"""Where a woken request's time went under vLLM, and what kvtier's hooks cost a step: read
from what the connector reports (each request's `kvtier_timeline` in its kv_transfer_params,
the `vllm:kvtier_hook_seconds` and `vllm:kvtier_step_seconds` counters) and the driver's own
send time, all on one clock (time.perf_counter, CLOCK_MONOTONIC). Used by
benchmarks/vllm_connector.py."""

from __future__ import annotations

import statistics
from typing import Any

# (the mark a segment ends at, what the time up to it was spent on), in the order they happen
SEGMENTS = [
    ("asked", "to engine"),  # the client sent it; vLLM's scheduler first asked kvtier
    ("fetch_started", "presence"),  # a Redis presence answer awaited (0 for disk)
    ("fetch_began", "fetch queued"),  # the fetch job went to the worker's I/O thread
    ("fetch_ended", "fetch read+verify"),  # read below host, checked, copied into host rows
    ("answered", "ask again"),  # the result back to the scheduler, vLLM asked again
    ("load_began", "admit"),  # vLLM allocated blocks; the load went to the worker
    ("load_ended", "copy to vLLM"),  # host rows -> vLLM's KV cache
    ("finished", "forward"),  # the forward pass over the follow-up, sampling, vLLM's update
    ("received", "to client"),  # the output back to the client
]
LABELS = [label for _, label in SEGMENTS]


def segments(result: dict[str, Any]) -> dict[str, float] | None:
    """One request's milliseconds per segment (absent marks: no time there), or None when
    the connector reported no timeline for it."""
    timeline = ((result.get("kv_transfer_params") or {}).get("kvtier_timeline"))
    if not timeline or "sent_at" not in result:
        return None
    asked = timeline["asked_at"]
    marks = {"asked": asked, "received": result["sent_at"] + result["seconds"]}
    for name, _ in SEGMENTS:
        if f"{name}_ms" in timeline:
            marks[name] = asked + timeline[f"{name}_ms"] / 1e3
    out, prev = {}, result["sent_at"]
    for name, label in SEGMENTS:
        if name in marks:
            out[label] = (marks[name] - prev) * 1e3
            prev = marks[name]
    return out


def median_segments(results: list[dict[str, Any]]) -> dict[str, float]:
    """Per segment, the median over the requests that reported it (0 where none did)."""
    each = [s for s in map(segments, results) if s is not None]
    return {label: statistics.median([s.get(label, 0.0) for s in each]) if each else 0.0
            for label in LABELS}


def print_breakdown(rows: dict[str, dict[str, float]]) -> None:
    """One line per tier: its median ms in each segment."""
    short = [label.replace("fetch ", "f.") for label in LABELS]
    print("where a wake's time went (ms, p50 per segment; see benchmarks/wake_breakdown.py)")
    print(f"{'config':<18} " + " ".join(f"{s:>11}" for s in short) + f" {'sum':>7}")
    for name, seg in rows.items():
        print(f"{name:<18} " + " ".join(f"{seg[label]:11.1f}" for label in LABELS)
              + f" {sum(seg.values()):7.1f}")


def hook_share(metrics: dict[str, float]) -> dict[str, Any]:
    """kvtier's hook seconds as a share of the steps they ran in, and the costliest hooks."""
    step = sum(v for k, v in metrics.items() if k.startswith("vllm:kvtier_step_seconds"))
    hooks = {k.split("hook=", 1)[1].rstrip("}"): v for k, v in metrics.items()
             if k.startswith("vllm:kvtier_hook_seconds") and "hook=" in k}
    total = sum(hooks.values())
    return {"step_seconds": step, "hook_seconds": total,
            "share": total / step if step else None,
            "by_hook": dict(sorted(hooks.items(), key=lambda kv: -kv[1]))}
