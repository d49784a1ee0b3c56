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
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError

Bounds = tuple[float, float]  # inclusive [low, high]


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


def check_bounds(config: Any, bounds: Mapping[str, Bounds]) -> None:
    """ConfigError for the first numeric field outside its inclusive `bounds` (None, the
    "unset" of optional knobs, is never bounded)."""
    for name, (low, high) in bounds.items():
        value = getattr(config, name)
        if isinstance(value, (int, float)) and not low <= value <= high:
            raise ConfigError(f"{name}={_num(value)} must be in [{_num(low)}, {_num(high)}]")


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
