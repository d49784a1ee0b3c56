"""Every counter family kvtier exports, declared once: its doc, its typed labels, and the name
it carries under vLLM (`vllm:kvtier_<vllm>_total`) and under `kvtier serve`
(`kvtier_<serve>_total`); and `rows(report)`, the tier's report as (family, labels, value)
rows. vLLM's stats, the connector's per-step deltas and kvtier serve's `/metrics` are each one
loop over these rows, so a new counter is its counting line plus one family here, and no
exporter parses a label back out of a string.

Label values stay typed (`Medium`, `Reason`, `Decline`, a tenant's name) until an exporter
writes them (`Row.texts`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from kvtier.tier.handoff import Wait
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import Medium
from kvtier.tier.load_policy import Decline
from kvtier.tier.report import TierStats


class Label(enum.Enum):
    """A label a family carries, in the order written."""

    TIER = "tier"  # a store below host (a Medium), or host
    REASON = "reason"  # a Reason, a Decline, a Wait, or a retention refusal
    TENANT = "tenant"  # bounded by kv_tenant_labels, the rest as "other"
    ANSWER = "answer"  # granted, or the refusal's reason
    KIND = "kind"  # held or retained
    GROUP = "group"  # a vLLM KV cache group: its index and kind
    HOOK = "hook"  # a vLLM connector hook
    STATE = "state"  # a store's slots: used or capacity


class Kind(enum.Enum):
    COUNTER = "counter"  # monotonic since start
    GAUGE = "gauge"  # a level now


@dataclass(frozen=True)
class Family:
    """One exported family; a name of None: not exported there."""

    doc: str
    labels: tuple[Label, ...] = ()
    vllm: str | None = None  # vllm:kvtier_<vllm>_total, and its key in the connector's data
    serve: str | None = None  # kvtier_<serve>_total on kvtier serve's /metrics
    kind: Kind = Kind.COUNTER
    # bytes of one tensor-parallel rank's slice in the tier; vLLM's counts all ranks' bytes
    per_rank_bytes: bool = False


LabelValue = Medium | Reason | Decline | Wait | str


@dataclass(frozen=True)
class Row:
    family: Family
    labels: tuple[LabelValue, ...]
    value: float

    @property
    def texts(self) -> tuple[str, ...]:
        """The label values as an exporter writes them."""
        return tuple(label_text(v) for v in self.labels)


def label_text(value: LabelValue) -> str:
    return value.value if isinstance(value, (Medium, enum.Enum)) else value


# Counted by vLLM's connector (its scheduler side, its hooks), not by the tier's report.
LOOKUP_TOKENS = Family("Prompt tokens beyond vLLM's own prefix cache that kvtier looked up "
                       "(once per request, however often vLLM asks again)",
                       vllm="lookup_tokens")
RESTORED_TOKENS = Family("Tokens restored from kvtier's tiers instead of recomputed",
                         vllm="restored_tokens")
DECLINED_TOKENS = Family("Tokens found in kvtier's tiers but recomputed (the planner's choice, "
                         "a block that failed verification, or no room on host)",
                         vllm="declined_tokens")
RESTORE_SECONDS = Family("Seconds spent copying host -> vLLM's KV cache",
                         vllm="restore_seconds")
LOSSY_RESTORED_TOKENS = Family("Tokens restored from 8-bit blocks (kv_offload_dtype): close to, "
                               "not exactly, the KV vLLM would compute",
                               vllm="lossy_restored_tokens")
CACHE_RESETS = Family("Resets of the KV cache (vLLM's reset_prefix_cache with reset_connector, "
                      "a pause or sleep that clears caches): each moves block keys to a new "
                      "weights identity", vllm="cache_resets")
RESET_DROPPED_HOST_BLOCKS = Family("Host blocks dropped by cache resets",
                                   vllm="reset_dropped_host_blocks")
STEP_SECONDS = Family("Seconds of engine steps, from the first connector hook of vLLM's "
                      "schedule() to its update (what kvtier's hook seconds are a share of)",
                      vllm="step_seconds")
HOOK_SECONDS = Family("Seconds kvtier spent in each of vLLM's connector hooks (a worker's: the "
                      "mean over its tensor-parallel ranks)", (Label.HOOK,),
                      vllm="hook_seconds")
RESTORED_BLOCKS = Family("Blocks restored into vLLM's KV cache, per KV cache group (its index "
                         "and kind: full, or window=<tokens>)", (Label.GROUP,),
                         vllm="restored_blocks")

# The tier's report (`rows`).
RESTORE_BYTES = Family("Bytes copied host -> vLLM's KV cache", vllm="restore_bytes",
                       per_rank_bytes=True)
FAILED_LOADS = Family("Host -> device loads that failed (recomputed or failed per policy)",
                      vllm="failed_loads")
STORED_BLOCKS = Family("Blocks stored device -> host", vllm="stored_blocks")
STORED_BYTES = Family("Bytes stored device -> host", vllm="stored_bytes", per_rank_bytes=True)
FAILED_STORES = Family("Device -> host stores that failed (never served)",
                       vllm="failed_stores")
STORE_REFUSED = Family("Stores the host tier had no room for", vllm="store_refused")
DECLINED = Family("Requests that recomputed tokens found in the tier, by reason "
                  "(kvtier.tier.Decline: slower, inflight, queue, policy, deadline, no_room, "
                  "lost, layout)", (Label.REASON,), vllm="declined", serve="declined")
WAITED = Family("Requests that waited for blocks still being written rather than recompute "
                "them, by what for (landing: the last turn's on host; handoff: another "
                "engine's to a shared store); what did not come in time is declined deadline",
                (Label.REASON,), vllm="waited", serve="waited")
WAIT_SECONDS = Family("Seconds requests waited for blocks still being written, by what for",
                      (Label.REASON,), vllm="wait_seconds", serve="wait_seconds")
WRITTEN_BLOCKS = Family("Blocks written on from host to a tier below it", (Label.TIER,),
                        vllm="written_blocks", serve="tier_blocks_written")
WRITTEN_BYTES = Family("Bytes written on from host to a tier below it (as stored: 8-bit where "
                       "the host encodes)", (Label.TIER,), vllm="written_bytes",
                       per_rank_bytes=True)
WRITE_FAILURES = Family("Blocks a tier below host failed to take (not misses)", (Label.TIER,),
                        vllm="write_failures", serve="tier_write_failures")
FETCHED_BLOCKS = Family("Blocks fetched into host from a tier below it, verified",
                        (Label.TIER,), vllm="fetched_blocks", serve="tier_blocks_fetched")
FETCHED_BYTES = Family("Bytes fetched into host from a tier below it", (Label.TIER,),
                       vllm="fetched_bytes", per_rank_bytes=True)
FETCH_SECONDS = Family("Seconds of I/O fetching from a tier below host into host memory "
                       "(fetched bytes over these: the tier's read rate)", (Label.TIER,),
                       vllm="fetch_seconds", serve="tier_fetch_seconds")
RENEWED_BLOCKS = Family("Blocks a tier below host that expires them (a TTL) was told to keep "
                        "longer: a retention granted after their write", (Label.TIER,),
                        vllm="renewed_blocks", serve="tier_blocks_renewed")
RENEW_FAILURES = Family("Blocks a tier below host could not be told to keep longer "
                        "(unreachable): their TTL may end before the retention",
                        (Label.TIER,), vllm="renew_failures", serve="tier_renew_failures")
ERASED_BLOCKS = Family("Blocks a purge erased from a tier below host (a disk slot overwritten, "
                       "a file or a key deleted; for a shared store, the keys it was told to "
                       "delete)", (Label.TIER,), vllm="erased_blocks",
                       serve="tier_blocks_erased")
ERASE_FAILURES = Family("Blocks a purge could not erase from a tier below host (unreachable, "
                        "an I/O error): their bytes stay there", (Label.TIER,),
                        vllm="erase_failures", serve="tier_erase_failures")
MISS_BLOCKS = Family("Blocks found below host but not served, by reason (kvtier.tier.Reason: "
                     "fingerprint, checksum, mac, missing, io, unavailable, deadline, ...; "
                     "blocks refused at start included); each one recomputed",
                     (Label.TIER, Label.REASON), vllm="miss_blocks", serve="tier_misses")
WRITE_FAILURE_BLOCKS = Family("Blocks a tier below host failed to take, by reason (timeout, "
                              "unavailable, io, no-space, ...)", (Label.TIER, Label.REASON),
                              vllm="write_failure_blocks",
                              serve="tier_write_failures_by_reason")
TENANT_HITS = Family("A tenant's blocks restored from host for its requests", (Label.TENANT,),
                     vllm="tenant_hits", serve="tenant_hit_blocks")
TENANT_EVICTIONS = Family("A tenant's blocks evicted from a tier to make room",
                          (Label.TENANT, Label.TIER), vllm="tenant_evictions",
                          serve="tenant_evicted_blocks")
RETENTION_GRANTED = Family("Retentions granted to a tenant", (Label.TENANT,),
                           vllm="retention_granted")
RETENTION_REFUSED = Family("Retentions refused, by reason (disabled, full, over_max, quota, "
                           "not_stored)", (Label.TENANT, Label.REASON),
                           vllm="retention_refused")
TENANT_RETENTION = Family("Retention requests by answer: granted, or refused by reason "
                          "(quota, over_max, ...)", (Label.TENANT, Label.ANSWER),
                          serve="tenant_retention")
TENANT_PREFETCH = Family("Blocks a tenant's prefetches brought up into host (fetched), or left "
                         "below for its prefetch budget (limited)", (Label.TENANT, Label.ANSWER),
                         serve="tenant_prefetch_blocks")
TENANT_BYTES = Family("Bytes a tenant's blocks take in a tier, held (all) or retained (pinned "
                      "until a deadline)", (Label.TENANT, Label.TIER, Label.KIND),
                      serve="tenant_bytes", kind=Kind.GAUGE)
DISK_SLOTS = Family("Disk tier slots by state", (Label.STATE,), serve="disk_slots",
                    kind=Kind.GAUGE)

CATALOG: tuple[Family, ...] = (
    LOOKUP_TOKENS, RESTORED_TOKENS, DECLINED_TOKENS, RESTORE_BYTES, RESTORE_SECONDS,
    LOSSY_RESTORED_TOKENS, FAILED_LOADS, STORED_BLOCKS, STORED_BYTES, FAILED_STORES,
    STORE_REFUSED, CACHE_RESETS, RESET_DROPPED_HOST_BLOCKS, STEP_SECONDS, HOOK_SECONDS,
    RESTORED_BLOCKS, DECLINED, WAITED, WAIT_SECONDS, WRITTEN_BLOCKS, WRITTEN_BYTES,
    WRITE_FAILURES, FETCHED_BLOCKS, FETCHED_BYTES, FETCH_SECONDS, RENEWED_BLOCKS,
    RENEW_FAILURES, ERASED_BLOCKS, ERASE_FAILURES, MISS_BLOCKS, WRITE_FAILURE_BLOCKS,
    TENANT_HITS, TENANT_EVICTIONS, RETENTION_GRANTED, RETENTION_REFUSED, TENANT_RETENTION,
    TENANT_PREFETCH, TENANT_BYTES, DISK_SLOTS)
BY_VLLM_KEY: Mapping[str, Family] = {f.vllm: f for f in CATALOG if f.vllm is not None}
# The stores kvtier ships: their series exist (at 0) wherever a family is labelled by tier
# alone, so a dashboard sees 0 rather than no series when one is off.
BUILT_IN_TIERS: tuple[Medium, ...] = (Medium.DISK, Medium.REDIS)
# Label values always exported, at 0 until they count.
ALWAYS_LABELLED: Mapping[Family, tuple[tuple[LabelValue, ...], ...]] = {
    **{f: tuple((m,) for m in BUILT_IN_TIERS) for f in CATALOG if f.labels == (Label.TIER,)},
    DECLINED: tuple((d,) for d in Decline),
    WAITED: tuple((w,) for w in Wait),
    WAIT_SECONDS: tuple((w,) for w in Wait),
    DISK_SLOTS: (("used",), ("capacity",)),
}


def rows(report: TierStats) -> Iterator[Row]:
    """The report as rows, one per family and label values (zeros included where the report
    holds them)."""
    s = report.transfers
    for family, value in ((RESTORE_BYTES, s.loaded_bytes), (FAILED_LOADS, s.failed_loads),
                          (STORED_BLOCKS, s.stored_blocks), (STORED_BYTES, s.stored_bytes),
                          (FAILED_STORES, s.failed_stores), (STORE_REFUSED, s.store_refused)):
        yield Row(family, (), value)
    for reason, n in report.declined.items():
        yield Row(DECLINED, (Decline(reason),), n)
    for wait, n in report.waited.items():
        yield Row(WAITED, (Wait(wait),), n)
    for wait, seconds in report.wait_seconds.items():
        yield Row(WAIT_SECONDS, (Wait(wait),), seconds)
    b = report.below
    if b is not None:
        for family, counts in ((WRITTEN_BLOCKS, b.written_blocks),
                               (WRITTEN_BYTES, b.written_bytes),
                               (WRITE_FAILURES, b.write_failures),
                               (FETCHED_BLOCKS, b.fetched_blocks),
                               (FETCHED_BYTES, b.fetched_bytes),
                               (FETCH_SECONDS, b.fetch_seconds),
                               (RENEWED_BLOCKS, b.renewed_blocks),
                               (RENEW_FAILURES, b.renew_failures),
                               (ERASED_BLOCKS, b.erased_blocks),
                               (ERASE_FAILURES, b.erase_failures)):
            # every store that runs has its series, at 0 until it counts
            for tier in dict.fromkeys([*b.stores, *counts]):
                yield Row(family, (Medium(tier),), counts.get(tier, 0))
        for family, misses in ((MISS_BLOCKS, b.misses),
                               (WRITE_FAILURE_BLOCKS, b.write_failure_reasons)):
            for miss, n in misses.items():
                yield Row(family, (miss.medium, miss.reason), n)
        disk = b.stores.get(Medium.DISK.value)
        if disk is not None and disk.capacity:
            yield Row(DISK_SLOTS, ("used",), disk.used)
            yield Row(DISK_SLOTS, ("capacity",), disk.capacity)
    yield from _tenant_rows(report)


def _tenant_rows(report: TierStats) -> Iterator[Row]:
    """Per tenant label (bounded by `kv_tenant_labels`, the rest as "other")."""
    size = report.slot_bytes
    for tenant, c in report.tenants.items():
        yield Row(TENANT_HITS, (tenant,), c.hits)
        yield Row(RETENTION_GRANTED, (tenant,), c.retention_granted)
        yield Row(TENANT_RETENTION, (tenant, "granted"), c.retention_granted)
        for reason, n in c.retention_refused.items():
            yield Row(RETENTION_REFUSED, (tenant, reason), n)
            yield Row(TENANT_RETENTION, (tenant, reason), n)
        for tier, n in c.evictions.items():
            yield Row(TENANT_EVICTIONS, (tenant, Medium(tier)), n)
        yield Row(TENANT_PREFETCH, (tenant, "fetched"), c.prefetched)
        yield Row(TENANT_PREFETCH, (tenant, "limited"), c.prefetch_limited)
        for kind, counts in (("held", c.held), ("retained", c.retained)):
            for tier, n in counts.items():
                yield Row(TENANT_BYTES, (tenant, Medium(tier), kind), n * size)
