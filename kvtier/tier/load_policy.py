"""Whether a prefix found in the tier is loaded or recomputed: the planner, or a fixed rule to
hold it against (`load_policy`, parsed once from the user's string).

    auto                      the planner: restore when kv_bytes / rate, after what is
                              queued ahead on the same path, beats the prefill after
                              the prefill tokens admitted before it; a restore that
                              beats its recompute alone is charged against that
                              prefill plus half again for the compute every other
                              request loses to it (GPU_SHARE_CHARGE); loads in flight
                              are bounded by what the link finishes in that time
    always                    restore whatever was found (the "always load" baseline)
    never                     recompute everything (the tier stores, nothing is loaded)
    threshold:TOKENS:INFLIGHT restore a prefix of at least TOKENS tokens while fewer than
                              INFLIGHT loads and fetches are in flight (llm-d's fixed rule,
                              e.g. threshold:1024:8)
A preempted request's own state is not a prefix found: it always follows the planner's swap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from kvtier.errors import ConfigError
from kvtier.tier.planner import Decision, Planner

# What `auto` charges a recompute for the compute it takes from every request sharing the
# steps (a restore spends only the link), as a fraction of its own prefill time, when the
# restore is the faster path alone (one slower alone is never bought with others' compute:
# the tier stays no slower than recomputing at light load). 0 minimises each request's own
# wait; kvtier's simulator over the GPU presets (benchmarks/simulated_regimes.py, the 78
# cells whose sessions fit) puts auto within 5% of the best fixed policy on wake mean, p99
# and tokens/s in 39 cells at 0 and 57 at 0.5 (58 at 0.75, 53 at 1); worst mean 1.21x ->
# 1.04x, p99 1.45x -> 1.21x, tokens/s 0.83x -> 0.84x.
GPU_SHARE_CHARGE = 0.5

CHOICES = "auto | always | never | threshold:TOKENS:INFLIGHT (e.g. threshold:1024:8)"


class Decline(enum.Enum):
    """Why tokens found in the tier were recomputed (counted per request, `declined{reason}`)."""

    SLOWER = "slower"  # the planner: even alone, reading them back costs more than the prefill
    INFLIGHT = "inflight"  # the link could not finish the loads in flight and it in time
    QUEUE = "queue"  # faster alone, but not behind the fetches queued on its tier
    POLICY = "policy"  # a fixed load_policy (never, threshold) said recompute
    DEADLINE = "deadline"  # past what a fetch brings up within its deadline
    NO_ROOM = "no_room"  # the host had no slots to fetch into
    LOST = "lost"  # a fetch missed: absent, failed verification, or cut at its deadline
    LAYOUT = "layout"  # a hit every KV cache group cannot serve whole (hybrid models)


@dataclass(frozen=True)
class Ahead:
    """What a new load would queue behind when it is decided."""

    loads: int = 0  # host -> device loads (and fetches up to host) decided, not landed
    link_bytes: int = 0  # bytes of the host -> device loads among them
    fetch_s: float = 0.0  # fetches queued on the tier it comes up from, at that tier's rate
    compute_tokens: int = 0  # prefill tokens admitted before it and not yet computed


class LoadRule(enum.Enum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"
    THRESHOLD = "threshold"


@dataclass(frozen=True)
class LoadPolicy:
    rule: LoadRule = LoadRule.AUTO
    min_tokens: int = 0  # THRESHOLD: the shortest prefix worth loading
    max_inflight: int = 0  # THRESHOLD: loads and fetches in flight before one is declined

    @classmethod
    def parse(cls, text: str) -> LoadPolicy:
        """The policy `text` names; ConfigError naming the value and the choices."""
        if not isinstance(text, str):
            raise ConfigError(f"load_policy={text!r} is not a string; one of {CHOICES}")
        name, _, rest = text.strip().lower().partition(":")
        try:
            rule = LoadRule(name)
        except ValueError:
            raise ConfigError(f"load_policy={text!r} is not one of {CHOICES}") from None
        if rule is not LoadRule.THRESHOLD:
            if rest:
                raise ConfigError(f"load_policy={text!r}: {name} takes no arguments")
            return cls(rule)
        tokens, _, inflight = rest.partition(":")
        try:
            min_tokens, max_inflight = int(tokens), int(inflight)
        except ValueError:
            raise ConfigError(f"load_policy={text!r}: threshold needs two whole numbers, "
                              "threshold:TOKENS:INFLIGHT (e.g. threshold:1024:8)") from None
        if min_tokens < 0 or max_inflight < 1:
            raise ConfigError(f"load_policy={text!r}: TOKENS must be >= 0 and INFLIGHT >= 1")
        return cls(rule, min_tokens, max_inflight)

    def decide(self, planner: Planner, tokens: int, nbytes: int, ahead: Ahead = Ahead(),
               via: str | None = None, via_nbytes: int | None = None
               ) -> tuple[Decision, Decline | None]:
        """The verdict for a prefix of `tokens` found in the tier (`nbytes` across the host
        link, first fetched from `via` if given) with `ahead` queued before it, and why it is
        recomputed (None: restored). The decision's restore_s includes the wait ahead (the
        planner scores it against the load as it landed)."""
        alone = planner.decide(tokens, nbytes, "auto", via, via_nbytes)
        rate = planner.calibration.link_gbps * 1e9
        # the recompute has the prefix ready once the prefill admitted before it has run
        horizon = alone.recompute_s + (planner.recompute_s(ahead.compute_tokens)
                                       if ahead.compute_tokens else 0.0)
        after_link = alone.restore_s + ahead.link_bytes / rate  # the loads ahead, then it
        restore_s = after_link + ahead.fetch_s
        decision = replace(alone, restore_s=restore_s, recompute_s=horizon,
                           choice="restore" if restore_s < horizon else "recompute")
        if self.rule is LoadRule.AUTO:  # the prediction stays horizon; the verdict is charged
            charged = horizon + (GPU_SHARE_CHARGE * alone.recompute_s
                                 if alone.restore_s < alone.recompute_s else 0.0)
            reason = (Decline.SLOWER if alone.restore_s >= charged else
                      Decline.INFLIGHT if not within_horizon(planner, alone.nbytes, after_link,
                                                             ahead.loads, charged)
                      else Decline.QUEUE if restore_s >= charged else None)
        elif self.rule is LoadRule.THRESHOLD:
            fits = tokens >= self.min_tokens and ahead.loads < self.max_inflight
            reason = None if fits else Decline.POLICY
        else:
            reason = None if self.rule is LoadRule.ALWAYS else Decline.POLICY
        return replace(decision, choice="recompute" if reason else "restore"), reason


def within_horizon(planner: Planner, nbytes: int, after_link_s: float, loads: int,
                   horizon_s: float) -> bool:
    """The in-flight bound: the link must carry the loads ahead and then this one of `nbytes`
    (done `after_link_s` from now), and as many loads as the `loads` ahead plus this one,
    each at this one's cost, within `horizon_s`; past it the load would land after the
    recompute's prefix was ready."""
    if after_link_s >= horizon_s:
        return False
    c = planner.calibration
    one = c.transfer_overhead_s + nbytes / (c.link_gbps * 1e9)
    return one <= 0 or loads + 1 <= horizon_s / one
