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
                              ("fetched_bytes", b.fetched_bytes)):
            out.update({f"{name}|{tier}": n for tier, n in counter.items()})
        for name, counter in (("miss_blocks", b.misses),
                              ("write_failure_blocks", b.write_failure_reasons)):
            for miss, n in counter.items():
                out[f"{name}|{miss.medium.value}|{miss.reason.value}"] = n
    return {key: value * world_size if key.partition("|")[0].endswith("_bytes")
            else value for key, value in out.items()}
