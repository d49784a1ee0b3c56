"""Engine-wide numbers for `LLM.stats()`: TTFT split by where the state lived, the tier's
traffic, and the planner's own error. Latency under a host tier is bimodal, so no single
percentile is reported without its split."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.output import RequestOutput
from kvtier.sequence import RESIDENCY_CLASSES, SPLIT_PARTS
from kvtier.tier import Medium, TierStats


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered) / 100) - 1))
    return ordered[rank]


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"count": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "mean": statistics.fmean(values) if values else None}


@dataclass
class RequestLog:
    """Finished requests' outcomes, kept as numbers (no tokens) for reports."""

    outputs: list[RequestOutput] = field(default_factory=list)

    def add(self, outputs: Sequence[RequestOutput]) -> None:
        self.outputs.extend(outputs)

    def ttft_by_class(self) -> dict[str, dict[str, float | int | None]]:
        out = {"all": summarize([o.metrics.ttft_s for o in self.outputs
                                 if o.metrics.ttft_s is not None])}
        for cls in RESIDENCY_CLASSES:
            out[cls.value] = summarize([o.metrics.ttft_s for o in self.outputs
                                        if o.residency == cls and o.metrics.ttft_s is not None])
        return out

    def split_by_class(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """Per residency class (and "all"): queue, tier and compute parts of the TTFT."""
        out = {}
        for cls in ("all", *(c.value for c in RESIDENCY_CLASSES)):
            chosen = [o.metrics.parts() for o in self.outputs if o.metrics.ttft_s is not None
                      and cls in ("all", o.residency)]
            out[cls] = {part: summarize([v for p in chosen if (v := p[part]) is not None])
                        for part in SPLIT_PARTS}
        return out

    def restore_summary(self) -> dict[str, Any]:
        n = len(self.outputs)
        restored = [o for o in self.outputs if o.num_restored_tokens]
        return {
            "requests": n,
            "restore_bytes_per_request": sum(o.restore_bytes for o in self.outputs) / n if n else 0,
            "restored_tokens": sum(o.num_restored_tokens for o in self.outputs),
            "recomputed_tokens": sum(o.num_recomputed_tokens for o in self.outputs),
            "cached_tokens": sum(o.num_cached_tokens for o in self.outputs),
            "requests_restored": len(restored),
            "requests_restored_lossy": sum(1 for o in restored if o.lossy),
        }


def engine_stats(engine: Any, log: RequestLog, tier_report: TierStats | None = None
                 ) -> dict[str, Any]:
    """Everything `LLM.stats()` reports, as plain JSON-able values (`tier_report`: the tier's
    report when the caller took it already, for `/metrics`' own loop)."""
    pool, sched = engine.pool, engine.scheduler
    report: dict[str, Any] = {
        "ttft_s": log.ttft_by_class(),
        "ttft_split_s": log.split_by_class(),
        **log.restore_summary(),
        "device_blocks": {"total": pool.num_blocks, "used": pool.num_used,
                          "cached": pool.num_cached},
        "prefix_cache": {"lookups": pool.stats.lookups, "hits": pool.stats.hits,
                         "hit_rate": pool.stats.hits / pool.stats.lookups
                         if pool.stats.lookups else 0.0},
        "preemptions": {"total": sched.stats.num_preemptions, "swap": sched.stats.num_swaps,
                        "recompute": sched.stats.num_recompute_preemptions},
        "busy_s": engine.busy_s,  # time in steps that ran a batch
    }
    tier = engine.tier
    if not tier.enabled:
        report["host_tier"] = report["tiers_below_host"] = None
        return report
    ms, wr = tier_report or tier.report(), tier.worker_report()
    ts, t, counts = ms.host, wr.link, ms.transfers
    report["host_tier"] = {
        "slots": {"used": ts.used, "capacity": ts.capacity, "pinned": ts.pinned},
        "occupancy": ts.used / ts.capacity if ts.capacity else 0.0,
        "memory": dict(wr.memory),
        "link": {d: {"bytes": s.bytes, "busy_s": s.busy_s, "utilisation": s.utilisation,
                     "gbps": s.gbps, "jobs": s.jobs, "failures": s.failures}
                 for d, s in (("store", t.store), ("load", t.load))},
        "stored_blocks": counts.stored_blocks, "loaded_blocks": counts.loaded_blocks,
        "demoted_blocks": tier.demoted_blocks,
        "failed_transfers": counts.failed_stores + counts.failed_loads,
        "failed_loads": counts.failed_loads, "failed_stores": counts.failed_stores,
        "store_refused": counts.store_refused, "tier_hits": ts.hits,
        "tier_evictions": ts.evictions,
        "declined": dict(ms.declined),  # admitted requests per reason they recomputed
        "planner": {"calibration": dict(ms.calibration), "error": dict(ms.prediction_error)},
        "tenants": tenant_stats(ms),
    }
    report["tiers_below_host"] = below_host_stats(ms, wr.stores)
    return report


def tenant_stats(ms: TierStats) -> dict[str, Any]:
    """Per tenant label (bounded by `kv_tenant_labels`): bytes held and retained and blocks
    evicted per tier, blocks loaded from host, retention asked, granted or refused, and
    blocks its prefetches brought up or were refused for its budget."""
    size = ms.slot_bytes
    return {label: {"held_bytes": {t: n * size for t, n in c.held.items()},
                    "retained_bytes": {t: n * size for t, n in c.retained.items()},
                    "evicted_blocks": dict(c.evictions), "hit_blocks": c.hits,
                    "retention_granted": c.retention_granted,
                    "retention_refused": dict(c.retention_refused),
                    "prefetched_blocks": c.prefetched,
                    "prefetch_limited_blocks": c.prefetch_limited}
            for label, c in ms.tenants.items()}


def below_host_stats(ms: TierStats, stores: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stores below host: traffic, misses by reason and read rates by medium, and one
    row per store (occupancy, hits, and what its bytes side says of itself)."""
    b = ms.below
    if b is None:
        return None
    out: dict[str, Any] = {
        "written_blocks": dict(b.written_blocks), "written_bytes": dict(b.written_bytes),
        "write_failures": dict(b.write_failures),
        "write_failure_reasons": {str(m): n for m, n in b.write_failure_reasons.items()},
        "renewed_blocks": dict(b.renewed_blocks), "renew_failures": dict(b.renew_failures),
        "erased_blocks": dict(b.erased_blocks), "erase_failures": dict(b.erase_failures),
        "encoding": b.encoding or None,
        "fetched_blocks": dict(b.fetched_blocks), "fetched_bytes": dict(b.fetched_bytes),
        "fetch_seconds": dict(b.fetch_seconds),
        "misses": {str(m): n for m, n in b.misses.items()}, "refused": b.refused,
        "tier_gbps": dict(ms.calibration["tier_gbps"]),
    }
    for medium, index in b.stores.items():
        row: dict[str, Any] = {"hits": index.hits, "stores": index.stores}
        if index.capacity:  # a store of slots (disk); a shared one evicts by itself
            row.update(used_slots=index.used, capacity_slots=index.capacity,
                       evictions=index.evictions)
        if Medium(medium).shared:  # its presence is asked of other instances' writes
            row["lookups_answered_absent"] = index.answered_absent
        out[medium] = {**row, **stores.get(medium, {})}
    return out
