"""The tier's monotonic counters under the names vLLM's metrics carry (`stats.py` documents
them): a pure mapping from the tier's report, so it is testable without vLLM."""

from __future__ import annotations

from kvtier.tier import TierStats


def tier_counters(report: TierStats, world_size: int = 1) -> dict[str, float]:
    """Counters since start; keys with a tier (and a reason) carry them after '|'. Bytes are
    one rank's in the tier's report and all ranks' in vLLM's metrics."""
    s = report.transfers
    out: dict[str, float] = {
        "restore_bytes": s.loaded_bytes, "failed_loads": s.failed_loads,
        "stored_blocks": s.stored_blocks, "stored_bytes": s.stored_bytes,
        "failed_stores": s.failed_stores, "store_refused": s.store_refused}
    out.update({f"declined|{reason}": n for reason, n in report.declined.items()})
    b = report.below
    if b is not None:
        for name, counter in (("written_blocks", b.written_blocks),
                              ("written_bytes", b.written_bytes),
                              ("write_failures", b.write_failures),
                              ("fetched_blocks", b.fetched_blocks),
                              ("fetched_bytes", b.fetched_bytes),
                              ("renewed_blocks", b.renewed_blocks),
                              ("renew_failures", b.renew_failures)):
            out.update({f"{name}|{tier}": n for tier, n in counter.items()})
        for name, counter in (("miss_blocks", b.misses),
                              ("write_failure_blocks", b.write_failure_reasons)):
            for miss, n in counter.items():
                out[f"{name}|{miss.medium.value}|{miss.reason.value}"] = n
    out.update(tenant_counters(report))
    return {key: value * world_size if key.partition("|")[0].endswith("_bytes")
            else value for key, value in out.items()}


def tenant_counters(report: TierStats) -> dict[str, float]:
    """Per tenant label (bounded by `kv_tenant_labels`, the rest as "other"): blocks loaded
    for it from host, evicted per tier, and its retentions granted and refused by reason."""
    out: dict[str, float] = {}
    for tenant, counts in report.tenants.items():
        label = tenant.replace("|", "_")  # '|' separates a key's labels
        out[f"tenant_hits|{label}"] = counts.hits
        out[f"retention_granted|{label}"] = counts.retention_granted
        out.update({f"tenant_evictions|{label}|{tier}": n
                    for tier, n in counts.evictions.items()})
        out.update({f"retention_refused|{label}|{reason}": n
                    for reason, n in counts.retention_refused.items()})
    return out


class Reported:
    """The counters last reported, so each report carries what is new. A tenant that moves
    between its own label and "other" moves its counts with it; a counter that shrinks so
    reports nothing until it passes what was reported (counters never go down)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, now: dict[str, float]) -> dict[str, float]:
        """What grew since the last call."""
        delta = {}
        for key, value in now.items():
            before = self._last.get(key, 0)
            if value > before:
                delta[key] = value - before
                self._last[key] = value
        return delta
