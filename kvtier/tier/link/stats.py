"""What the device <-> host link reports of itself: bytes, busy time and jobs per direction."""

from __future__ import annotations

from dataclasses import dataclass


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
