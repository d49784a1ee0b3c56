"""kvtier against SGLang's own HiCache storage contract, run with SGLang's classes on the path
(test_sglang.py starts this file under `.sglang-libs`; it is not collected on its own).

SGLang's factory loads kvtier through `--hicache-storage-backend dynamic`; pages go down from
one host pool and come back, byte for byte, into another; a damaged, forged or foreign page
is a miss. The host pool is a stand-in with the layout methods of SGLang's
MHATokenToKVPoolHost (layer_first), because that class cannot be imported here: its module
imports SGLang's model configs, which import torchvision, which has no build for this torch."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier.errors import ConfigError
from kvtier.integrations.sglang import KvtierStorage
from kvtier.tier.io.block_format import pack, payload_checksum, unpack

LAYERS, HEADS, DIM, PAGE, TOKENS = 3, 2, 8, 4, 64
SECRET = "a-shared-secret-of-32-bytes-xxxx"


class LayerFirstHostPool:
    """SGLang's MHA host pool, layer_first: [2, layers, tokens, heads, dim], pages of PAGE
    tokens; the page methods as MHATokenToKVPoolHost's."""

    layout = "layer_first"
    page_size = PAGE
    dtype = torch.bfloat16
    size = TOKENS
    size_per_token = 2 * LAYERS * HEADS * DIM * 2

    def __init__(self, seed: int | None = None) -> None:
        shape = (2, LAYERS, TOKENS, HEADS, DIM)
        if seed is None:
            self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        else:
            g = torch.Generator().manual_seed(seed)
            self.kv_buffer = torch.randn(shape, generator=g).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index:index + PAGE, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, LAYERS, PAGE, HEADS, DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index:index + PAGE, :, :] = data_page.reshape(
            2, LAYERS, PAGE, HEADS, DIM)


def storage_config(extra: dict[str, Any], tp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="tiny-test-model",
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierStorage", "interface_v1": 1, **extra})


@pytest.fixture(params=["disk", "fs", "redis"])
def stores(request: Any, tmp_path: Path) -> dict[str, Any]:
    if request.param == "disk":
        return {"disk_kv_path": str(tmp_path / "disk"), "disk_kv_size": 0.01,
                "disk_kv_read_gbps": 1.0}
    if request.param == "fs":
        return {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}}}
    url = os.environ.get("KVTIER_TEST_REDIS_URL")
    if not url:
        pytest.skip("no Redis given (KVTIER_TEST_REDIS_URL)")
    return {"remote_kv_url": url, "remote_kv_read_gbps": 1.0}


def backend(extra: dict[str, Any], pool: LayerFirstHostPool) -> KvtierStorage:
    """As SGLang's cache controller attaches a storage backend."""
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KvtierStorage) and isinstance(made, HiCacheStorage)
    return made


def page_indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


KEYS = [f"{i:064x}" for i in range(1, 6)]
MODEL = {"model_identity": "tiny-test-weights-v1"}


def written(stores: dict[str, Any], extra: dict[str, Any] | None = None
            ) -> LayerFirstHostPool:
    """Pages 0..4 of a filled host pool, set through kvtier; the pool they came from."""
    source = LayerFirstHostPool(seed=1)
    a = backend({**MODEL, **stores, **(extra or {})}, source)
    try:
        assert a.batch_set_v1(KEYS, page_indices(list(range(5)))) == [True] * 5
    finally:
        a.close()
    return source


def test_pages_set_from_one_host_pool_come_back_into_another(stores: dict[str, Any]) -> None:
    source = written(stores)
    target = LayerFirstHostPool()
    b = backend({**MODEL, **stores}, target)
    try:
        assert b.batch_exists(KEYS) == 5 and b.exists(KEYS[0])
        dest = [7, 3, 9, 0, 12]  # any free pages of the target pool
        assert b.batch_get_v1(KEYS, page_indices(dest)) == [True] * 5
        for src, dst in zip(range(5), dest):
            assert torch.equal(target.get_data_page(dst * PAGE), source.get_data_page(src * PAGE))
        # the older calls: page tensors in and out
        page = source.get_data_page(5 * PAGE).contiguous()
        assert b.set(f"{99:064x}", page)
        out = b.get(f"{99:064x}", target.get_dummy_flat_data_page())
        assert out is not None and torch.equal(out, page)
        assert b.get(f"{98:064x}", target.get_dummy_flat_data_page()) is None
    finally:
        b.close()


