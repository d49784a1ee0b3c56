"""Where each residency class's TTFT went: queue, tier and compute, as the engine measured.

`split_summary(records)` gives per class the p50 / p90 / mean of each part; `explain_gap`
names the part that makes two classes differ, so a bimodal TTFT is read for its cause (a
restore, a recompute, or a queue that only says the run was saturated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.engine.stats import summarize
from kvtier.sequence import SPLIT_PARTS
from kvtier.tier import Residency

BELOW_HOST = (Residency.DISK, Residency.SHARED)


def split_summary(records: Sequence[dict[str, Any]], classes: Sequence[str]
                  ) -> dict[str, dict[str, Any]]:
    """{class: {"count": n, part: {"p50", "p90", "mean"}}} over the records with a split."""
    out: dict[str, dict[str, Any]] = {}
    for cls in ("all", *classes):
        chosen = [r for r in records if r.get("queue_s") is not None
                  and r.get("ttft_s") is not None and cls in ("all", r["residency"])]
        entry: dict[str, Any] = {"count": len(chosen)}
        for part in SPLIT_PARTS:
            s = summarize([r[f"{part}_s"] for r in chosen])
            entry[part] = {"p50": s["p50"], "p90": s["p90"], "mean": s["mean"]}
        out[cls] = entry
    return out


def part_words(part: str, cls: str) -> str:
    """What a part is called for a class: the tier part of a host wake is its restore."""
    if part == "queue":
        return "queue wait"
    if part == "compute":
        return "compute"
    if cls == Residency.HOST:
        return "restore"
    if cls in BELOW_HOST:
        return f"fetch from {cls} and restore"
    if cls == Residency.RECOMPUTED:
        return "recompute"
    return "tier wait"


def explain_gap(split: dict[str, dict[str, Any]], slow: str, fast: str,
                saturated: bool) -> str:
    """'they differ by 610 ms of restore' for the part whose p50 differs most."""
    a, b = split.get(slow), split.get(fast)
    if not a or not b or not a["count"] or not b["count"]:
        return ""
    gaps = {part: (a[part]["p50"] or 0.0) - (b[part]["p50"] or 0.0) for part in SPLIT_PARTS}
    part = max(gaps, key=lambda k: gaps[k])
    if gaps[part] <= 0:
        return ""
    words = part_words(part, slow)
    text = (f"{slow} and {fast} differ by {gaps[part] * 1e3:.0f} ms of {words} "
            f"({part} p50 {(a[part]['p50'] or 0) * 1e3:.0f} vs "
            f"{(b[part]['p50'] or 0) * 1e3:.0f} ms)")
    if part == "queue":
        text += (": the run is saturated, not slowed by where the state lived" if saturated
                 else ": they waited for admission, not for their state")
    return text
