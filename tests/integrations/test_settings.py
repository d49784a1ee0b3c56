"""The connector's extra-config, checked before vLLM runs anything (no vLLM needed here)."""

import dataclasses
import json
import typing
from typing import Any

import pytest

from kvtier.config import OffloadPolicy
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.settings import (
    ENGINE_ONLY,
    ConnectorSettings,
    check_vllm_version,
    prior,
    settings,
)
from kvtier.tier import TierConfig, store_aliases


def tier_config(extra: dict[str, Any]) -> TierConfig:
    return settings(extra)[0]


def test_kvtier_knob_names_pass_through() -> None:
    config, own = settings({"kv_offloading_size": 4, "eviction_policy": "arc",
                            "max_load_tokens": 4096, "preemption_mode": "auto",
                            "model_identity": "registry/llama@7", })
    assert config.kv_offloading_size == 4 and config.eviction_policy == "arc"
    assert config.max_load_tokens == 4096
    assert own == ConnectorSettings(model_identity="registry/llama@7")
    assert not own.enable_residency_details  # opt-in, as vLLM's prompt token details


def _numeric(hint: Any) -> bool:
    return typing.get_origin(hint) is not dict and bool(  # a map's values are not a knob
        set(typing.get_args(hint) or (hint,)) & {int, float})


def _numeric_knobs() -> list[str]:
    """The tier's numeric knobs, the stores' (by their flat names) and the engine policies'
    (refused under vLLM, and a hostile value of one is refused by name before that)."""
    names = []
    for cls in (TierConfig, OffloadPolicy):
        hints = typing.get_type_hints(cls)
        names += [f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name])]
    for alias, (kind, knob) in store_aliases().items():
        if _numeric(typing.get_type_hints(kind.knobs_type)[knob]):
            names.append(alias)
    return names


# What JSON can carry into kv_connector_extra_config: json.loads parses Infinity and NaN.
HOSTILE = json.loads('[Infinity, -Infinity, NaN, 1e300, -1e300, -1, "1", true, [1], {"a": 1}]')


@pytest.mark.parametrize("knob", _numeric_knobs())
@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_every_numeric_knob_refuses_hostile_values_by_name(knob: str, value: Any) -> None:
    extra = {"kv_offloading_size": 1, "disk_kv_path": "/tmp/kvtier-never-created",
             "disk_kv_size": 1, "remote_kv_url": "redis://127.0.0.1:1/0", knob: value}
    with pytest.raises(ConfigError) as e:
        settings(extra)
    assert f"{knob}=" in str(e.value), str(e.value)
    assert "kv_connector_extra_config" in str(e.value)


def test_numeric_knobs_are_found() -> None:
    assert {"kv_offloading_size", "disk_kv_size", "max_load_tokens", "blocks_per_chunk",
            "remote_kv_ttl_s", "disk_kv_read_gbps", "idle_offload_s",
            "max_offload_tokens"} <= set(_numeric_knobs())