def test_another_models_pages_are_never_found(stores: dict[str, Any]) -> None:
    written(stores)
    other = backend({"model_identity": "tiny-test-weights-v2", **stores},
                    LayerFirstHostPool())
    try:
        assert other.batch_exists(KEYS) == 0
        assert other.batch_get_v1(KEYS, page_indices(list(range(5)))) == [False] * 5
    finally:
        other.close()


def dcp_rank(extra: dict[str, Any], rank: int, pool: LayerFirstHostPool) -> KvtierStorage:
    """One rank of an MLA model under decode context parallelism: TP 2, DCP 2, so each rank
    holds its own share of every page's tokens (SGLang's own config checks the shape). A
    local disk file is one process's: each rank has its own; the shared stores are shared."""
    if "disk_kv_path" in extra:
        extra = {**extra, "disk_kv_path": f"{extra['disk_kv_path']}-rank{rank}"}
    config = replace(storage_config(extra, tp_rank=rank), tp_size=2, is_mla_model=True,
                     dcp_size=2, dcp_rank=rank, logical_page_size=2 * PAGE)
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KvtierStorage) and made.writer  # both DCP ranks write
    return made


def test_decode_context_parallel_ranks_never_read_each_others_pages(
        stores: dict[str, Any]) -> None:
    # Both DCP ranks set the same page keys, each from its own share of the KV; a restarted
    # rank 1 must get rank 1's bytes back, never rank 0's (issue 42, item 1).
    sources = [LayerFirstHostPool(seed=1), LayerFirstHostPool(seed=2)]
    for rank, source in enumerate(sources):
        b = dcp_rank({**MODEL, **stores}, rank, source)
        try:
            assert b.batch_set_v1(KEYS, page_indices(list(range(5)))) == [True] * 5
        finally:
            b.close()
    for rank, source in enumerate(sources):
        target = LayerFirstHostPool()
        b = dcp_rank({**MODEL, **stores}, rank, target)
        try:
            assert b.batch_get_v1(KEYS, page_indices(list(range(5)))) == [True] * 5
            for page in range(5):
                assert torch.equal(target.get_data_page(page * PAGE),
                                   source.get_data_page(page * PAGE)), (rank, page)
        finally:
            b.close()


def test_a_damaged_page_is_a_miss_and_leaves(tmp_path: Path) -> None:
    stores = {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}}}
    written(stores)
    path = next(p for p in (tmp_path / "fs").rglob(KEYS[2][-64:]) if p.is_file())
    blob = bytearray(path.read_bytes())
    blob[-7] ^= 0x01
    path.write_bytes(bytes(blob))
    target = LayerFirstHostPool()
    b = backend({**MODEL, **stores}, target)
    try:
        assert b.batch_get_v1(KEYS, page_indices(list(range(5)))) == [True, True, False,
                                                                       False, False]
        assert b.get_stats()["misses"] == {"fs:checksum": 1} and not path.exists()
    finally:
        b.close()


def test_a_forged_page_fails_its_mac(tmp_path: Path) -> None:
    stores = {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}},
              "remote_kv_secret": SECRET}
    written(stores)
    other = backend({**MODEL, **stores, "remote_kv_secret": "another-secret-of-32-bytes-yyy"},
                    LayerFirstHostPool(seed=2))
    try:  # another secret's key space: the pages are not even found
        assert other.batch_exists(KEYS) == 0
    finally:
        other.close()
    # a writer without the secret rewrites page 1 with a consistent checksum
    path = next(p for p in (tmp_path / "fs").rglob(KEYS[1][-64:]) if p.is_file())
    header, payload = unpack(path.read_bytes())
    forged = bytes(b ^ 0x01 for b in payload)
    path.write_bytes(pack(replace(header, checksum=payload_checksum(forged)), forged))
    b = backend({**MODEL, **stores}, LayerFirstHostPool())
    try:
        assert b.batch_exists(KEYS) == 5
        assert b.batch_get_v1(KEYS, page_indices(list(range(5)))) == [True] + [False] * 4
        assert b.get_stats()["misses"] == {"fs:mac": 1} and not path.exists()
    finally:
        b.close()


@pytest.mark.parametrize("extra, why", [
    ({**MODEL, "disk_kv_sise": 1}, "unknown key"),
    ({"disk_kv_path": "/tmp/x", "disk_kv_size": 1}, "model_identity"),
    ({**MODEL}, "no store below host"),
    ({**MODEL, "kv_stores": {"fs": {}}}, "needs 'path'"),
])
def test_bad_extra_config_is_a_clear_error(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        backend(extra, LayerFirstHostPool())
