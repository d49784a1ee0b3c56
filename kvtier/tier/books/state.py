"""What the manager keeps while it works: each device <-> host job in flight, and each
request's own state (kept off the engine's sequence object)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kvtier.tier.handoff import Wait
from kvtier.tier.jobs import Job
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.load_policy import Decline
from kvtier.tier.outcome import RequestOutcome


@dataclass
class PendingTransfer:
    """A device <-> host job in flight, with what its completion must do."""

    job: Job
    keys: list[BlockKey]
    request_id: str | None = None
    predicted_s: float | None = None
    tokens: int = 0  # a load: the tokens it restores
    swap: bool = False  # a load: a preempted request's own state coming back
    demote: bool = False
    evict_first: bool = False
    exclusive: bool = False  # a load after which the host copy is dropped (write-back)
    decided_at: float = field(default_factory=time.perf_counter)  # its wait counts too


@dataclass
class RequestBooks:
    """The tier's own state of one request (kept off the engine's sequence object)."""

    checked_below: bool = False  # tiers below host were consulted once: never fetch twice
    declined: Counter[Decline] = field(default_factory=Counter)  # tokens found, recomputed
    fetched_from: Medium | None = None
    fetching: bool = False  # its fetch below host is on its way
    # what it waits for (blocks landing on host, or another engine's handoff), since when,
    # and what it gave up on (counted declined once)
    waiting: dict[Wait, float] = field(default_factory=dict)
    gave_up: set[Wait] = field(default_factory=set)
    asked_at: float = 0.0  # when it last asked a shared store for a handoff's blocks
    outcome: RequestOutcome = field(default_factory=RequestOutcome)
