"""The counter catalog: every family name and label users scrape today, under vLLM
(`vllm:kvtier_*_total`) and under `kvtier serve` (`/metrics`), held literally, so a rename or
a lost label fails here; and the report's rows carry typed labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvtier.server.metrics import Metrics
from kvtier.tier import CATALOG, Decline, Medium, Reason
from kvtier.tier.catalog import DECLINED, MISS_BLOCKS, TENANT_BYTES, rows
from kvtier.tier.jobs import Miss
from kvtier.tier.report import BelowReport, IndexStats, TenantCounts, TierStats, TransferCounts

# vllm:kvtier_<name>_total and the labels after vLLM's own (model_name, engine)
VLLM_FAMILIES = {
    "lookup_tokens": (), "restored_tokens": (), "declined_tokens": (), "restore_bytes": (),
    "restore_seconds": (), "lossy_restored_tokens": (), "failed_loads": (),
    "stored_blocks": (), "stored_bytes": (), "failed_stores": (), "store_refused": (),
    "cache_resets": (), "reset_dropped_host_blocks": (), "step_seconds": (),
    "written_blocks": ("tier",), "written_bytes": ("tier",), "write_failures": ("tier",),
    "fetched_blocks": ("tier",), "fetched_bytes": ("tier",), "fetch_seconds": ("tier",),
    "renewed_blocks": ("tier",),
    "renew_failures": ("tier",), "erased_blocks": ("tier",), "erase_failures": ("tier",),
    "hook_seconds": ("hook",), "restored_blocks": ("group",),
    "miss_blocks": ("tier", "reason"), "declined": ("reason",),
    "waited": ("reason",), "wait_seconds": ("reason",),
    "write_failure_blocks": ("tier", "reason"), "tenant_hits": ("tenant",),
    "tenant_evictions": ("tenant", "tier"), "retention_granted": ("tenant",),
    "retention_refused": ("tenant", "reason"),
}
# kvtier serve's /metrics before any request: family -> (type, labels)
SERVE_FAMILIES = {
    "kvtier_time_to_first_token_seconds": ("histogram", ("residency",)),
    "kvtier_time_to_first_token_part_seconds": ("histogram", ("part", "residency")),
    "kvtier_inter_token_latency_seconds": ("histogram", ("residency",)),
    "kvtier_restore_bytes": ("histogram", ()),
    "kvtier_requests": ("counter", ("status",)),
    "kvtier_request_errors": ("counter", ("code",)),
    "kvtier_prompt_tokens": ("counter", ()),
    "kvtier_generation_tokens": ("counter", ()),
    "kvtier_cached_tokens": ("counter", ()),
    "kvtier_restored_tokens": ("counter", ()),
    "kvtier_swapped_in_tokens": ("counter", ()),
    "kvtier_lossy_restores": ("counter", ()),
    "kvtier_recomputed_tokens": ("counter", ()),
    "kvtier_device_blocks": ("gauge", ("state",)),
    "kvtier_host_slots": ("gauge", ("state",)),
    "kvtier_host_pool_bytes": ("gauge", ("kind",)),
    "kvtier_link_busy_fraction": ("gauge", ("direction",)),
    "kvtier_link_bytes": ("counter", ("direction",)),
    "kvtier_preemptions": ("counter", ("mode",)),
    "kvtier_failed_transfers": ("counter", ("direction",)),
    "kvtier_declined": ("counter", ("reason",)),
    "kvtier_waited": ("counter", ("reason",)),
    "kvtier_wait_seconds": ("counter", ("reason",)),
    "kvtier_tier_blocks_written": ("counter", ("tier",)),
    "kvtier_tier_write_failures": ("counter", ("tier",)),
    "kvtier_tier_blocks_fetched": ("counter", ("tier",)),
    "kvtier_tier_fetch_seconds": ("counter", ("tier",)),
    "kvtier_tier_blocks_renewed": ("counter", ("tier",)),
    "kvtier_tier_renew_failures": ("counter", ("tier",)),
    "kvtier_tier_blocks_erased": ("counter", ("tier",)),
    "kvtier_tier_erase_failures": ("counter", ("tier",)),
    "kvtier_tier_misses": ("counter", ("tier", "reason")),
    "kvtier_tier_write_failures_by_reason": ("counter", ("tier", "reason")),
    "kvtier_disk_slots": ("gauge", ("state",)),
    "kvtier_tenant_bytes": ("gauge", ("tenant", "tier", "kind")),
    "kvtier_tenant_evicted_blocks": ("counter", ("tenant", "tier")),
    "kvtier_tenant_hit_blocks": ("counter", ("tenant",)),
    "kvtier_tenant_retention": ("counter", ("tenant", "answer")),
    "kvtier_tenant_prefetch_blocks": ("counter", ("tenant", "answer")),
    "kvtier_requests_running": ("gauge", ()),
    "kvtier_requests_waiting": ("gauge", ()),
}


def test_every_vllm_family_and_label_users_scrape_is_in_the_catalog() -> None:
    got = {f.vllm: tuple(label.value for label in f.labels) for f in CATALOG if f.vllm}
    assert got == VLLM_FAMILIES


def test_every_family_kvtier_serve_exports_keeps_its_name_type_and_labels() -> None:
    m = Metrics()
    m.observe_error(404)
    m.refresh({}, tier=_report())
    body, _ = m.render()
    got: dict[str, tuple[str, tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name.endswith("_created"):  # prometheus_client's own, beside each family
            continue
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        got[family.name] = (family.type, tuple(sorted(labels)))
    assert got == {name: (kind, tuple(sorted(labels)))
                   for name, (kind, labels) in SERVE_FAMILIES.items()}


def test_each_family_is_named_once_per_exporter() -> None:
    for attr in ("vllm", "serve"):
        names = [getattr(f, attr) for f in CATALOG if getattr(f, attr)]
        assert len(names) == len(set(names)), attr
    assert all(f.vllm or f.serve for f in CATALOG)


def test_rows_carry_typed_labels_until_they_are_written() -> None:
    report = _report()
    got = {(r.family, r.labels): r.value for r in rows(report)}
    miss = got[MISS_BLOCKS, (Medium.DISK, Reason.CHECKSUM)]
    assert miss == 2
    assert got[DECLINED, (Decline.SLOWER,)] == 3
    assert got[TENANT_BYTES, ("alice", Medium.HOST, "held")] == 4 * 1024
    row = next(r for r in rows(report) if r.family is MISS_BLOCKS)
    assert row.texts == ("disk", "checksum")


def _report() -> TierStats:
    empty: dict[str, int] = {}
    below = BelowReport(
        written_blocks={"disk": 1}, written_bytes=empty, write_failures=empty,
        fetched_blocks=empty, fetched_bytes=empty, fetch_seconds={},
        misses={Miss(Medium.DISK, Reason.CHECKSUM): 2}, refused=0, encoding="",
        stores={"disk": IndexStats(used=1, capacity=8)}, lookups_answered_absent=0,
        write_failure_reasons={Miss(Medium.REDIS, Reason.TIMEOUT): 1})
    alice = TenantCounts()
    alice.held["host"] = 4
    alice.evictions["host"] = 1
    alice.retention_refused["quota"] = 1
    return TierStats(host=IndexStats(), transfers=TransferCounts(), calibration={},
                     prediction_error={}, below=below, declined={"slower": 3},
                     tenants={"alice": alice}, slot_bytes=1024)


def test_the_operations_page_lists_every_family_as_the_catalog_declares_it() -> None:
    # docs/operations.md's table is written from the catalog: a family added, renamed or
    # re-documented without `python scripts/docs_metrics.py` fails here
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "docs_metrics.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
