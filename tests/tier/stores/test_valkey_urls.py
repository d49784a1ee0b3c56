"""Valkey's URL schemes name the same forms as Redis's, checked the same way, masked the same
way; a cluster given as valkey-cluster:// parses as a cluster."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig
from kvtier.tier.stores.redis.url import (
    as_redis_url,
    is_cluster_url,
    mask_url,
    parse_cluster_url,
    validate_url,
)


@pytest.mark.parametrize("url, redis", [
    ("valkey://h:6379/0", "redis://h:6379/0"),
    ("valkeys://:pw@h:6380/1", "rediss://:pw@h:6380/1"),
    ("valkey-cluster://h1:7000,h2:7001", "redis-cluster://h1:7000,h2:7001"),
    ("VALKEYS-CLUSTER://h1:7000", "rediss-cluster://h1:7000"),
    ("redis://h/0", "redis://h/0"),
    ("unix:///run/valkey.sock", "unix:///run/valkey.sock"),
])
def test_valkey_schemes_mean_the_redis_ones(url: str, redis: str) -> None:
    assert as_redis_url(url) == redis
    validate_url(url)
    assert is_cluster_url(url) == is_cluster_url(redis)


def test_a_valkey_cluster_parses_as_a_cluster() -> None:
    spec = parse_cluster_url("valkeys-cluster://:secret@h1:7000,h2:7001")
    assert spec.nodes == (("h1", 7000), ("h2", 7001)) and spec.tls
    assert spec.password == "secret"


def test_bad_valkey_urls_are_config_errors_without_the_password() -> None:
    with pytest.raises(ConfigError, match="port") as e:
        validate_url("valkey://:hunter2-hunter2@h:notaport/0")
    assert "hunter2" not in str(e.value)
    assert "hunter2" not in mask_url("valkey://:hunter2-hunter2@h:1/0")
    with pytest.raises(ConfigError, match="redis-cluster://"):
        TierConfig.of(kv_offloading_size=1, remote_kv_url="valkey://h:1/0",
                   remote_kv_read_replicas=True).validate()
    TierConfig.of(kv_offloading_size=1, remote_kv_url="valkey-cluster://h:1",
               remote_kv_read_replicas=True).validate()
