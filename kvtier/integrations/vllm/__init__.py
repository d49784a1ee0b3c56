"""kvtier under vLLM: `KvtierConnector`, loaded by vLLM from this module path
(`"kv_connector_module_path": "kvtier.integrations.vllm"`). Naming it imports vLLM; the
vLLM-free halves (`scheduler_side`, `worker_side`, `settings`, `identity`, `events`) import
without it."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.integrations.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module 'kvtier.integrations.vllm' has no attribute {name!r}")
