"""/metrics as a scraper sees it: observe a few requests, refresh with a stats snapshot shaped
like `engine_stats`, render, and parse the text back with prometheus_client's own parser."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from kvtier.output import RequestMetrics, RequestOutput
from kvtier.server.metrics import Metrics
from kvtier.tier import BelowReport, Medium, Reason, TierStats, TransferCounts
from kvtier.tier.jobs import Miss
from kvtier.tier.report import IndexStats

GiB = 1 << 30


def request(rid: str, residency: str, *, ttft: float | None, decode: float | None,
            n_prompt: int, n_out: int, cached: int = 0, restored: int = 0,
            recomputed: int = 0, restore_bytes: int = 0,
            finish: str | None = "stop") -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt=None, prompt_token_ids=list(range(n_prompt)), text="",
        token_ids=list(range(n_out)), finish_reason=finish, stop_reason=None,
        num_cached_tokens=cached, logprobs=None,
        metrics=RequestMetrics(ttft_s=ttft, decode_s=decode, queue_s=0.0, num_preemptions=0,
                               restore_s=0.0),
        residency=residency, num_restored_tokens=restored, num_recomputed_tokens=recomputed,
        restore_bytes=restore_bytes)


def scrape(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one render, checking its content type."""
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def stats(host_tier: dict[str, Any] | None) -> dict[str, Any]:
    """The keys `engine_stats` builds (the ones /metrics reads, plus a few it ignores)."""
    return {
        "ttft_s": {"all": {"count": 0}}, "requests": 3,
        "device_blocks": {"total": 64, "used": 10, "cached": 7},
        "prefix_cache": {"lookups": 4, "hits": 2, "hit_rate": 0.5},
        "preemptions": {"total": 5, "swap": 3, "recompute": 2},
        "host_tier": host_tier,
    }


HOST_TIER = {
    "slots": {"used": 12, "capacity": 32, "pinned": 2},
    "occupancy": 12 / 32,
    "memory": {"num_slots": 32, "slot_bytes": GiB // 32, "allocated_bytes": GiB,
               "pinned_bytes": GiB, "rss_growth_bytes": GiB - 4096},
    "link": {
        "store": {"bytes": 3 << 20, "busy_s": 0.5, "utilisation": 0.25, "gbps": 6.3,
                  "jobs": 3, "failures": 1},
        "load": {"bytes": 1 << 20, "busy_s": 0.1, "utilisation": 0.05, "gbps": 10.5,
                 "jobs": 1, "failures": 0},
    },
    "stored_blocks": 12, "loaded_blocks": 4, "demoted_blocks": 0, "failed_transfers": 3,
    "failed_loads": 1, "failed_stores": 2, "store_refused": 0, "tier_hits": 4,
    "tier_evictions": 0, "planner": {"calibration": {}, "error": {}},
}


def observe_four(m: Metrics) -> None:
    # resident: prefix hit, fast first token; 5 tokens decoded in 0.04 s -> ITL 0.01 s
    m.observe_request(request("a", "resident", ttft=0.008, decode=0.04, n_prompt=16, n_out=5,
                              cached=16))
    # host: 32 tokens restored (2 MiB); two of them in the 0.2 s bucket
    m.observe_request(request("b", "host", ttft=0.12, decode=0.02, n_prompt=32, n_out=3,
                              restored=32, restore_bytes=2 << 20))
    m.observe_request(request("c", "host", ttft=0.18, decode=None, n_prompt=32, n_out=1,
                              restored=16, restore_bytes=1 << 20, finish="length"))
    # recomputed: 8 tokens computed again; cut off by the client
    m.observe_request(request("d", "recomputed", ttft=2.0, decode=0.3, n_prompt=8, n_out=4,
                              recomputed=8, finish="abort"))


