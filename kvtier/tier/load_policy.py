"""Whether a prefix found in the tier is loaded or recomputed: the planner, or a fixed rule to
hold it against (`load_policy`, parsed once from the user's string).

    auto                      the planner: restore when kv_bytes / rate, after what is
                              queued ahead on the same path, beats the prefill
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

CHOICES = "auto | always | never | threshold:TOKENS:INFLIGHT (e.g. threshold:1024:8)"


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

    def decide(self, planner: Planner, tokens: int, nbytes: int, inflight: int,
               via: str | None = None, via_nbytes: int | None = None, ahead_s: float = 0.0
               ) -> Decision:
        """The verdict for a prefix of `tokens` found in the tier (`nbytes` across the host
        link, first fetched from `via` if given) while `inflight` loads and fetches run, with
        `ahead_s` seconds of them queued ahead of this one on its path (the planner charges
        them to the restore); the planner's predictions are kept whichever rule decides."""
        decision = planner.decide(tokens, nbytes, "auto", via, via_nbytes)
        if ahead_s > 0:
            restore_s = decision.restore_s + ahead_s
            decision = replace(decision, restore_s=restore_s, choice=(
                "restore" if restore_s < decision.recompute_s else "recompute"))
        if self.rule is LoadRule.AUTO:
            return decision
        if self.rule is LoadRule.THRESHOLD:
            restore = tokens >= self.min_tokens and inflight < self.max_inflight
        else:
            restore = self.rule is LoadRule.ALWAYS
        return replace(decision, choice="restore" if restore else "recompute")
