"""kvtier: a host-memory tier for the LLM KV cache, and the engine that drives it."""

from kvtier.errors import CapacityError, ConfigError, KvtierError, ModelLoadError, RequestError
from kvtier.sequence import SamplingParams

__all__ = [
    "LLM",
    "CapacityError",
    "ConfigError",
    "KvtierError",
    "ModelLoadError",
    "RequestError",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the model code; keep `import kvtier` cheap for the CLI's --help.
    if name == "LLM":
        from kvtier.llm import LLM

        return LLM
    raise AttributeError(name)