def test_histograms_split_ttft_and_itl_by_residency() -> None:
    m = Metrics()
    observe_four(m)
    s = scrape(m)
    ttft = "kvtier_time_to_first_token_seconds"
    assert value(s, f"{ttft}_count", residency="resident") == 1
    assert value(s, f"{ttft}_count", residency="host") == 2
    assert value(s, f"{ttft}_count", residency="recomputed") == 1
    assert value(s, f"{ttft}_count", residency="new") == 0  # exists, at 0
    assert value(s, f"{ttft}_sum", residency="host") == pytest.approx(0.30)
    # buckets are cumulative: the resident one is under 10 ms, the host ones under 250 ms
    assert value(s, f"{ttft}_bucket", residency="resident", le="0.01") == 1
    assert value(s, f"{ttft}_bucket", residency="host", le="0.1") == 0
    assert value(s, f"{ttft}_bucket", residency="host", le="0.25") == 2
    assert value(s, f"{ttft}_bucket", residency="host", le="+Inf") == 2
    assert value(s, f"{ttft}_bucket", residency="resident", le="0.005") == 0
    assert value(s, f"{ttft}_bucket", residency="recomputed", le="60.0") == 1

    itl = "kvtier_inter_token_latency_seconds"
    # resident: 0.04 / 4; host: only "b" (0.02 / 2), "c" has one token; recomputed: 0.3 / 3
    assert value(s, f"{itl}_count", residency="resident") == 1
    assert value(s, f"{itl}_sum", residency="resident") == pytest.approx(0.01)
    assert value(s, f"{itl}_count", residency="host") == 1
    assert value(s, f"{itl}_sum", residency="host") == pytest.approx(0.01)
    assert value(s, f"{itl}_sum", residency="recomputed") == pytest.approx(0.1)

    rb = "kvtier_restore_bytes"
    # every request is observed, the two that restored nothing in the 0 bucket
    assert value(s, f"{rb}_count") == 4
    assert value(s, f"{rb}_sum") == 3 << 20
    assert value(s, f"{rb}_bucket", le="0.0") == 2
    assert value(s, f"{rb}_bucket", le=floatToGoString(1 << 20)) == 3
    assert value(s, f"{rb}_bucket", le=floatToGoString(4 << 20)) == 4
    assert value(s, f"{rb}_bucket", le=floatToGoString(16 * GiB)) == 4


def test_the_ttft_split_is_a_histogram_by_part_and_residency() -> None:
    m = Metrics()
    out = request("a", "host", ttft=0.3, decode=0.1, n_prompt=8, n_out=2)
    split = RequestMetrics(ttft_s=0.3, decode_s=0.1, queue_s=0.05, num_preemptions=0,
                           tier_s=0.2, compute_s=0.05)
    m.observe_request(dataclasses.replace(out, metrics=split))
    m.observe_request(request("b", "new", ttft=None, decode=None, n_prompt=4, n_out=0))
    s = scrape(m)
    name = "kvtier_time_to_first_token_part_seconds"
    for part, seconds in (("queue", 0.05), ("tier", 0.2), ("compute", 0.05)):
        assert value(s, f"{name}_count", part=part, residency="host") == 1
        assert value(s, f"{name}_sum", part=part, residency="host") == pytest.approx(seconds)
        assert value(s, f"{name}_count", part=part, residency="new") == 0  # no first token
    assert value(s, f"{name}_bucket", part="tier", residency="host", le="0.25") == 1
    assert value(s, f"{name}_bucket", part="tier", residency="host", le="0.15") == 0


def test_counters_add_up_tokens_statuses_and_errors() -> None:
    m = Metrics()
    observe_four(m)
    m.observe_error(400)
    m.observe_error(400)
    m.observe_error(413)
    s = scrape(m)
    assert value(s, "kvtier_requests_total", status="stop") == 2
    assert value(s, "kvtier_requests_total", status="length") == 1
    assert value(s, "kvtier_requests_total", status="abort") == 1
    assert value(s, "kvtier_requests_total", status="error") == 0
    assert value(s, "kvtier_request_errors_total", code="400") == 2
    assert value(s, "kvtier_request_errors_total", code="413") == 1
    assert value(s, "kvtier_prompt_tokens_total") == 16 + 32 + 32 + 8
    assert value(s, "kvtier_generation_tokens_total") == 5 + 3 + 1 + 4
    assert value(s, "kvtier_cached_tokens_total") == 16
    assert value(s, "kvtier_restored_tokens_total") == 48
    assert value(s, "kvtier_recomputed_tokens_total") == 8


