"""One job's progress inside the link: steps issued, bytes, completion signals. The job itself
is the tier's own `Job`; its outcome, the tier's `Result`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.tier.jobs import Job, Result
from kvtier.tier.keys import Medium
from kvtier.tier.layout import KVLayout
from kvtier.tier.link.host_pool import HostPool


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
    error: str = ""  # why it failed ("": it has not)
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


def check_link_setup(layout: KVLayout, host: HostPool, blocks_per_chunk: int) -> None:
    """ConfigError for a device layout and host pool the link cannot copy between."""
    if layout.block_shape != host.block_shape or layout.dtype != host.dtype:
        raise ConfigError(
            f"host slots {host.block_shape} {host.dtype} do not match device blocks "
            f"{layout.block_shape} {layout.dtype}; build the pool with "
            "HostPool.like(layout, ...)"
        )
    if host.encoding and (layout.is_cuda or layout.coded_block_shape is None):
        raise ConfigError(
            "kv_offload_dtype encodes blocks on the CPU path of kvtier's contiguous or "
            "vLLM's heads-first KV layout only for now (the CUDA side would quantize on the "
            "device before the copy, which is not built); unset it"
        )
    if layout.is_cuda and not host.pinned:
        raise ConfigError("a CUDA device needs a pinned host pool (HostPool.like pins it)")
    if blocks_per_chunk < 1:
        raise ConfigError(f"blocks_per_chunk={blocks_per_chunk} must be >= 1")


def check_link_job(job: Job, num_blocks: int, num_slots: int) -> None:
    """ValueError for a job the link cannot run, naming what is wrong."""
    if {job.src, job.dst} != {LOAD, STORE}:
        raise ValueError(f"job {job.id} goes {job.src} -> {job.dst}; the link copies "
                         "between device and host only")
    if len(job.device_blocks) != len(job.host_slots):
        raise ValueError(
            f"{len(job.device_blocks)} device blocks but {len(job.host_slots)} host slots; "
            "block i goes to slot i, so the lengths must match")
    if job.layerwise and job.dst is not LOAD:
        raise ValueError("layerwise applies to loads only (a store copies whole blocks)")
    for name, ids, limit in (("device block", job.device_blocks, num_blocks),
                             ("host slot", job.host_slots, num_slots)):
        if any(i < 0 for i in ids):
            raise ValueError(f"{name}s have a negative id: {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}s repeat an id: {ids}")
        if ids and max(ids) >= limit:
            raise ValueError(f"{name} {max(ids)} >= {limit} {name}s")
