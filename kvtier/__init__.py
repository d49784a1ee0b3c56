"""kvtier: a host-memory tier for the LLM KV cache, and the engine that drives it."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

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


# Modules that moved into the folder whose concern they are; their old paths still import.
MOVED = {
    "kvtier.metrics": "kvtier.server.metrics",
    "kvtier.stats": "kvtier.engine.stats",
    "kvtier.flags": "kvtier.engine.flags",
    "kvtier.selftest": "kvtier.bench.selftest",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import kvtier.metrics` answered with `kvtier.server.metrics` itself: one module under
    both names, so a class imported either way is the same class."""

    def find_spec(self, name: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def __init__(self) -> None:
        self._own: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._own[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """It ran when it was imported under its own name; the import machinery has just
        given it this alias's spec: it gets its own back."""
        own = self._own.pop(module.__name__, None)
        if own is not None:
            module.__spec__, module.__loader__ = own, own.loader


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
