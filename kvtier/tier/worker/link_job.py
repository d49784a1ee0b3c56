"""One transfer job's state inside the engine: its spec, progress, and completion signals."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.tier.worker.spec import TransferResult, TransferSpec


class JobState(enum.Enum):
    QUEUED = "queued"  # waiting or being copied by the worker
    INFLIGHT = "inflight"  # CUDA: every step issued (or the job failed); waiting for the GPU
    FINISHED = "finished"  # result ready, not yet delivered


@dataclass(eq=False)
class Job:
    id: int
    spec: TransferSpec
    num_steps: int
    state: JobState = JobState.QUEUED
    next_step: int = 0
    bytes: int = 0
    layers_ready: int = 0  # layerwise: layers copied (CPU) or issued with an event (CUDA)
    started: float | None = None
    error: str | None = None
    result: TransferResult | None = None
    index: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU layerwise index tensors
    ready_event: Any = None  # CUDA: the submitter's stream at submit time
    start_event: Any = None  # CUDA: recorded on the side stream before the first copy
    events: list[Any] = field(default_factory=list)  # CUDA: one per issued step
