"""Engine-wide numbers for `LLM.stats()`: TTFT split by where the state lived, the tier's
traffic, and the planner's own error. Latency under a host tier is bimodal, so no single
percentile is reported without its split."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.output import RequestOutput
from kvtier.sequence import RESIDENCY_CLASSES


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
            out[cls] = summarize([o.metrics.ttft_s for o in self.outputs
                                  if o.residency == cls and o.metrics.ttft_s is not None])
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


def engine_stats(engine: Any, log: RequestLog) -> dict[str, Any]:
    """Everything `LLM.stats()` reports, as plain JSON-able values."""
    pool, sched = engine.pool, engine.scheduler
    report: dict[str, Any] = {
        "ttft_s": log.ttft_by_class(),
        **log.restore_summary(),
        "device_blocks": {"total": pool.num_blocks, "used": pool.num_used,
                          "cached": pool.num_cached},
        "prefix_cache": {"lookups": pool.stats.lookups, "hits": pool.stats.hits,
                         "hit_rate": pool.stats.hits / pool.stats.lookups
                         if pool.stats.lookups else 0.0},
        "preemptions": {"total": sched.stats.num_preemptions, "swap": sched.stats.num_swaps,
                        "recompute": sched.stats.num_recompute_preemptions},
    }
    tier = engine.tier
    if tier is None:
        report["host_tier"] = report["tiers_below_host"] = None
        return report
    t = tier.transfer.stats()
    ts = tier.offload.tier.stats
    os_ = tier.offload.stats
    report["host_tier"] = {
        "slots": {"used": ts.used, "capacity": ts.capacity, "pinned": ts.pinned},
        "occupancy": ts.used / ts.capacity if ts.capacity else 0.0,
        "memory": tier.host.stats(),
        "link": {d: {"bytes": s.bytes, "busy_s": s.busy_s, "utilisation": s.utilisation,
                     "gbps": s.gbps, "jobs": s.jobs, "failures": s.failures}
                 for d, s in (("store", t.store), ("load", t.load))},
        "stored_blocks": os_.stored_blocks, "loaded_blocks": os_.loaded_blocks,
        "demoted_blocks": os_.demoted_blocks, "failed_transfers": os_.failed_stores
        + os_.failed_loads, "failed_loads": os_.failed_loads,
        "failed_stores": os_.failed_stores, "store_refused": os_.store_refused,
        "tier_hits": ts.hits, "tier_evictions": ts.evictions,
        "planner": {"calibration": vars(tier.offload.planner.calibration),
                    "error": tier.offload.planner.error_report()},
    }
    report["tiers_below_host"] = tier.deep.stats() if tier.deep is not None else None
    return report