def test_unknown_finish_reasons_stay_in_the_four_statuses() -> None:
    m = Metrics()
    m.observe_request(request("x", "new", ttft=None, decode=None, n_prompt=2, n_out=0,
                              finish=None))
    m.observe_request(request("y", "new", ttft=0.1, decode=0.0, n_prompt=2, n_out=2,
                              finish="something-else"))
    s = scrape(m)
    assert value(s, "kvtier_requests_total", status="abort") == 1
    assert value(s, "kvtier_requests_total", status="error") == 1
    # no TTFT for the request that never produced a token
    assert value(s, "kvtier_time_to_first_token_seconds_count", residency="new") == 1
    assert not any(k[0] == "kvtier_requests_total" and k[1] == (("status", "something-else"),)
                   for k in s)


def test_gauges_with_the_host_tier_off_stay_at_zero() -> None:
    m = Metrics()
    m.refresh(stats(None), running=3, waiting=1)
    s = scrape(m)
    assert value(s, "kvtier_device_blocks", state="used") == 10
    assert value(s, "kvtier_device_blocks", state="cached") == 7
    assert value(s, "kvtier_device_blocks", state="total") == 64
    assert value(s, "kvtier_preemptions_total", mode="swap") == 3
    assert value(s, "kvtier_preemptions_total", mode="recompute") == 2
    assert value(s, "kvtier_requests_running") == 3
    assert value(s, "kvtier_requests_waiting") == 1
    for state in ("used", "pinned", "capacity"):
        assert value(s, "kvtier_host_slots", state=state) == 0
    for kind in ("allocated", "pinned", "rss_growth"):
        assert value(s, "kvtier_host_pool_bytes", kind=kind) == 0
    for d in ("store", "load"):
        assert value(s, "kvtier_link_busy_fraction", direction=d) == 0
        assert value(s, "kvtier_link_bytes_total", direction=d) == 0
        assert value(s, "kvtier_failed_transfers_total", direction=d) == 0


def test_gauges_follow_a_populated_host_tier_and_the_latest_refresh() -> None:
    m = Metrics()
    m.refresh(stats(HOST_TIER), running=2, waiting=5)
    s = scrape(m)
    assert value(s, "kvtier_host_slots", state="used") == 12
    assert value(s, "kvtier_host_slots", state="pinned") == 2
    assert value(s, "kvtier_host_slots", state="capacity") == 32
    assert value(s, "kvtier_host_pool_bytes", kind="allocated") == GiB
    assert value(s, "kvtier_host_pool_bytes", kind="pinned") == GiB
    assert value(s, "kvtier_host_pool_bytes", kind="rss_growth") == GiB - 4096
    assert value(s, "kvtier_link_busy_fraction", direction="store") == 0.25
    assert value(s, "kvtier_link_busy_fraction", direction="load") == 0.05
    assert value(s, "kvtier_link_bytes_total", direction="store") == 3 << 20
    assert value(s, "kvtier_link_bytes_total", direction="load") == 1 << 20
    assert value(s, "kvtier_failed_transfers_total", direction="store") == 2
    assert value(s, "kvtier_failed_transfers_total", direction="load") == 1
    assert value(s, "kvtier_requests_running") == 2
    assert value(s, "kvtier_requests_waiting") == 5
    # the tier is turned off (a restart without it): its families go back to 0
    m.refresh(stats(None))
    s = scrape(m)
    assert value(s, "kvtier_host_slots", state="used") == 0
    assert value(s, "kvtier_link_bytes_total", direction="store") == 0
    assert value(s, "kvtier_requests_running") == 0


