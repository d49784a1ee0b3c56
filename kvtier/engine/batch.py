"""What one engine step runs: each sequence's chunk of tokens, and the step as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work this step: compute tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    block_ids: list[int]
    wait_ref: int | None = None  # a layerwise load the model must wait on, layer by layer

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token, so a token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)