@pytest.mark.parametrize(("extra", "message"), [
    ({"model_identity": ""}, "model_identity='' names nothing"),
    ({"model_identity": 7}, "model_identity=7 is a int; it must be a string or null"),
    ({"model_identity": "v7", "model_identity_file": "/etc/v"}, "both name the weights"),
    ({"model_identity_file": 3}, "model_identity_file=3 is a int"),
    ({"load_policy": "threshold:1024"}, "load_policy='threshold:1024': threshold needs two"),
    ({"enable_residency_details": "yes"}, "must be true or false"),
    ({"kv_handoff_wait_s": 0}, "kv_handoff_wait_s=0 must be seconds > 0"),
    ({"kv_handoff_wait_s": float("nan")}, "kv_handoff_wait_s=nan must be a finite number"),
    ({"kv_handoff_wait_s": "5"}, "kv_handoff_wait_s='5' is a str"),
])
def test_connector_knobs_are_checked_too(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        settings({"kv_offloading_size": 1, **extra})
    assert message in str(e.value)


@pytest.mark.parametrize(("extra", "message"), [
    ({"kv_offloading_sise": 4}, "unknown key(s) 'kv_offloading_sise'"),
    ({"kv_offloading_size": "4"}, "kv_offloading_size='4' is a str; it must be a number"),
    ({"kv_offloading_size": True}, "is a bool; it must be a number"),
    ({"kv_offloading_size": 1, "max_load_tokens": 1.5}, "must be an integer or null"),
    ({}, "needs kv_offloading_size > 0"),
    ({"kv_offloading_size": 0}, "needs kv_offloading_size > 0"),
    ({"kv_offloading_size": -1}, "must be >= 0"),
    ({"kv_offloading_size": 1, "kv_write_policy": "later"}, "kv_write_policy='later'"),
    ({"kv_offloading_size": 1, "disk_kv_size": 1}, "disk_kv_path is not"),
])
def test_a_bad_extra_config_names_the_value_and_the_fix(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        tier_config(extra)
    assert message in str(e.value)


def test_untested_vllm_versions_are_refused() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0")
    check_vllm_version("0.34.0")  # its classes checked: tests/integrations/test_vllm_conformance
    for version in ("0.31.1", "0.35.0"):
        with pytest.raises(ConfigError) as e:
            check_vllm_version(version)
        assert f"supports vLLM 0.32.x, 0.33.x, 0.34.x; this is vLLM {version}" in str(e.value)


def test_a_secret_of_the_wrong_type_is_refused_without_being_shown() -> None:
    with pytest.raises(ConfigError) as e:
        settings({"kv_offloading_size": 1, "remote_kv_url": "redis://127.0.0.1:1/0",
                  "remote_kv_secret": 12345678901234567890})
    assert "remote_kv_secret (its value hidden" in str(e.value)
    assert "12345678901234567890" not in str(e.value)


@pytest.mark.parametrize(("knob", "value"), [
    ("idle_offload_s", 30.0), ("preemption_mode", "swap"), ("load_mode", "layerwise"),
    ("max_offload_tokens", 4096), ("kv_write_policy", "write_back"),
])
def test_engine_only_knobs_are_refused_under_vllm(knob: str, value: Any) -> None:
    """Accepted and ignored would be a lie: each of these only changes kvtier's own engine."""
    with pytest.raises(ConfigError) as e:
        settings({"kv_offloading_size": 1, knob: value})
    assert f"{knob}={value!r} is honoured by kvtier's own engine only" in str(e.value)
    assert "unset it" in str(e.value)


def test_engine_only_knobs_at_their_defaults_pass() -> None:
    for load_mode in ("auto", "async"):  # what the connector does: loads before the forward
        settings({"kv_offloading_size": 1, "idle_offload_s": 0, "preemption_mode": "auto",
                  "load_mode": load_mode, "max_offload_tokens": None,
                  "kv_write_policy": "write_through"})
    with pytest.raises(ConfigError, match="load_mode='layerwise'"):
        settings({"kv_offloading_size": 1, "load_mode": "layerwise"})


def test_two_connectors_never_share_a_planner_prior() -> None:
    """The planner mutates its calibration (the tiers' read rates among it): each connector
    gets its own (a module-level one was copied shallowly, its dict shared by all)."""
    a, b = prior(), prior()
    a.tier_gbps["disk"] = 1.0
    a.link_gbps = 99.0
    assert b.tier_gbps == {} and b.link_gbps == 5.0 and prior().tier_gbps == {}


def test_every_engine_policy_is_refused_under_vllm_with_its_reason() -> None:
    """One list: a policy added to kvtier's engine is refused under vLLM until it is honoured."""
    assert set(ENGINE_ONLY) == {f.name for f in dataclasses.fields(OffloadPolicy)}
    assert not set(ENGINE_ONLY) & {f.name for f in dataclasses.fields(TierConfig)}


def test_tenancy_knobs_pass_through_and_a_bad_quota_is_refused_by_name() -> None:
    config = tier_config({"kv_offloading_size": 1, "kv_retention_max_s": 600,
                          "kv_tenant_quota": {"host": 0.5}, "kv_tenant_labels": 4,
                          "kv_tenant_quotas": {"alice": {"host": 2, "disk": 8}}})
    assert config.kv_retention_max_s == 600 and config.kv_tenant_labels == 4
    assert config.kv_tenant_quota == {"host": 0.5}
    assert config.kv_tenant_quotas == {"alice": {"host": 2, "disk": 8}}
    for bad, message in (({"kv_tenant_quota": {"gpu": 1}}, "names the tier 'gpu'"),
                         ({"kv_tenant_quotas": {"a": {"host": -1}}}, "must be a finite"),
                         ({"kv_retention_max_s": -1}, "kv_retention_max_s=")):
        with pytest.raises(ConfigError, match=message):
            settings({"kv_offloading_size": 1, **bad})
