"""The connector's extra-config, checked before vLLM runs anything (no vLLM needed here)."""

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.settings import check_vllm_version, tier_config


def test_kvtier_knob_names_pass_through() -> None:
    config = tier_config({"kv_offloading_size": 4, "eviction_policy": "arc",
                          "max_load_tokens": 4096, "preemption_mode": "auto"})
    assert config.kv_offloading_size == 4 and config.eviction_policy == "arc"
    assert config.max_load_tokens == 4096


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
    with pytest.raises(ConfigError) as e:
        check_vllm_version("0.31.1")
    assert "supports vLLM 0.32.x, 0.33.x; this is vLLM 0.31.1" in str(e.value)
