"""Every knob checked the same way: its declared type, a finite number, a range.

A knob reaches kvtier from JSON (vLLM's `kv_connector_extra_config`, where `Infinity` and
`NaN` parse), from a CLI flag or from Python: none of these checks types, so a config
dataclass calls `check_knobs` before its own rules, and every refusal is one `ConfigError`
naming the knob, its value and what it must be.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvtier.errors import ConfigError

Bounds = tuple[float, float]  # inclusive [low, high]
T = TypeVar("T")


def check_types(config: Any) -> None:
    """ConfigError for the first field of dataclass `config` that is not of its declared
    type or is a non-finite number (run before any rule compares a value)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if not fits(value, hint):
            shown = f"={value!r}" if f.repr else " (its value hidden: a secret)"
            raise ConfigError(f"{f.name}{shown} is a {type(value).__name__}; it must be "
                              f"{describe(hint)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name}={value} must be a finite number")


def check_bounds(config: Any, bounds: Mapping[str, Bounds],
                 named: Callable[[str], str] = str) -> None:
    """ConfigError for the first numeric field outside its inclusive `bounds` (None, the
    "unset" of optional knobs, is never bounded); `named`: how the user wrote each knob."""
    for name, (low, high) in bounds.items():
        value = getattr(config, name)
        if isinstance(value, (int, float)) and not low <= value <= high:
            raise ConfigError(f"{named(name)}={_num(value)} must be in "
                              f"[{_num(low)}, {_num(high)}]")


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


def fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of the knob's type (an int is a float too; a bool is neither)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    if not isinstance(hint, type):
        return True  # a type check cannot say more (nested generics are not knobs)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    """A type hint in the user's words ("a number or null")."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(describe(h) for h in typing.get_args(hint))
    return {type(None): "null", float: "a number", int: "an integer", str: "a string",
            bool: "true or false"}.get(hint, str(hint))


class Spelling:
    """How a user named each of one store's knobs: its flat alias (`disk_kv_size`, the
    names vLLM users have written since before `kv_stores`) or `kv_stores['disk']['size']`,
    so every refusal names the knob as it was written."""

    def __init__(self, store: str, aliases: Mapping[str, str], given: Mapping[str, str]
                 ) -> None:
        self._store, self._given = store, dict(given)
        self._alias_of = {knob: alias for alias, knob in aliases.items()}
        # a knob not given is named the way the others were
        self._flat = any(key in aliases for key in given.values())

    def __call__(self, knob: str) -> str:
        if knob in self._given:
            return self._given[knob]
        if self._flat and knob in self._alias_of:
            return self._alias_of[knob]
        return f"kv_stores[{self._store!r}][{knob!r}]"


def parse_store_knobs(cls: type[T], store: str, raw: Any, aliases: Mapping[str, str]
                      ) -> tuple[T, Spelling]:
    """One store's knobs (`kv_stores[store]`, keyed by knob or by flat alias) as its dataclass
    `cls`, each of its declared type and finite; ConfigError naming the knob as written."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_stores[{store!r}]={raw!r} must be an object of that store's "
                          "knobs")
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in raw.items():
        knob = aliases.get(key, key)
        if knob not in fields:
            raise ConfigError(f"kv_stores[{store!r}] has unknown knob {key!r}; its knobs are: "
                              f"{', '.join(sorted(fields))}")
        named = key if key in aliases else f"kv_stores[{store!r}][{key!r}]"
        if knob in given:
            raise ConfigError(f"{given[knob]} and {named} both set the {store} store's "
                              f"{knob!r}; keep one")
        if not fits(value, hints[knob]):
            raise ConfigError(f"{named}={value!r} is a {type(value).__name__}; it must be "
                              f"{describe(hints[knob])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{named}={value} must be a finite number")
        values[knob], given[knob] = value, named
    return cls(**values), Spelling(store, aliases, given)


def store_entry(knobs: Any) -> dict[str, Any]:
    """A store's parsed knobs back as its `kv_stores` entry (the knobs left unset left out):
    what `parse_store_knobs` reads, for a config made from another (a rank's share)."""
    return {k: v for k, v in dataclasses.asdict(knobs).items() if v is not None}
