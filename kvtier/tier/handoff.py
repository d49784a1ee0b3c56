"""Waiting for blocks still being written, rather than recomputing what is about to land.

Two waits, counted apart (`Wait`): the blocks of a turn that just ended still landing on host
(its follow-up came first), and a `Handoff`: blocks another engine is writing to a shared
store for this request (its prefill ran there: prefill/decode disaggregation, or a router that
sends the next turn to another instance). Either is bounded: by the client's `wait_s`, or by
the time the planner says recomputing the missing blocks takes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Wait(enum.Enum):
    """What a request waited for (the label of the wait counters)."""

    LANDING = "landing"  # its previous turn's blocks landing on host
    HANDOFF = "handoff"  # another engine's write to a shared store


@dataclass(frozen=True)
class Handoff:
    """A request's prompt that another engine prefilled and is writing to a shared store:
    its first `tokens` (None: every full block the request asks for; the router sent it
    before the producer answered), waited for at most `wait_s` seconds (None: as long as
    recomputing the blocks not there yet would take)."""

    tokens: int | None = None
    wait_s: float | None = None

    def after(self, tokens: int) -> Handoff:
        """The same handoff for the blocks after the prompt's first `tokens` (which the
        engine holds already)."""
        if self.tokens is None:
            return self
        return Handoff(max(0, self.tokens - tokens), self.wait_s)

    def blocks(self, asked: int, block_size: int) -> int:
        """How many of the `asked` leading blocks it expects from the store."""
        return asked if self.tokens is None else min(asked, self.tokens // block_size)
