"""Prometheus families for the server's `/metrics`, TTFT split by where the state lived.

One `Metrics` object owns a private `CollectorRegistry`; nothing is registered at import and
two objects never share a series. Primitives:

  observe_request(out)              a finished RequestOutput -> histograms and counters
  observe_error(code)               one request refused with an HTTP status (400, 404, 413 ...)
  refresh(stats, running, waiting, tier)  latest `stats.engine_stats(...)` snapshot and the
                                    tier's report -> gauges and counters (the tier's: one
                                    loop over `kvtier.tier.catalog`)
  render()                          (body, content type) for the HTTP response

Per-request families are live `prometheus_client` objects. Engine-wide values are read
from the snapshot the last `refresh` stored, by a collector at scrape time; the engine's
own monotonic numbers (link bytes, preemptions, failed transfers) are exposed as counters.
With the host tier off (`host_tier: None`) its families stay at 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.sequence import RESIDENCY_CLASSES, SPLIT_PARTS
from kvtier.tier import (
    ALWAYS_LABELLED,
    CATALOG,
    Family,
    Kind,
    Row,
    TierStats,
    counter_rows,
    label_text,
)

if TYPE_CHECKING:
    from kvtier.output import RequestOutput

PREFIX = "kvtier_"
FINISH_STATUSES = ("stop", "length", "abort", "error")
DIRECTIONS = ("store", "load")

# 5 ms .. 60 s: a resident prefix hit sits at the bottom, a long recompute at the top.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
                1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
# 1 ms .. 2.5 s per output token.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# 0 (nothing restored), then 64 KiB .. 16 GiB in steps of 4x.
RESTORE_BYTES_BUCKETS = (0.0, *(float(4**k * 64 * 1024) for k in range(10)))


class Metrics:
    """The server's Prometheus families on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time from arrival to first token, by where the request's prior state lived.",
            ["residency"], buckets=TTFT_BUCKETS, registry=r)
        self.ttft_part = Histogram(
            f"{PREFIX}time_to_first_token_part_seconds",
            "The TTFT split by the engine: queue (waiting to be admitted), tier (waiting for "
            "prior state: fetch, restore or its recompute), compute (the new tokens); by "
            "residency.", ["part", "residency"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Mean time between output tokens of one request, by residency.",
            ["residency"], buckets=ITL_BUCKETS, registry=r)
        self.restore_bytes = Histogram(
            f"{PREFIX}restore_bytes", "Bytes restored from the host tier per request.",
            buckets=RESTORE_BYTES_BUCKETS, registry=r)
        self.requests = Counter(
            f"{PREFIX}requests", "Finished requests by finish reason.", ["status"], registry=r)
        self.errors = Counter(
            f"{PREFIX}request_errors", "Requests refused, by HTTP status code.", ["code"],
            registry=r)
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Output tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(
            f"{PREFIX}cached_tokens", "Prompt tokens found in the device prefix cache.",
            registry=r)
        self.restored_tokens = Counter(
            f"{PREFIX}restored_tokens", "Prompt tokens whose KV was loaded from the host tier.",
            registry=r)
        self.swapped_in_tokens = Counter(
            f"{PREFIX}swapped_in_tokens", "Tokens of preempted requests' own state loaded back "
            "from the host tier.", registry=r)
        self.lossy_restores = Counter(
            f"{PREFIX}lossy_restores", "Requests restored from 8-bit blocks below host "
            "(kv_offload_dtype): close to, not bit-equal to, the exact KV.", registry=r)
        self.recomputed_tokens = Counter(
            f"{PREFIX}recomputed_tokens", "Tokens whose KV existed but was computed again.",
            registry=r)
        # Every label value exists from the start, so dashboards see 0 rather than no series.
        for cls in RESIDENCY_CLASSES:
            self.ttft.labels(residency=cls.value)
            self.itl.labels(residency=cls.value)
            for part in SPLIT_PARTS:
                self.ttft_part.labels(part=part, residency=cls.value)
        for status in FINISH_STATUSES:
            self.requests.labels(status=status)
        self._engine = EngineCollector()
        r.register(self._engine)

    def observe_request(self, out: RequestOutput) -> None:
        """Count one finished request; TTFT and ITL are skipped where their timing is None."""
        residency = str(out.residency)  # the label value: "host", not "Residency.HOST"
        m = out.metrics
        if m.ttft_s is not None:
            self.ttft.labels(residency=residency).observe(m.ttft_s)
            for part, value in m.parts().items():
                if value is not None:
                    self.ttft_part.labels(part=part, residency=residency).observe(value)
        if m.decode_s is not None and len(out.token_ids) > 1:
            self.itl.labels(residency=residency).observe(m.decode_s / (len(out.token_ids) - 1))
        self.restore_bytes.observe(out.restore_bytes)
        status = out.finish_reason if out.finish_reason in FINISH_STATUSES else (
            "abort" if out.finish_reason is None else "error")
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        self.cached_tokens.inc(out.num_cached_tokens)
        self.restored_tokens.inc(out.num_restored_tokens)
        self.swapped_in_tokens.inc(out.num_swapped_in_tokens)
        self.recomputed_tokens.inc(out.num_recomputed_tokens)
        if out.lossy:
            self.lossy_restores.inc()

    def observe_error(self, code: int) -> None:
        """Count one request the server refused with HTTP status `code`."""
        self.errors.labels(code=str(int(code))).inc()

    def refresh(self, stats: Mapping[str, Any], running: int = 0, waiting: int = 0,
                tier: TierStats | None = None) -> None:
        """Keep `engine_stats(...)`'s snapshot, the queue lengths and the tier's report (None:
        no tier) for the next scrape."""
        self._engine.update(stats, running, waiting, tier)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _num(d: Mapping[str, Any] | None, key: str) -> float:
    """`d[key]` as a float; 0 where the section or key is missing or None."""
    if not d:
        return 0.0
    v = d.get(key)
    return 0.0 if v is None else float(v)


def _family(kind: type, name: str, doc: str, label: str, values: Mapping[str, float]
            ) -> Metric:
    """One labelled gauge or counter family, a sample per label value."""
    family = kind(f"{PREFIX}{name}", doc, labels=[label])
    for value, number in values.items():
        family.add_metric([value], number)
    return family


def _catalog_families(tier_rows: Iterable[Row]) -> Iterator[Metric]:
    """Every family of the catalog kvtier serve exports, one loop: a sample per row (and at 0
    for the label values a family always carries), summed where rows share label values."""
    values: dict[Family, dict[tuple[str, ...], float]] = {
        family: {tuple(label_text(v) for v in always): 0.0
                 for always in ALWAYS_LABELLED.get(family, ())}
        for family in CATALOG if family.serve is not None}
    for row in tier_rows:
        samples = values.get(row.family)
        if samples is not None:
            samples[row.texts] = samples.get(row.texts, 0.0) + float(row.value)
    for family, samples in values.items():
        kind = CounterMetricFamily if family.kind is Kind.COUNTER else GaugeMetricFamily
        metric = kind(f"{PREFIX}{family.serve}", family.doc,
                      labels=[label.value for label in family.labels])
        for texts, number in samples.items():
            metric.add_metric(list(texts), number)
        yield metric


class EngineCollector:
    """Turns the last `engine_stats` snapshot into gauge and counter families at scrape time."""

    def __init__(self) -> None:
        self._stats: Mapping[str, Any] = {}
        self._rows: tuple[Row, ...] = ()
        self._running = 0
        self._waiting = 0

    def update(self, stats: Mapping[str, Any], running: int, waiting: int,
               tier: TierStats | None) -> None:
        self._stats, self._running, self._waiting = stats, running, waiting
        self._rows = tuple(counter_rows(tier)) if tier is not None else ()

    def describe(self) -> Iterator[Metric]:
        yield from self._families({}, (), 0, 0)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._stats, self._rows, self._running, self._waiting)

    @staticmethod
    def _families(s: Mapping[str, Any], tier_rows: tuple[Row, ...], running: int,
                  waiting: int) -> Iterator[Metric]:
        tier: Mapping[str, Any] = s.get("host_tier") or {}  # None: the tier is off
        link: Mapping[str, Any] = tier.get("link") or {}
        dev, slots, mem = s.get("device_blocks"), tier.get("slots"), tier.get("memory")
        pre = s.get("preemptions")
        yield _family(GaugeMetricFamily, "device_blocks", "Device KV blocks by state.", "state",
                      {k: _num(dev, k) for k in ("used", "cached", "total")})
        yield _family(GaugeMetricFamily, "host_slots", "Host tier slots by state.", "state",
                      {k: _num(slots, k) for k in ("used", "pinned", "capacity")})
        yield _family(GaugeMetricFamily, "host_pool_bytes",
                      "Host pool memory: allocated, pinned, and RSS growth at allocation.", "kind",
                      {k: _num(mem, f"{k}_bytes") for k in ("allocated", "pinned", "rss_growth")})
        yield _family(GaugeMetricFamily, "link_busy_fraction",
                      "Fraction of wall time the host link spent copying.", "direction",
                      {d: _num(link.get(d), "utilisation") for d in DIRECTIONS})
        yield _family(CounterMetricFamily, "link_bytes", "Bytes copied over the host link.",
                      "direction", {d: _num(link.get(d), "bytes") for d in DIRECTIONS})
        yield _family(CounterMetricFamily, "preemptions", "Preemptions by mode.", "mode",
                      {m: _num(pre, m) for m in ("swap", "recompute")})
        yield _family(CounterMetricFamily, "failed_transfers",
                      "Host tier transfers that failed (their tokens are recomputed).",
                      "direction", {"store": _num(tier, "failed_stores"),
                                    "load": _num(tier, "failed_loads")})
        yield from _catalog_families(tier_rows)
        yield GaugeMetricFamily(f"{PREFIX}requests_running", "Requests running now.",
                                value=running)
        yield GaugeMetricFamily(f"{PREFIX}requests_waiting", "Requests waiting to be admitted.",
                                value=waiting)
