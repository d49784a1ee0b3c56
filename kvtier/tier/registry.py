"""The stores below host memory, by where their `StoreKind` lives: a new store is a folder
under `stores/` and one line here, or a module of its own named in the config
(`kv_stores={"my_pkg.kv:STORE": {...}}`), loaded by module path as vLLM loads a connector and
SGLang a storage backend. Each store owns its knobs (a frozen dataclass it parses from its
`kv_stores` entry); the bookkeeping imports none of them.

A store's knobs may also be given flat, under the names vLLM users wrote before `kv_stores`
(`disk_kv_size`, `remote_kv_url`): each store lists those aliases, and `fold` moves them into
its entry, so a config never holds them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from kvtier.errors import ConfigError

# In the order a wake walks them, nearest to host first; stores named by module path follow.
STORES = (
    "kvtier.tier.stores.disk.kind:DISK",
    "kvtier.tier.stores.redis.kind:REDIS",
    "kvtier.tier.stores.fs.kind:FS",
)


class Registered(Protocol):
    """What the registry asks of a store (the builder asks more: `io/kind.py`'s
    `StoreKind`). The registry imports none of the tier, so the config can ask it."""

    @property
    def name(self) -> str:
        """How users name it: its `kv_stores` key and its tier's label."""
        ...

    @property
    def shared(self) -> bool:
        """Whether other instances read its blocks (signed under the deployment's secret)."""
        ...

    @property
    def aliases(self) -> Mapping[str, str]:
        """Its knobs' flat names (`disk_kv_size`) -> the knob (`size`); may be empty."""
        ...

    @property
    def knobs_type(self) -> type:
        """The frozen dataclass of its knobs (the CLI's flags read its fields' types)."""
        ...

    def parse(self, raw: Mapping[str, Any]) -> Any | None:
        """Its knobs from its `kv_stores` entry, checked (ConfigError naming the knob as
        written); None where they leave the store off (a size of 0)."""
        ...

    def state_dir(self, knobs: Any) -> str | None:
        """A directory this process alone owns that outlives it (the tier keeps retention
        there), or None."""
        ...

    def rank_share(self, knobs: Any, rank: int, world_size: int) -> Mapping[str, Any]:
        """Its `kv_stores` entry for one of `world_size` tensor-parallel ranks."""
        ...


@dataclass(frozen=True)
class ConfiguredStore:
    """A store the config asks for: its kind, its `kv_stores` key and its parsed knobs."""

    kind: Any  # a `Registered`; the builder reads it as a `StoreKind`
    key: str
    knobs: Any


@cache
def built_in() -> tuple[Registered, ...]:
    """kvtier's own stores' kinds, in walking order."""
    return tuple(load(entry) for entry in STORES)


def load(entry: str) -> Registered:
    """The store kind at "module.path:NAME"; ConfigError saying what could not be loaded."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"kv_stores names {entry!r}: a store outside kvtier is named "
                          "\"module.path:NAME\", NAME being its store kind")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"kv_stores names {entry!r}, whose module cannot be imported: "
                          f"{e}") from None
    kind = getattr(module, attr, None)
    missing = [m for m in ("name", "shared", "aliases", "knobs_type", "parse", "state_dir",
                           "rank_share", "medium", "open_both", "open_books", "open_bytes")
               if not hasattr(kind, m)]
    if kind is None or missing:
        raise ConfigError(f"kv_stores names {entry!r}, which is no store kind"
                          + (f" (it lacks {', '.join(missing)})" if kind is not None else
                             f": {module_name} has no {attr!r}"))
    return kind  # type: ignore[no-any-return]


def entries(config: Any) -> list[tuple[Registered, str, Any]]:
    """(kind, key, raw knobs) of every store `config.kv_stores` names, kvtier's own first
    in walking order; ConfigError for a name that is no store."""
    stores = config.kv_stores
    if not isinstance(stores, Mapping):
        raise ConfigError(f"kv_stores={stores!r} must be an object of stores by name, each "
                          f"with its knobs, e.g. {{\"fs\": {{\"path\": \"/mnt/kv\"}}}}")
    own = {kind.name: kind for kind in built_in()}
    out = [(kind, kind.name, stores[kind.name]) for kind in built_in() if kind.name in stores]
    for key, raw in stores.items():
        if key in own:
            continue
        if ":" not in key:
            raise ConfigError(f"kv_stores names {key!r}, which is no store; the stores are: "
                              f"{', '.join(own)}, or one of your own as \"module.path:NAME\"")
        kind = load(key)
        if kind.name in own or any(kind.name == k.name for k, _, _ in out):
            raise ConfigError(f"kv_stores names {key!r}, whose store calls itself "
                              f"{kind.name!r}, a name already taken")
        out.append((kind, key, raw))
    return out


def configured(config: Any) -> list[ConfiguredStore]:
    """The stores `config` asks for, nearest to host first, their knobs parsed (ConfigError
    naming the knob)."""
    out = []
    for kind, key, raw in entries(config):
        knobs = kind.parse(raw)
        if knobs is not None:
            out.append(ConfiguredStore(kind, key, knobs))
    return out


def aliases() -> dict[str, tuple[Registered, str]]:
    """Every flat store knob (`disk_kv_size`) -> (its store, its knob)."""
    return {alias: (kind, knob) for kind in built_in() for alias, knob in kind.aliases.items()}


def fold(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """`knobs` with every flat store knob moved into its store's `kv_stores` entry (unset
    ones, None, dropped: a flat knob left at its default asks for nothing)."""
    flat = aliases()
    out = {k: v for k, v in knobs.items() if k not in flat}
    moved: dict[str, dict[str, Any]] = {}
    for key, value in knobs.items():
        if key in flat and value is not None:
            moved.setdefault(flat[key][0].name, {})[key] = value
    if not moved:
        return out
    stores = out.get("kv_stores") or {}
    if not isinstance(stores, Mapping):
        return out  # the config refuses the shape itself
    merged = dict(stores)
    for name, given in moved.items():
        inner = merged.get(name, {})
        merged[name] = {**inner, **given} if isinstance(inner, Mapping) else inner
    out["kv_stores"] = merged
    return out
