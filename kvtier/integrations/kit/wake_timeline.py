"""When each step of a request's wake happened, so a benchmark can say where a woken request's
time went (lookup, fetch below host, the wait for vLLM to ask again, the host -> device copy,
the forward pass) instead of guessing from its TTFT.

Marks are `time.perf_counter()` seconds: CLOCK_MONOTONIC on Linux, one clock for every
process on the machine, so a mark taken in vLLM's engine process (the scheduler side, or the
worker's `finished_at`) compares with one taken by the client that sent the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class WakeTimeline:
    """One request's marks; None where the request did not pass that point."""

    asked: float  # vLLM first asked kvtier for this request's prefix
    answered: float | None = None  # kvtier's answer (after any presence question or fetch)
    fetch_started: float | None = None  # kvtier started a fetch below host for it
    fetch_began: float | None = None  # the I/O thread began it (worker clock, same clock)
    fetch_ended: float | None = None  # the I/O thread finished it
    fetch_applied: float | None = None  # the scheduler side learned it had landed
    allocated: float | None = None  # vLLM admitted the request with its blocks
    load_began: float | None = None  # the host -> device copy began (worker)
    load_ended: float | None = None  # ... and ended
    finished: float | None = None  # vLLM finished the request

    @classmethod
    def start(cls) -> WakeTimeline:
        return cls(time.perf_counter())

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def fetched(self, finished_at: float, seconds: float) -> None:
        """Its fetch below host landed (the I/O thread's end and its seconds on it)."""
        if finished_at:
            self.fetch_began, self.fetch_ended = finished_at - seconds, finished_at
        self.fetch_applied = self.now()

    def loaded(self, finished_at: float, seconds: float) -> None:
        """Its host -> device load landed (the worker's end and its seconds on it)."""
        if finished_at:
            self.load_began, self.load_ended = finished_at - seconds, finished_at

    def as_params(self) -> dict[str, float]:
        """`asked_at` (absolute, seconds) and every other mark in ms after it, for the
        request's kv_transfer_params (a client subtracts its own send time from `asked_at`)."""
        out = {"asked_at": round(self.asked, 6)}
        for name in ("answered", "fetch_started", "fetch_began", "fetch_ended", "fetch_applied",
                     "allocated", "load_began", "load_ended", "finished"):
            mark = getattr(self, name)
            if mark is not None:
                out[f"{name}_ms"] = round((mark - self.asked) * 1e3, 3)
        return out
