"""kvtier's counters in vLLM's own stats: the scheduler side reports them once a step
(`get_kv_connector_stats`), vLLM sums them, logs them, and its Prometheus logger exports them
(`vllm serve`'s /metrics) as `vllm:kvtier_*_total` counters, in vLLM's own namespace."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# data key -> what it counts (the Prometheus family is vllm:kvtier_<key>)
COUNTERS = {
    "lookup_tokens": "Prompt tokens beyond vLLM's own prefix cache that kvtier looked up "
                     "(once per request, however often vLLM asks again)",
    "restored_tokens": "Tokens restored from kvtier's tiers instead of recomputed",
    "declined_tokens": "Tokens found in kvtier's tiers but recomputed (the planner's choice, "
                       "a block that failed verification, or no room on host)",
    "restore_bytes": "Bytes copied host -> vLLM's KV cache",
    "restore_seconds": "Seconds spent copying host -> vLLM's KV cache",
    "lossy_restored_tokens": "Tokens restored from 8-bit blocks (kv_offload_dtype): close to, "
                             "not exactly, the KV vLLM would compute",
    "failed_loads": "Host -> device loads that failed (recomputed or failed per policy)",
    "stored_blocks": "Blocks stored device -> host",
    "stored_bytes": "Bytes stored device -> host",
    "failed_stores": "Device -> host stores that failed (never served)",
    "store_refused": "Stores the host tier had no room for",
    "cache_resets": "Resets of the KV cache (vLLM's reset_prefix_cache with reset_connector, "
                    "a pause or sleep that clears caches): each moves block keys to a new "
                    "weights identity",
    "reset_dropped_host_blocks": "Host blocks dropped by cache resets",
    "step_seconds": "Seconds of engine steps, from the first connector hook of vLLM's "
                    "schedule() to its update (what kvtier's hook seconds are a share of)",
}
# data key "family|label[|label]" -> (labels after vLLM's, what it counts)
LABELLED = {
    "written_blocks": (("tier",), "Blocks written on from host to a tier below it"),
    "written_bytes": (("tier",), "Bytes written on from host to a tier below it"),
    "write_failures": (("tier",), "Blocks a tier below host failed to take (not misses)"),
    "fetched_blocks": (("tier",), "Blocks fetched into host from a tier below it, verified"),
    "fetched_bytes": (("tier",), "Bytes fetched into host from a tier below it"),
    "renewed_blocks": (("tier",), "Blocks a tier below host that expires them (Redis's TTL) "
                                  "was told to keep for a retention granted after their write"),
    "renew_failures": (("tier",), "Blocks a tier below host could not be told to keep longer "
                                  "(unreachable): their TTL may end before the retention"),
    "hook_seconds": (("hook",), "Seconds kvtier spent in each of vLLM's connector hooks (a "
                                "worker's: the mean over its tensor-parallel ranks)"),
    "restored_blocks": (("group",), "Blocks restored into vLLM's KV cache, per KV cache group "
                                    "(its index and kind: full, or window=<tokens>)"),
    "miss_blocks": (("tier", "reason"), "Blocks found below host but not served, by reason "
                                        "(kvtier.tier.Reason: fingerprint, checksum, mac, "
                                        "missing, io, deadline, ...; blocks refused at start "
                                        "included)"),
    "declined": (("reason",), "Requests that recomputed tokens found in kvtier's tiers, by "
                              "reason (kvtier.tier.Decline: slower, inflight, queue, "
                              "policy, deadline, no_room, lost, layout)"),
    "write_failure_blocks": (("tier", "reason"), "Blocks a tier below host failed to take, by "
                                                 "reason (timeout, unavailable, io, ...)"),
    # per tenant (a request's cache_salt; "default" without one): the kv_tenant_labels
    # tenants holding most by name, the rest as "other", so the labels stay bounded
    "tenant_hits": (("tenant",), "Blocks restored from host for a tenant's requests"),
    "tenant_evictions": (("tenant", "tier"), "A tenant's blocks evicted from a tier to make "
                                             "room"),
    "retention_granted": (("tenant",), "Retentions granted (kvtier_retention_s in a "
                                       "request's kv_transfer_params)"),
    "retention_refused": (("tenant", "reason"), "Retentions refused, by reason (disabled, full, "
                                                "over_max, quota, not_stored)"),
}


@dataclass
class KvtierStats(KVConnectorStats):
    """Counters since the last report, summed across reports."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: round(value, 6) for key, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


OTHER = "other"  # the tenants past the label cap, together


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvtier counter, labelled per engine as vLLM's are (and by
    tier, and reason, where the counter has them). Tenant label values forget: past
    `kv_tenant_labels` named tenants exported, the least recently counted one's series are
    removed (its counts start again from 0 if it comes back, which Prometheus reads as a
    reset), so the series stay bounded however many tenants the top ranks see in turn."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engine_labels = per_engine_labelvalues
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        self._tenant_cap = int(extra.get("kv_tenant_labels", 16))
        self._tenants: OrderedDict[str, None] = OrderedDict()  # least recently counted first
        self._families: dict[str, Any] = {}
        for key, documentation in COUNTERS.items():
            self._families[key] = self._counter_cls(
                name=f"vllm:kvtier_{key}", documentation=documentation, labelnames=labelnames)
        for key, (extra, documentation) in LABELLED.items():
            self._families[key] = self._counter_cls(
                name=f"vllm:kvtier_{key}", documentation=documentation,
                labelnames=[*labelnames, *extra])
        self._bound: dict[tuple[str, int], Any] = {}
        for key in COUNTERS:  # at 0 from the start; the labelled ones once they happen
            for engine in per_engine_labelvalues:
                self._counter(key, engine)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if value > 0:
                self._saw_tenant(key)
                counter = self._counter(key, engine_idx)
                if counter is not None:
                    counter.inc(value)

    def _saw_tenant(self, key: str) -> None:
        """A counter of a tenant's is about to count: it is the most recent tenant now, and
        past the cap the least recent one's series go."""
        tenant = _tenant_of(key)
        if tenant is None or tenant == OTHER:
            return
        self._tenants[tenant] = None
        self._tenants.move_to_end(tenant)
        while len(self._tenants) > self._tenant_cap:
            gone, _ = self._tenants.popitem(last=False)
            for bound_key in [k for k in self._bound if _tenant_of(k[0]) == gone]:
                family, *extra = bound_key[0].split("|")
                labels = self._engine_labels.get(bound_key[1], [])
                remove = getattr(self._families[family], "remove", None)
                if remove is not None:
                    remove(*labels, *extra)
                del self._bound[bound_key]

    def _counter(self, key: str, engine_idx: int) -> Any:
        bound = self._bound.get((key, engine_idx))
        if bound is None:
            family, *extra = key.split("|")
            labels = self._engine_labels.get(engine_idx)
            want = len(LABELLED[family][0]) if family in LABELLED else 0
            if family not in self._families or labels is None or len(extra) != want:
                return None
            bound = self._bound[(key, engine_idx)] = self._families[family].labels(
                *labels, *extra)
        return bound


def _tenant_of(key: str) -> str | None:
    """The tenant label of a data key of a per-tenant family ("tenant_hits|alice"), else
    None."""
    family, *extra = key.split("|")
    labels = LABELLED.get(family, ((),))[0]
    return extra[0] if extra and labels and labels[0] == "tenant" else None
