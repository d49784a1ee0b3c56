"""kv_offload_dtype is validated with the knobs, before any model is loaded: 8-bit blocks need
the host tier, and only int8 and fp8 are known. (The engine end of lossy demotion is
tests/engine/test_lossy_demotion.py.)"""

from __future__ import annotations

import pytest

from kvtier.config import EngineConfig
from kvtier.errors import ConfigError


def test_lossy_needs_the_host_tier() -> None:
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        EngineConfig.from_knobs(kv_offload_dtype="int8")
    with pytest.raises(ConfigError, match="int8, fp8"):
        EngineConfig.from_knobs(kv_offloading_size=0.01, kv_offload_dtype="int4")
