"""Restore or recompute: the one piece of arithmetic the tier is betting on.

    restore_s   = kv_bytes / link_bytes_per_s + per_transfer_overhead_s
                  (+ kv_bytes / tier_bytes_per_s + per_transfer_overhead_s from disk or remote:
                  the bytes come up to host first, then cross the link)
    recompute_s = tokens / prefill_tokens_per_s + attention_s_per_token2 * tokens**2 / 2

The quadratic term is causal attention: token i attends to i earlier tokens, so a prompt of
T tokens costs ~T**2 / 2 query-key pairs on top of the per-token weight matmuls. It is why
the restore-over-recompute gain grows with prompt length (restore stays linear in bytes plus
a fixed overhead). It defaults to 0 (the engine measures only the linear term online);
`kvtier plan` sets it from FLOPs: 4 * layers * hidden / (flops * mfu) seconds per token**2.

`kvtier plan` (offline, hardware presets) and the scheduler (online, calibrated at start and
updated from every real transfer and prefill) share this class, so the prediction and the
decision can never disagree. Every decision's prediction is kept beside what then happened,
so the planner's error is reported, not assumed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

Choice = Literal["restore", "recompute"]


@dataclass(frozen=True)
class Decision:
    choice: Choice
    restore_s: float
    recompute_s: float
    tokens: int
    nbytes: int


@dataclass
class Calibration:
    """The numbers the arithmetic needs; link and linear prefill EMA-updated from observations."""

    link_gbps: float  # 1e9 bytes per second, host -> device
    transfer_overhead_s: float  # fixed cost of one load job (submit, sync, bookkeeping)
    prefill_tokens_per_s: float  # the linear (weight-matmul) part of prefill speed
    # causal attention: seconds per token**2, charged as a * T**2 / 2 (0: linear model)
    attention_s_per_token2: float = 0.0
    # read GB/s of each tier below host ("disk", "remote"), measured at start, EMA-updated
    tier_gbps: dict[str, float] = field(default_factory=dict)


@dataclass
class Observation:
    kind: Literal["restore", "recompute", "fetch"]
    predicted_s: float
    actual_s: float

    @property
    def relative_error(self) -> float:
        return abs(self.predicted_s - self.actual_s) / max(self.actual_s, 1e-9)


@dataclass
class Planner:
    calibration: Calibration
    smoothing: float = 0.2  # weight of a new observation in the running estimates
    history: list[Observation] = field(default_factory=list)
    max_history: int = 10_000

    def restore_s(self, nbytes: int, via: str | None = None, via_nbytes: int | None = None
                  ) -> float:
        """Host -> device; `via` a deeper tier adds the hop from it up to host first, of
        `via_nbytes` (what that tier stores: fewer than `nbytes` where blocks are 8-bit)."""
        c = self.calibration
        seconds = nbytes / (c.link_gbps * 1e9) + c.transfer_overhead_s
        if via is not None:
            seconds += self.fetch_s(via, nbytes if via_nbytes is None else via_nbytes)
        return seconds

    def fetch_s(self, tier: str, nbytes: int) -> float:
        """The hop alone: `nbytes` as `tier` stores them, read up into host memory."""
        c = self.calibration
        return nbytes / (c.tier_gbps[tier] * 1e9) + c.transfer_overhead_s

    def recompute_s(self, tokens: int) -> float:
        return self.prefill_s(tokens)

    def prefill_s(self, tokens: int, cached_tokens: int = 0) -> float:
        """Prefill `tokens` new tokens after `cached_tokens` already in the cache."""
        c = self.calibration
        end = cached_tokens + tokens
        attention = c.attention_s_per_token2 * (end * end - cached_tokens * cached_tokens) / 2
        return tokens / c.prefill_tokens_per_s + attention

    def decide(self, tokens: int, nbytes: int, mode: str = "auto", via: str | None = None,
               via_nbytes: int | None = None) -> Decision:
        """`mode` is the user's preemption_mode: auto compares; swap/recompute force a side.
        `via` names the deeper tier the bytes must first come up from, if any."""
        restore, recompute = self.restore_s(nbytes, via, via_nbytes), self.recompute_s(tokens)
        if mode == "swap":
            choice: Choice = "restore"
        elif mode == "recompute":
            choice = "recompute"
        else:
            choice = "restore" if restore < recompute else "recompute"
        return Decision(choice, restore, recompute, tokens, nbytes)

    def crossover_tokens(self, bytes_per_token: float) -> float | None:
        """Tokens above which restoring beats recomputing (None: restore always wins or never).

        With an attention term a > 0 the gain a*T**2/2 + g*T - overhead always turns positive,
        so the root of that quadratic is returned even when the linear gain g is negative.
        """
        c = self.calibration
        per_token_gain = 1 / c.prefill_tokens_per_s - bytes_per_token / (c.link_gbps * 1e9)
        a, overhead = c.attention_s_per_token2, c.transfer_overhead_s
        if a <= 0:
            if per_token_gain <= 0:
                return None
            return overhead / per_token_gain
        root = math.sqrt(per_token_gain * per_token_gain + 2 * a * overhead)
        if per_token_gain > 0:  # the cancellation-free form of (-g + root) / a
            return 2 * overhead / (per_token_gain + root)
        return (root - per_token_gain) / a

    def observe_transfer(self, nbytes: int, seconds: float, predicted_s: float | None = None
                         ) -> None:
        """A finished load: refine the link estimate, and score the prediction if one was made."""
        if predicted_s is not None:
            self._record(Observation("restore", predicted_s, seconds))
        useful = seconds - self.calibration.transfer_overhead_s
        if nbytes > 0 and useful > 0:
            self.calibration.link_gbps = self._blend(self.calibration.link_gbps,
                                                     nbytes / useful / 1e9)

    def observe_tier(self, tier: str, nbytes: int, seconds: float,
                     predicted_s: float | None = None) -> None:
        """A finished read from a deeper tier up to host: score the prediction made when it
        was decided, then refine that tier's rate."""
        if predicted_s is not None:
            self._record(Observation("fetch", predicted_s, seconds))
        useful = seconds - self.calibration.transfer_overhead_s
        if nbytes > 0 and useful > 0:
            rates = self.calibration.tier_gbps
            rates[tier] = self._blend(rates[tier], nbytes / useful / 1e9)

    def observe_prefill(self, tokens: int, seconds: float, predicted_s: float | None = None
                        ) -> None:
        """A measured prefill from scratch: refine the linear term only (the attention term's
        modelled share is taken off first; with none, this is tokens / seconds)."""
        if predicted_s is not None:
            self._record(Observation("recompute", predicted_s, seconds))
        linear_s = seconds - self.calibration.attention_s_per_token2 * tokens * tokens / 2
        if tokens > 0 and linear_s > 0:
            self.calibration.prefill_tokens_per_s = self._blend(
                self.calibration.prefill_tokens_per_s, tokens / linear_s)

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def _record(self, obs: Observation) -> None:
        self.history.append(obs)
        if len(self.history) > self.max_history:
            del self.history[: len(self.history) - self.max_history]

    def error_report(self) -> dict[str, dict[str, float | int]]:
        """Per kind: count, median and p90 relative error of predicted vs measured seconds."""
        report: dict[str, dict[str, float | int]] = {}
        for kind in ("restore", "recompute", "fetch"):
            errs = sorted(o.relative_error for o in self.history if o.kind == kind)
            if errs:
                report[kind] = {"count": len(errs), "median_rel_error": statistics.median(errs),
                                "p90_rel_error": errs[min(len(errs) - 1, int(0.9 * len(errs)))]}
        return report
