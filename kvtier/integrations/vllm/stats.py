"""kvtier's counters in vLLM's own stats: the scheduler side reports them once a step
(`get_kv_connector_stats`), vLLM sums them, logs them, and its Prometheus logger exports them
(`vllm serve`'s /metrics) as `vllm:kvtier_*_total` counters, in vLLM's own namespace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# data key -> what it counts (the Prometheus family is vllm:kvtier_<key>)
COUNTERS = {
    "lookup_tokens": "Prompt tokens beyond vLLM's own prefix cache that kvtier looked up",
    "restored_tokens": "Tokens restored from kvtier's host tier instead of recomputed",
    "declined_tokens": "Tokens found in kvtier's tier but recomputed (the planner's choice)",
    "restore_bytes": "Bytes copied host -> vLLM's KV cache",
    "restore_seconds": "Seconds spent copying host -> vLLM's KV cache",
    "failed_loads": "Host -> device loads that failed (recomputed or failed per policy)",
    "stored_blocks": "Blocks stored device -> host",
    "stored_bytes": "Bytes stored device -> host",
    "failed_stores": "Device -> host stores that failed (never served)",
    "store_refused": "Stores the host tier had no room for",
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


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per kvtier counter, labelled per engine as vLLM's are."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[str, dict[int, Any]] = {}
        for key, documentation in COUNTERS.items():
            family = self._counter_cls(name=f"vllm:kvtier_{key}", documentation=documentation,
                                       labelnames=labelnames)
            self._bound[key] = {engine: family.labels(*values)
                                for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            counter = self._bound.get(key, {}).get(engine_idx)
            if counter is not None and value > 0:
                counter.inc(value)
