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

A tier below host that misses a fetch's deadline is taken as slow at once, not blended in:
its rate is read as at most what landed over the time it had (`observe_slow`), so the very
next decision weighs it at that rate (recomputing where it now loses, counted as declined,
never skipped unsaid; a prefetch does not ask it). That slowdown holds for a cool-down
(`slow_retry_s`, doubled by each miss in a row up to `slow_retry_max_s`); after it the
tier's healthy estimate is used again, so one fetch probes it: on time, the slowdown is
forgotten; late, a longer cool-down.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Choice = Literal["restore", "recompute"]
MIN_TIER_GBPS = 1e-6  # a tier that delivered nothing before a fetch's deadline: 1 KB/s
SLOW_RETRY_S = 10.0  # how long a tier that missed a deadline is taken as slow ...
SLOW_RETRY_MAX_S = 300.0  # ... doubled by each miss in a row, up to this


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


@dataclass(frozen=True)
class Slowdown:
    """A tier below host that missed a fetch's deadline, as the planner takes it now."""

    gbps: float  # the rate it showed: at most the bytes that landed over the time it had
    until: float  # planner clock: after this its healthy estimate is used (a probe) again
    window_s: float  # this cool-down's length (doubled by each miss in a row)


@dataclass
class Planner:
    calibration: Calibration
    smoothing: float = 0.2  # weight of a new observation in the running estimates
    history: list[Observation] = field(default_factory=list)
    max_history: int = 10_000
    slow_retry_s: float = SLOW_RETRY_S
    slow_retry_max_s: float = SLOW_RETRY_MAX_S
    clock: Callable[[], float] = time.monotonic
    slowdowns: dict[str, Slowdown] = field(default_factory=dict)  # per tier, while slow

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
        return nbytes / (self.tier_gbps(tier) * 1e9) + self.calibration.transfer_overhead_s

    def tier_gbps(self, tier: str) -> float:
        """The read rate `tier` is planned with now: its slowdown's during a cool-down, else
        the estimate refined from every fetch that met its deadline."""
        slow = self.slowdowns.get(tier)
        if slow is not None and self.clock() < slow.until:
            return slow.gbps
        return self.calibration.tier_gbps[tier]

    def slow_tiers(self) -> set[str]:
        """The tiers below host in a cool-down now (a prefetch, which no wait justifies, does
        not ask them what they hold; a wake does, and weighs them at their slow rate)."""
        now = self.clock()
        return {tier for tier, slow in self.slowdowns.items() if now < slow.until}

    def blocks_within(self, tier: str, block_nbytes: int, seconds: float) -> int:
        """How many blocks of `block_nbytes` a fetch from `tier` is predicted to bring up in
        `seconds` (at least one: a single block is always worth asking for)."""
        per_block = block_nbytes / (self.tier_gbps(tier) * 1e9)
        if per_block <= 0:
            return 1 << 30
        useful = seconds - self.calibration.transfer_overhead_s
        return max(1, math.floor(useful / per_block))

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

    def observe_transfer(self, nbytes: int, seconds: float, predicted_s: float | None = None,
                         waited_s: float = 0.0) -> None:
        """A finished load of `seconds` copying, `waited_s` from its decision to its end (the
        loads queued ahead of it included): refine the link estimate from the copy, and score
        the prediction, which charged the queue, against the whole wait."""
        if predicted_s is not None:
            self._record(Observation("restore", predicted_s, max(seconds, waited_s)))
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
        self.slowdowns.pop(tier, None)  # it met its deadline: no longer slow
        useful = seconds - self.calibration.transfer_overhead_s
        if nbytes > 0 and useful > 0:
            rates = self.calibration.tier_gbps
            rates[tier] = self._blend(rates[tier], nbytes / useful / 1e9)

    def observe_slow(self, tier: str, nbytes: int, seconds: float) -> None:
        """A fetch from `tier` missed its deadline after `seconds` of reading, with `nbytes`
        landed: taken at once (no blending), at most nbytes / seconds, for a cool-down that
        doubles with each miss in a row. The healthy estimate is kept for after it."""
        shown = max(MIN_TIER_GBPS, nbytes / max(seconds, 1e-9) / 1e9)
        before = self.slowdowns.get(tier)
        window = (self.slow_retry_s if before is None
                  else min(2 * before.window_s, self.slow_retry_max_s))
        self.slowdowns[tier] = Slowdown(min(shown, self.tier_gbps(tier)),
                                        self.clock() + window, window)

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
