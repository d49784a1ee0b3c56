"""The tier's counters as vLLM's connector reports them: counts keyed by (family, label
values) while they are kept, and nested where they cross vLLM's processes (`nest`): a
family's key, then one level per label, then the number. vLLM sums those reports
(`merge`) and its Prometheus logger walks them (`unnest`) by the catalog's labels: nothing is
parsed out of a string. Pure, so it is testable without vLLM."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvtier.tier import BY_VLLM_KEY, Family, TierStats, counter_rows

Count = tuple[Family, tuple[str, ...]]  # a vLLM family and its label values


def tier_counters(report: TierStats, world_size: int = 1) -> dict[Count, float]:
    """The report's vLLM counters since start. Bytes are one rank's in the tier's report and
    all ranks' in vLLM's metrics."""
    out: dict[Count, float] = {}
    for row in counter_rows(report):
        if row.family.vllm is not None:
            scale = world_size if row.family.per_rank_bytes else 1
            out[(row.family, row.texts)] = row.value * scale
    return out


def nest(counts: Mapping[Count, float]) -> dict[str, Any]:
    """The connector's report: {key: number} or {key: {label: ... {label: number}}}; zeros
    left out."""
    data: dict[str, Any] = {}
    for (family, labels), value in counts.items():
        if not value or family.vllm is None:
            continue
        if not labels:
            data[family.vllm] = data.get(family.vllm, 0) + value
            continue
        level = data.setdefault(family.vllm, {})
        for label in labels[:-1]:
            level = level.setdefault(label, {})
        level[labels[-1]] = level.get(labels[-1], 0) + value
    return data


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Sum `other` (a nested report) into `into`, level by level."""
    for key, value in other.items():
        if isinstance(value, Mapping):
            mine = into.get(key)
            into[key] = merge(mine if isinstance(mine, dict) else {}, value)
        else:
            mine = into.get(key, 0)
            into[key] = (mine if not isinstance(mine, dict) else 0) + value
    return into


def unnest(data: Mapping[str, Any]) -> Iterator[tuple[Family, tuple[str, ...], float]]:
    """Each number of a nested report with its family and label values; a key the catalog
    does not have, or nested deeper or shallower than its labels, is skipped (a report from
    another version of kvtier)."""
    for key, value in data.items():
        family = BY_VLLM_KEY.get(key)
        if family is not None:
            yield from _walk(family, value, (), len(family.labels))


def _walk(family: Family, value: Any, labels: tuple[str, ...], depth: int
          ) -> Iterator[tuple[Family, tuple[str, ...], float]]:
    if depth == 0:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield family, labels, float(value)
        return
    if isinstance(value, Mapping):
        for label, inner in value.items():
            yield from _walk(family, inner, (*labels, str(label)), depth - 1)


def flat(data: Mapping[str, Any]) -> dict[str, float]:
    """A nested report as one line's items, for vLLM's log: `miss_blocks{tier=disk,reason=
    checksum}`. Written for a reader, never parsed."""
    out: dict[str, float] = {}
    for family, labels, value in unnest(data):
        name = family.vllm or ""
        if labels:
            name += "{" + ",".join(f"{label.value}={text}" for label, text
                                   in zip(family.labels, labels)) + "}"
        out[name] = round(value, 6)
    return out


class Reported:
    """The counters last reported, so each report carries what is new. A tenant that moves
    between its own label and "other" moves its counts with it; a counter that shrinks so
    reports nothing until it passes what was reported (counters never go down)."""

    def __init__(self) -> None:
        self._last: dict[Count, float] = {}

    def take(self, now: Mapping[Count, float]) -> dict[Count, float]:
        """What grew since the last call."""
        delta = {}
        for key, value in now.items():
            before = self._last.get(key, 0)
            if value > before:
                delta[key] = value - before
                self._last[key] = value
        return delta
