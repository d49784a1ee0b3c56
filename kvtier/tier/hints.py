"""What a client asks of its request's KV beyond the request, as the tier takes it: one type
every client's edge parses its own API's fields into (kvtier serve's body, vLLM's
`kv_transfer_params`), and one call that answers it (`TierManager.answer`). A new hint is a
field here, its answer in the manager, and one parser per API: no client mirrors another.

A value no client means (negative, zero, NaN, infinite, a bool, a string) is the edge's to
refuse: kvtier serve answers 400; an engine that cannot fail a request for it (vLLM) names the
hint in `invalid`, and its answer is "refused:invalid", counted.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.tier.books.returns import MAX_EXPECT_RETURN_S
from kvtier.tier.books.tenancy import Grant
from kvtier.tier.keys import Medium


class Hint(str, enum.Enum):
    """Each thing a client may ask; its value is the field's name as APIs spell it."""

    RETENTION = "retention_s"  # keep the prefix this long, if granted
    EXPECT_RETURN = "expect_return_s"  # the session returns after about this long

    def __str__(self) -> str:
        return self.value


def seconds(value: object) -> float | None:
    """`value` as seconds a client can mean (a finite number > 0, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


# breakpoints (prefix retentions) one request may ask for, as OpenAI and Anthropic allow
MAX_PREFIXES = 4


@dataclass(frozen=True)
class PrefixRetention:
    """Keep the blocks of the prompt's first `tokens` tokens at least `seconds` (a cache
    breakpoint: OpenAI's `prompt_cache_breakpoint`, Anthropic's `cache_control`); the blocks
    kept are the full ones within it."""

    tokens: int
    seconds: float


@dataclass(frozen=True)
class KvHints:
    """One request's asks: whose its KV is (quotas and counters), how long to keep it
    (retention), when it comes back (prefetch); the hints asked with a value no client means
    (`invalid`, answered refused)."""

    tenant: str = ""  # "" counts as the default tenant
    retention_s: float | None = None
    expect_return_s: float | None = None
    invalid: frozenset[Hint] = frozenset()
    prefixes: tuple[PrefixRetention, ...] = ()  # breakpoints, each with its own lifetime

    def problem(self) -> str | None:
        """What is wrong with a value, in the client's words, or None (the edge that can
        fail a request fails it with this)."""
        for hint in Hint:
            value = getattr(self, hint.value)
            if hint in self.invalid or (value is not None and seconds(value) is None):
                shown = "" if value is None else f"={value!r}"
                return (f"kv_{hint.value}{shown} must be a finite number of seconds > 0 (or "
                        "left out)")
        for p in self.prefixes:
            if seconds(p.seconds) is None or isinstance(p.tokens, bool) or \
                    not isinstance(p.tokens, int) or p.tokens < 0:
                return (f"a cache breakpoint keeps a prompt's first N >= 0 tokens for a finite "
                        f"number of seconds > 0, not {p.tokens!r} tokens for {p.seconds!r} s")
        if self.expect_return_s is not None and self.expect_return_s > MAX_EXPECT_RETURN_S:
            return (f"kv_expect_return_s={self.expect_return_s:g} is past the longest hint "
                    f"kept ({MAX_EXPECT_RETURN_S:g} s)")
        return None

    def asks(self, hint: Hint) -> bool:
        """Whether the client asked `hint` (with a good value or not)."""
        return hint in self.invalid or getattr(self, hint.value) is not None

    @property
    def stores(self) -> bool:
        """Whether the request's full blocks must go down to host, whatever the engine's write
        policy: a retention is asked of blocks the tier holds."""
        return self.retention_s is not None or bool(self.prefixes)


@dataclass(frozen=True)
class HintReply:
    """What each asked hint got (None: not asked)."""

    retention: Grant | None = None
    expect_return: Grant | None = None
    prefixes: tuple[Grant, ...] = ()  # one per breakpoint asked, in its order

    @classmethod
    def every(cls, hints: KvHints, grant: Grant) -> HintReply:
        """Every hint `hints` asks answered with one `grant` (an engine without a tier
        refuses them all alike, whatever hints come next)."""
        return cls(grant if hints.asks(Hint.RETENTION) else None,
                   grant if hints.asks(Hint.EXPECT_RETURN) else None,
                   tuple(grant for _ in hints.prefixes))

    def answers(self) -> dict[Hint, float | str]:
        """Each asked hint's answer as a response carries it: seconds granted, or
        "refused:<reason>"."""
        out: dict[Hint, float | str] = {}
        if self.retention is not None:
            out[Hint.RETENTION] = self.retention.value
        if self.expect_return is not None:
            out[Hint.EXPECT_RETURN] = self.expect_return.value
        return out


@dataclass(frozen=True)
class Purged:
    """What a purge of a prefix's blocks did in each tier: the device's free cached copies
    and the host's dropped; the device's copies a running request uses kept (ask again once
    it finishes); the host's copies a job holds (landing, or being read) dropped as soon as
    it is done and never written below (`host_in_use`); below host the copies erased per
    medium (a shared store: the keys it was told to delete, a local tier's write still on
    its way erased once there) and those a store failed to erase."""

    device_blocks: int = 0
    device_in_use: int = 0
    host_blocks: int = 0
    host_in_use: int = 0
    below: Mapping[Medium, int] = field(default_factory=dict)
    erase_failures: Mapping[Medium, int] = field(default_factory=dict)  # their bytes stay
