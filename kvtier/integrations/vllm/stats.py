"""kvtier's counters in vLLM's own stats: the scheduler side reports them once a step
(`get_kv_connector_stats`), vLLM sums them, logs them, and its Prometheus logger exports them
(`vllm serve`'s /metrics) as `vllm:kvtier_*_total` counters, in vLLM's own namespace: one
per family of the catalog (`kvtier.tier.catalog`) that has a vLLM name."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.integrations.kit.counters import flat, merge, unnest
from kvtier.tier import BY_VLLM_KEY, Family, Label


@dataclass
class KvtierStats(KVConnectorStats):
    """Counters since the last report, summed across reports."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(flat(self.data))

    def is_empty(self) -> bool:
        return not any(value for _, _, value in unnest(self.data))


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
        self._families: dict[Family, Any] = {
            family: self._counter_cls(
                name=f"vllm:kvtier_{key}", documentation=family.doc,
                labelnames=[*labelnames, *(label.value for label in family.labels)])
            for key, family in BY_VLLM_KEY.items()}
        # (family, its label values, engine) -> the bound counter
        self._bound: dict[tuple[Family, tuple[str, ...], int], Any] = {}
        for family in self._families:  # at 0 from the start; labelled ones once they happen
            if not family.labels:
                for engine in per_engine_labelvalues:
                    self._counter(family, (), engine)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for family, labels, value in unnest(transfer_stats_data):
            if value > 0:
                self._saw_tenant(family, labels)
                counter = self._counter(family, labels, engine_idx)
                if counter is not None:
                    counter.inc(value)

    def _saw_tenant(self, family: Family, labels: tuple[str, ...]) -> None:
        """A counter of a tenant's is about to count: it is the most recent tenant now, and
        past the cap the least recent one's series go."""
        tenant = _tenant_of(family, labels)
        if tenant is None or tenant == OTHER:
            return
        self._tenants[tenant] = None
        self._tenants.move_to_end(tenant)
        while len(self._tenants) > self._tenant_cap:
            gone, _ = self._tenants.popitem(last=False)
            for bound in [b for b in self._bound if _tenant_of(b[0], b[1]) == gone]:
                bound_family, values, engine = bound
                remove = getattr(self._families[bound_family], "remove", None)
                if remove is not None:
                    remove(*self._engine_labels.get(engine, []), *values)
                del self._bound[bound]

    def _counter(self, family: Family, labels: tuple[str, ...], engine_idx: int) -> Any:
        bound = self._bound.get((family, labels, engine_idx))
        if bound is None:
            engine_labels = self._engine_labels.get(engine_idx)
            if family not in self._families or engine_labels is None:
                return None
            bound = self._bound[(family, labels, engine_idx)] = self._families[family].labels(
                *engine_labels, *labels)
        return bound


def _tenant_of(family: Family, labels: tuple[str, ...]) -> str | None:
    """The tenant label value of a per-tenant family's series, else None."""
    if Label.TENANT not in family.labels:
        return None
    return labels[family.labels.index(Label.TENANT)]
