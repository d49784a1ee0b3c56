"""What the tier's scheduler side reports of itself, as frozen snapshots.

`TierManager.report() -> TierStats` (as vLLM's `OffloadingManager.get_stats()`): the host
index's occupancy, the device <-> host jobs by outcome, the planner's calibration and its
prediction error, and the traffic below host per medium with misses by medium and reason.
`LLM.stats()`, `/metrics` and the vLLM connector's counters are all views of it, so no
client reads the manager's parts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.tier.jobs import Miss


@dataclass
class TenantCounts:
    """One tenant's blocks, per tier (medium value), and what it asked for."""

    held: Counter[str] = field(default_factory=Counter)  # blocks held now
    retained: Counter[str] = field(default_factory=Counter)  # of those, retained now
    evictions: Counter[str] = field(default_factory=Counter)  # blocks evicted so far
    hits: int = 0  # blocks loaded for it from host
    retention_granted: int = 0  # retention requests granted
    retention_refused: Counter[str] = field(default_factory=Counter)  # by reason
    prefetched: int = 0  # blocks its prefetches brought up from below host
    prefetch_limited: int = 0  # blocks its prefetches asked for past its prefetch budget

    def add(self, other: TenantCounts) -> None:
        """Fold another tenant's counts into these (the `other` label)."""
        for mine, theirs in ((self.held, other.held), (self.retained, other.retained),
                             (self.evictions, other.evictions),
                             (self.retention_refused, other.retention_refused)):
            mine.update(theirs)
        self.hits += other.hits
        self.retention_granted += other.retention_granted
        self.prefetched += other.prefetched
        self.prefetch_limited += other.prefetch_limited


@dataclass
class IndexStats:
    """Counters (monotonic, in keys) and gauges a benchmark or /metrics reads."""

    lookups: int = 0  # keys examined by lookup (up to and including the first miss)
    hits: int = 0  # keys found complete and confirmed
    stores: int = 0  # keys whose store completed successfully
    store_failures: int = 0  # keys whose store failed and were forgotten
    loads: int = 0  # keys whose load completed successfully
    load_failures: int = 0  # keys whose load was reported failed
    evictions: int = 0  # keys evicted to make room for a store
    collisions: int = 0  # key matched but stored token ids did not (never served)
    used: int = 0  # gauge: slots holding a key (complete or storing)
    capacity: int = 0  # gauge: slots in the tier
    pinned: int = 0  # gauge: slots pinned by an in-flight store or load
    # presence questions a shared store failed whole, and lookups one of its shards cut short
    answered_absent: int = 0


@dataclass
class TransferCounts:
    """Device <-> host jobs by outcome, monotonic (the manager's own counters)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    store_refused: int = 0  # stores the host tier could not make room for


@dataclass(frozen=True)
class BelowReport:
    """The tiers below host: traffic per medium value ("disk", "remote"), misses by store
    and reason (`Miss`), and each index's occupancy."""

    written_blocks: Mapping[str, int]
    written_bytes: Mapping[str, int]  # as stored (8-bit where the host encodes)
    write_failures: Mapping[str, int]
    fetched_blocks: Mapping[str, int]
    fetched_bytes: Mapping[str, int]
    fetch_seconds: Mapping[str, float]  # the hops' I/O time: fetched_bytes / this = GB/s
    misses: Mapping[Miss, int]  # blocks found but not served
    refused: int  # writes or fetches the host or disk tier had no room for
    encoding: str  # "" exact, else the lossy encoding of every block below host
    stores: Mapping[str, IndexStats]  # each tier below host's index, by medium value
    lookups_answered_absent: int  # remote presence questions a failing store answered
    # blocks a tier failed to take, by store and reason (write_failures' split)
    write_failure_reasons: Mapping[Miss, int] = field(default_factory=dict)
    # blocks a store that expires them kept longer for a retention granted after their write
    renewed_blocks: Mapping[str, int] = field(default_factory=dict)
    renew_failures: Mapping[str, int] = field(default_factory=dict)
    # blocks a purge erased (a shared store: keys it was told to delete), and failed to
    erased_blocks: Mapping[str, int] = field(default_factory=dict)
    erase_failures: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TierStats:
    """One snapshot of the tier's scheduler side."""

    host: IndexStats
    transfers: TransferCounts  # a copy: later jobs do not change it
    calibration: Mapping[str, Any]  # the planner's numbers now (tier_gbps among them)
    prediction_error: Mapping[str, Mapping[str, float | int]]  # per kind: count, errors
    below: BelowReport | None
    # admitted requests that recomputed tokens found in the tier, per Decline value
    declined: Mapping[str, int] = field(default_factory=dict)
    # requests that waited for blocks still being written, and seconds, per Wait value
    waited: Mapping[str, int] = field(default_factory=dict)
    wait_seconds: Mapping[str, float] = field(default_factory=dict)
    # per tenant label (bounded: `kv_tenant_labels`, the rest as "other"), in blocks
    tenants: Mapping[str, TenantCounts] = field(default_factory=dict)
    slot_bytes: int = 0  # bytes of one block in a host slot or below (blocks -> bytes)
