"""What a transfer job is asked to do and what it reports: the objects handed to the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Direction(str, enum.Enum):
    """Which way the bytes go; the value is the name used in stats and metrics."""

    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device


@dataclass(frozen=True)
class TransferSpec:
    """Copy `device_blocks[i]` <-> `host_slots[i]` for every i, in the given direction.

    `layerwise` (loads only) copies layer 0 of every block, then layer 1, ... and signals each
    layer's arrival, so a forward pass can start on layer l before the later layers are in.
    """

    direction: Direction
    device_blocks: tuple[int, ...]
    host_slots: tuple[int, ...]
    layerwise: bool = False

    def __post_init__(self) -> None:
        # Accept the plain strings too; normalise so comparisons and stats see one type.
        object.__setattr__(self, "direction", Direction(self.direction))
        object.__setattr__(self, "device_blocks", tuple(int(b) for b in self.device_blocks))
        object.__setattr__(self, "host_slots", tuple(int(s) for s in self.host_slots))
        if len(self.device_blocks) != len(self.host_slots):
            raise ValueError(
                f"{len(self.device_blocks)} device blocks but {len(self.host_slots)} host slots; "
                "block i goes to slot i, so the lengths must match"
            )
        if self.layerwise and self.direction is not Direction.LOAD:
            raise ValueError("layerwise applies to loads only (a store copies whole blocks)")
        for name, ids in (("device_blocks", self.device_blocks), ("host_slots", self.host_slots)):
            if any(i < 0 for i in ids):
                raise ValueError(f"{name} has a negative id: {ids}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{name} repeats an id: {ids}")

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks)


@dataclass(frozen=True)
class TransferResult:
    """How one job ended. A failed job's partial writes are the caller's to discard."""

    job_id: int
    spec: TransferSpec
    success: bool
    bytes: int  # bytes actually copied (for a failed job: before the failure)
    seconds: float  # wall time from the job's first copy starting to its last one finishing
    error: str | None = None
    finished_at: float = 0.0  # time.perf_counter() when the worker saw it end (0: unknown)


@dataclass(frozen=True)
class DirectionStats:
    """Counters of one direction since construction or the last `reset_stats()`."""

    bytes: int  # bytes copied, failed jobs' partial copies included
    busy_s: float  # time spent copying in this direction
    jobs: int  # jobs finished, failed ones included
    failures: int
    utilisation: float  # busy_s / elapsed_s

    @property
    def gbps(self) -> float:
        """Achieved GB/s while busy (0 when nothing was copied)."""
        return self.bytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0


@dataclass
class DirectionCounter:
    """The engine's running counters of one direction; `freeze` turns them into stats."""

    bytes: int = 0
    busy_s: float = 0.0
    jobs: int = 0
    failures: int = 0

    def freeze(self, elapsed_s: float) -> DirectionStats:
        util = self.busy_s / elapsed_s if elapsed_s > 0 else 0.0
        return DirectionStats(self.bytes, self.busy_s, self.jobs, self.failures, util)


@dataclass(frozen=True)
class TransferStats:
    """Both directions and the window they were counted over."""

    elapsed_s: float
    store: DirectionStats
    load: DirectionStats

    def as_dict(self) -> dict[str, float]:
        """Flat `{"store_bytes": ..., "load_utilisation": ...}` for metrics and JSON."""
        out: dict[str, float] = {"elapsed_s": self.elapsed_s}
        for name, d in (("store", self.store), ("load", self.load)):
            out |= {
                f"{name}_bytes": d.bytes,
                f"{name}_busy_s": d.busy_s,
                f"{name}_jobs": d.jobs,
                f"{name}_failures": d.failures,
                f"{name}_utilisation": d.utilisation,
            }
        return out


Fault = Callable[[TransferSpec, int], bool]  # test hook: (spec, step index) -> True fails it


class InjectedFault(RuntimeError):
    """Raised inside the worker when the `fault` hook asks a step to fail."""
