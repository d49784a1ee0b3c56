"""What `kvtier.plan.simulate` returns: one record per turn and the per-class summaries.

Primitives: `TurnRequest` (the trace rows it reads), `SimRecord`, `SimResult`, and
`summarize(records, ...)`, which builds the TTFT and queue/tier/compute tables with the same
nearest-rank percentiles `kvtier bench` reports, so plan and bench compare like with like.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvtier.engine.stats import percentile
from kvtier.sequence import RESIDENCY_CLASSES, SPLIT_PARTS
from kvtier.tier import Residency


class TurnRequest(Protocol):
    """One turn of a session, as `kvtier.bench.trace.TraceRequest` has it."""

    @property
    def session_id(self) -> Hashable: ...
    @property
    def turn(self) -> int: ...
    @property
    def arrival_s(self) -> float: ...  # turn 0: absolute; later: think time after the last
    @property
    def new_tokens(self) -> Sequence[int]: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True)
class SimTurn:
    """A turn made up rather than read from a trace (a load a benchmark or test builds)."""

    session_id: Hashable
    turn: int
    arrival_s: float  # turn 0: absolute; later: think time after the last
    new_tokens: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class SimRecord:
    """One simulated turn; queue_s + tier_s + compute_s == ttft_s (within float rounding)."""

    session_id: Hashable
    turn: int
    residency: Residency
    arrival_s: float
    ttft_s: float
    context: int  # tokens of prior state the turn found (0 for a new session)
    link_wait_s: float  # time queued behind other transfers before its restore started
    finish_s: float  # last output token
    queue_s: float = 0.0  # waiting to be admitted or for the compute the turn needs
    tier_s: float = 0.0  # admitted -> prior state ready (restore, or its recompute's share)
    compute_s: float = 0.0  # computing the new tokens, in a step shared with others


Split = dict[str, dict[str, dict[str, float | None]]]  # class -> part -> p50 / p90


@dataclass(frozen=True)
class SimResult:
    records: tuple[SimRecord, ...]
    ttft: dict[str, dict[str, float | int | None]]  # class -> count, p50, p99
    split: Split  # class -> queue | tier | compute -> p50, p90 (seconds)
    link_busy_s: float
    stores: int
    restores: int
    makespan_s: float
    compute_busy_s: float  # the compute server's (GPU) or engine steps' (shared) busy time
    compute_utilisation: float  # compute_busy_s / makespan_s (0 for an empty trace)
    idle_demotions: int = 0  # sessions moved to host by idle_offload_s
    declined: dict[str, int] = field(default_factory=dict)  # restores declined, by reason

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft, "split_s": self.split, "link_busy_s": self.link_busy_s,
                "stores": self.stores, "restores": self.restores,
                "idle_demotions": self.idle_demotions, "declined": self.declined,
                "makespan_s": self.makespan_s,
                "compute_busy_s": self.compute_busy_s,
                "compute_utilisation": self.compute_utilisation,
                "requests": [asdict(r) for r in self.records]}


def _in_class(cls: str, record: SimRecord) -> bool:
    return cls in ("all", record.residency)


def ttft_table(records: Sequence[SimRecord]) -> dict[str, dict[str, float | int | None]]:
    """Count, p50 and p99 of TTFT for "all" and every residency class (None where empty)."""
    table: dict[str, dict[str, float | int | None]] = {}
    for cls in ("all", *(c.value for c in RESIDENCY_CLASSES)):
        values = [r.ttft_s for r in records if _in_class(cls, r)]
        table[cls] = {"count": len(values), "p50": percentile(values, 50),
                      "p99": percentile(values, 99)}
    return table


def split_table(records: Sequence[SimRecord]) -> Split:
    """p50 and p90 of each TTFT part per class: the shape of the bench summary's split_s."""
    table: Split = {}
    for cls in ("all", *(c.value for c in RESIDENCY_CLASSES)):
        chosen = [r for r in records if _in_class(cls, r)]
        table[cls] = {}
        for part in SPLIT_PARTS:
            values = [getattr(r, f"{part}_s") for r in chosen]
            table[cls][part] = {"p50": percentile(values, 50), "p90": percentile(values, 90)}
    return table


def summarize(records: Sequence[SimRecord], link_busy_s: float, stores: int, restores: int,
              compute_busy_s: float, idle_demotions: int,
              declined: dict[str, int] | None = None) -> SimResult:
    """The result of one run: tables from the records, utilisation over the makespan."""
    makespan = max((r.finish_s for r in records), default=0.0)
    return SimResult(
        records=tuple(records), ttft=ttft_table(records), split=split_table(records),
        link_busy_s=link_busy_s, stores=stores, restores=restores, makespan_s=makespan,
        compute_busy_s=compute_busy_s,
        compute_utilisation=compute_busy_s / makespan if makespan > 0 else 0.0,
        idle_demotions=idle_demotions, declined=dict(declined or {}),
    )
