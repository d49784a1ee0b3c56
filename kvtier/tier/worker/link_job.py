"""One job's progress inside the link: steps issued, bytes, completion signals. The job itself
is the tier's own `Job`; its outcome, the tier's `Result`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.tier.jobs import Job, Result
from kvtier.tier.keys import Medium


class JobState(enum.Enum):
    QUEUED = "queued"  # waiting or being copied by the worker
    INFLIGHT = "inflight"  # CUDA: every step issued (or the job failed); waiting for the GPU
    FINISHED = "finished"  # result ready, not yet delivered


LOAD, STORE = Medium.DEVICE, Medium.HOST  # a link job's direction is its destination


@dataclass(eq=False)
class Copy:
    """A device <-> host job as the link advances it, a step (a chunk, or a layer) at a time."""

    job: Job
    num_steps: int
    state: JobState = JobState.QUEUED
    next_step: int = 0
    bytes: int = 0
    layers_ready: int = 0  # layerwise: layers copied (CPU) or issued with an event (CUDA)
    started: float | None = None
    error: str | None = None
    result: Result | None = None
    index: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU layerwise index tensors
    ready_event: Any = None  # CUDA: the submitter's stream at submit time
    start_event: Any = None  # CUDA: recorded on the side stream before the first copy
    events: list[Any] = field(default_factory=list)  # CUDA: one per issued step

    @property
    def id(self) -> int:
        return self.job.id

    @property
    def direction(self) -> Medium:
        return self.job.dst