def test_families_are_typed_and_prefixed_before_any_refresh() -> None:
    body, _ = Metrics().render()
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert all(name.startswith("kvtier_") for name in families)
    assert families["kvtier_time_to_first_token_seconds"] == "histogram"
    assert families["kvtier_restore_bytes"] == "histogram"
    assert families["kvtier_requests"] == "counter"
    assert families["kvtier_link_bytes"] == "counter"
    assert families["kvtier_device_blocks"] == "gauge"
    assert families["kvtier_requests_waiting"] == "gauge"


def test_two_metrics_objects_share_nothing() -> None:
    # a registry of its own each: building a second one neither collides nor sees the first
    a, b = Metrics(), Metrics()
    observe_four(a)
    a.observe_error(404)
    a.refresh(stats(HOST_TIER), running=1)
    sa, sb = scrape(a), scrape(b)
    assert value(sa, "kvtier_time_to_first_token_seconds_count", residency="host") == 2
    assert value(sb, "kvtier_time_to_first_token_seconds_count", residency="host") == 0
    assert value(sb, "kvtier_requests_total", status="stop") == 0
    assert value(sb, "kvtier_prompt_tokens_total") == 0
    assert value(sb, "kvtier_device_blocks", state="total") == 0
    assert value(sb, "kvtier_requests_running") == 0
    assert ("kvtier_request_errors_total", (("code", "404"),)) not in sb


def tier_report(below: BelowReport | None = None, **declined: int) -> TierStats:
    """A tier's report with `below` (None: no tier below host) and these declines."""
    return TierStats(host=IndexStats(), transfers=TransferCounts(), calibration={},
                     prediction_error={}, below=below, declined=declined)


def below_report(**fields: Any) -> BelowReport:
    empty: dict[str, Any] = {}
    base: dict[str, Any] = dict(
        written_blocks=empty, written_bytes=empty, write_failures=empty, fetched_blocks=empty,
        fetched_bytes=empty, fetch_seconds=empty, misses=empty, refused=0, encoding="",
        stores=empty, lookups_answered_absent=0)
    return BelowReport(**{**base, **fields})


def test_deep_tier_traffic_and_every_refused_block_are_counted() -> None:
    m = Metrics()
    below = below_report(
        written_blocks={"disk": 12, "remote": 4}, write_failures={"remote": 3},
        fetched_blocks={"disk": 6}, fetch_seconds={"disk": 0.5},
        misses={Miss(Medium.DISK, Reason.CHECKSUM): 1, Miss(Medium.REDIS, Reason.UNAVAILABLE): 2},
        stores={"disk": IndexStats(used=12, capacity=100)})
    m.refresh(stats(HOST_TIER), tier=tier_report(below, slower=2))
    s = scrape(m)
    expected = {
        ("kvtier_tier_blocks_written_total", "disk"): 12,
        ("kvtier_tier_blocks_written_total", "remote"): 4,
        ("kvtier_tier_write_failures_total", "remote"): 3,
        ("kvtier_tier_write_failures_total", "disk"): 0,
        ("kvtier_tier_blocks_fetched_total", "disk"): 6,
        ("kvtier_tier_fetch_seconds_total", "disk"): 0.5,
        ("kvtier_tier_fetch_seconds_total", "remote"): 0,
    }
    for (name, tier), count in expected.items():
        assert value(s, name, tier=tier) == count, (name, tier)
    for (tier, reason), count in {("disk", "checksum"): 1, ("remote", "unavailable"): 2}.items():
        assert value(s, "kvtier_tier_misses_total", tier=tier, reason=reason) == count
    assert {state: value(s, "kvtier_disk_slots", state=state) for state in ("used", "capacity")
            } == {"used": 12, "capacity": 100}
    assert value(s, "kvtier_declined_total", reason="slower") == 2
    assert value(s, "kvtier_declined_total", reason="inflight") == 0  # every reason, at 0
    m.refresh(stats(HOST_TIER), tier=tier_report())  # no tier below host: traffic reads 0
    s = scrape(m)
    assert value(s, "kvtier_tier_blocks_written_total", tier="disk") == 0
