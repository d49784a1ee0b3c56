"""vLLM's per-tenant series forget: past `kv_tenant_labels` named tenants, the least recently
counted one's series are removed from vLLM's Prometheus registry. Before, every tenant that
ever reached the top ranks kept its series (50 label values for 49 tenants, cap 16). Runs
kvtier's `KvtierPromMetrics` in the vLLM environment against prometheus_client's counters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = """
import json
from types import SimpleNamespace
import prometheus_client
from prometheus_client import Counter, Gauge, Histogram
from kvtier.integrations.vllm.stats import KvtierPromMetrics
config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
    kv_connector_extra_config={"kv_tenant_labels": 4}))
m = KvtierPromMetrics(config, {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                      ["model_name", "engine"], {0: ["m", "0"]})
for i in range(49):
    m.observe({"tenant_hits": {f"t{i}": 1, "other": 1},
               "tenant_evictions": {f"t{i}": {"host": 2}},
               "retention_refused": {f"t{i}": {"quota": 1}}, "restored_tokens": 16})
text = prometheus_client.generate_latest().decode()
series = [line for line in text.splitlines() if 'tenant="' in line and '_total{' in line]
print(json.dumps({"tenants": sorted({s.split('tenant="')[1].split('"')[0] for s in series}),
                  "series": len(series),
                  "other": [s for s in series if 'tenant="other"' in s and "hits_total" in s],
                  "restored": [s for s in text.splitlines() if s.startswith(
                      "vllm:kvtier_restored_tokens_total")]}))
"""


def test_tenant_series_past_the_cap_are_forgotten_least_recent_first(
        vllm_python: Path) -> None:
    out = subprocess.run([str(vllm_python), "-c", SNIPPET], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tenants"] == ["other", "t45", "t46", "t47", "t48"]
    assert got["series"] == 4 * 3 + 1  # three families per named tenant, "other"'s hits
    assert got["other"] == ['vllm:kvtier_tenant_hits_total{engine="0",model_name="m",'
                            'tenant="other"} 49.0']
    assert got["restored"] == ['vllm:kvtier_restored_tokens_total{engine="0",'
                               'model_name="m"} 784.0']
