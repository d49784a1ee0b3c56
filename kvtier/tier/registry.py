"""The stores below host memory, by where their `StoreKind` lives: a new store is a folder
under `stores/` and one line here. Loaded by module path on first use (as SGLang's
`backend_factory` loads a storage backend), so the knobs' checks reach every store while the
bookkeeping imports none of them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from functools import cache
from typing import Any, Protocol

from kvtier.errors import ConfigError

# In the order a wake walks them, nearest to host first.
STORES = (
    "kvtier.tier.stores.disk.kind:DISK",
    "kvtier.tier.stores.redis.kind:REDIS",
    "kvtier.tier.stores.fs.kind:FS",
)


class Registered(Protocol):
    """What the registry asks of a store (the builder asks more: `io/kind.py`'s
    `StoreKind`). Configs are `TierConfig`s; the registry imports none of the tier, so the
    config can ask it."""

    name: str
    shared: bool

    def configured(self, config: Any) -> bool: ...

    def check(self, config: Any) -> None: ...


@cache
def kinds() -> tuple[Registered, ...]:
    """Every registered store's kind, in walking order."""
    out = []
    for entry in STORES:
        module, _, name = entry.partition(":")
        out.append(getattr(importlib.import_module(module), name))
    return tuple(out)


def configured(config: Any) -> list[Registered]:
    """The stores `config` asks for, nearest to host first."""
    return [kind for kind in kinds() if kind.configured(config)]


def check(config: Any) -> None:
    """Every store's knob checks (ConfigError naming the knob), after `kv_stores`' shape:
    a store's name, each with an object of its knobs."""
    names = [kind.name for kind in kinds()]
    if not isinstance(config.kv_stores, Mapping):
        raise ConfigError(f"kv_stores={config.kv_stores!r} must be an object of stores by "
                          f"name, each with its knobs, e.g. {{\"fs\": {{\"path\": \"/mnt/kv\"}}}}")
    for name, knobs in config.kv_stores.items():
        if name not in names:
            raise ConfigError(f"kv_stores names {name!r}, which is no store; the stores are: "
                              f"{', '.join(names)}")
        if not isinstance(knobs, Mapping):
            raise ConfigError(f"kv_stores[{name!r}]={knobs!r} must be an object of that "
                              "store's knobs")
    for kind in kinds():
        kind.check(config)
