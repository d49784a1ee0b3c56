"""The host pool: one honest allocation, refused when it would not fit in RAM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tier.config import GIB, available_ram_bytes
from kvtier.tier.link import HostPool

MIB = 1024**2


def device_kv() -> torch.Tensor:
    # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim] -> 1536 B per block
    return torch.zeros(4, 3, 4, 2, 2, 8)


def test_refuses_a_size_over_the_safe_share_naming_both_numbers() -> None:
    # 4 GiB available -> at most 3.2 GiB; ask for 10 GiB
    with pytest.raises(ConfigError) as err:
        HostPool.from_size(10, device_kv(), available_bytes=4 * GIB)
    assert "10.00 GiB" in str(err.value) and "4.00 GiB available" in str(err.value)


def test_refuses_more_than_this_machine_has() -> None:
    too_big = available_ram_bytes() / GIB * 2
    with pytest.raises(ConfigError, match="lower kv_offloading_size"):
        HostPool.from_size(too_big, device_kv())


def test_refuses_a_size_that_holds_no_block() -> None:
    with pytest.raises(ConfigError, match="holds no block: one block is 1536 bytes"):
        HostPool.from_size(1000 / GIB, device_kv())


def test_a_64_mib_pool_is_held_for_real_and_reported() -> None:
    pool = HostPool.from_size(64 / 1024, device_kv())  # 64 MiB / 1536 B -> 43690 slots
    stats = pool.stats()
    assert stats["num_slots"] == 64 * MIB // 1536 == pool.num_slots
    assert stats["slot_bytes"] == 1536
    assert stats["allocated_bytes"] == stats["num_slots"] * stats["slot_bytes"]
    assert stats["pinned_bytes"] == 0  # CPU device: plain pageable memory
    assert pool.slot(7).shape == (3, 4, 2, 2, 8)
    assert not pool.tensor.any()


def test_the_pool_is_resident_at_construction() -> None:
    # every page is touched at construction: RSS grows by (about) the pool, not by zero. A
    # fresh interpreter, because in a long test session malloc may hand back pages that are
    # already resident, which honestly shows as little growth.
    code = (
        "import json, torch\n"
        "from kvtier.tier.link.host_pool import HostPool\n"
        "kv = torch.zeros(4, 3, 4, 2, 2, 8)\n"
        "print(json.dumps(HostPool.from_size(64 / 1024, kv).stats()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    stats = json.loads(out.stdout)
    assert stats["rss_growth_bytes"] > stats["allocated_bytes"] // 2


def test_like_shapes_slots_after_the_device_blocks() -> None:
    kv = torch.zeros(4, 3, 4, 2, 2, 8, dtype=torch.bfloat16)
    pool = HostPool.like(kv, num_slots=5)
    assert pool.tensor.shape == (5, 3, 4, 2, 2, 8) and pool.tensor.dtype == torch.bfloat16
    assert pool.allocated_bytes == 5 * 768
    with pytest.raises(ConfigError, match="at least one slot"):
        HostPool.like(kv, num_slots=0)
