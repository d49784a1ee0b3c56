"""kvtier against SGLang's own HiCache storage contract, run with SGLang's classes on the path
(test_sglang.py starts this file under `.sglang-libs`; it is not collected on its own).

SGLang's factory loads kvtier through `--hicache-storage-backend dynamic`; pages go down from
one host pool and come back, byte for byte, into another; a damaged, forged or foreign page
is a miss; so is a page set by a server that computes its KV otherwise (load format, online
quantization, model overrides, attention backend, SGLang's version). The host pool is a
stand-in with the layout methods of SGLang's MHATokenToKVPoolHost (layer_first), because that
class cannot be imported here: its module imports SGLang's model configs, which import
torchvision, which has no build for this torch."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sglang
import torch
from sglang.srt import runtime_context
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs

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


def written(stores: dict[str, Any], extra: dict[str, Any] | None = None, seed: int = 1,
            keys: list[str] = KEYS) -> LayerFirstHostPool:
    """Pages 0..4 of a filled host pool, set through kvtier; the pool they came from."""
    source = LayerFirstHostPool(seed=seed)
    a = backend({**MODEL, **stores, **(extra or {})}, source)
    try:
        assert a.batch_set_v1(keys, page_indices(list(range(5)))) == [True] * 5
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


# -- what SGLang computes KV with besides the weights' files (issue 42, item 12) -------------
ROPE = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 4096}})
Serving = Callable[[], dict[str, Any]]  # puts this process in one configuration; extra config


@pytest.fixture
def publish(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Publishes server args in this process's SGLang runtime context, as a scheduler process
    has them when it builds its storage backend (its derived leaves left out: computing them
    imports SGLang's model configs, see above); unpublished after the test."""
    monkeypatch.setattr(runtime_context, "_install_derived_leaves",
                        lambda tops, server_args: None)

    def publish(**args: Any) -> None:
        server_args = ServerArgs(**{"model_path": "tiny-test-model", **args})
        runtime_context.get_context().set_server_args(server_args)
    yield publish
    runtime_context.reset_context()


def case_keys(request: pytest.FixtureRequest) -> list[str]:
    """Page keys of this test case alone: Redis outlives a case, and a page another case set
    under the configuration read here would read as a hit."""
    return [hashlib.sha256(f"{request.node.nodeid}/{i}".encode()).hexdigest()
            for i in range(5)]


def reads_back(stores: dict[str, Any], keys: list[str], serving: Serving,
               source: LayerFirstHostPool) -> None:
    """Under `serving`, every page comes back (a hit) with `source`'s bytes."""
    target = LayerFirstHostPool()
    b = backend({**MODEL, **stores, **serving()}, target)
    try:
        assert b.batch_get_v1(keys, page_indices(list(range(5)))) == [True] * 5
        for page in range(5):
            assert torch.equal(target.get_data_page(page * PAGE),
                               source.get_data_page(page * PAGE)), page
    finally:
        b.close()


def assert_kept_apart(stores: dict[str, Any], keys: list[str], one: Serving,
                      other: Serving) -> None:
    """A page set under `one` comes back under `one` and is a miss under `other`. In a shared
    store, once `other` has set the same keys too, each reads back its own bytes (a local
    disk file is one server's: opened under `other`, it drops `one`'s pages)."""
    first = written(stores, one(), seed=1, keys=keys)
    reads_back(stores, keys, one, first)
    miss = backend({**MODEL, **stores, **other()}, LayerFirstHostPool())
    try:
        assert miss.batch_exists(keys) == 0
        assert miss.batch_get_v1(keys, page_indices(list(range(5)))) == [False] * 5
    finally:
        miss.close()
    if "disk_kv_path" in stores:
        return
    second = written(stores, other(), seed=2, keys=keys)
    reads_back(stores, keys, other, second)
    reads_back(stores, keys, one, first)


@pytest.mark.parametrize("one, other", [
    pytest.param({"load_format": "auto"}, {"load_format": "dummy"}, id="load-format-dummy"),
    pytest.param({}, {"quantization": "fp8"}, id="online-quantization-fp8"),
    pytest.param({}, {"json_model_override_args": ROPE}, id="rope-scaling-override"),
    pytest.param({"attention_backend": "flashinfer"}, {"attention_backend": "fa3"},
                 id="attention-backend"),
    pytest.param({"attention_backend": "fa3"},
                 {"attention_backend": "fa3", "decode_attention_backend": "flashinfer"},
                 id="decode-attention-backend"),
])
def test_a_server_computing_kv_otherwise_never_gets_the_pages(
        stores: dict[str, Any], publish: Callable[..., None], request: pytest.FixtureRequest,
        one: dict[str, Any], other: dict[str, Any]) -> None:
    def serving(args: dict[str, Any]) -> Serving:
        def enter() -> dict[str, Any]:
            publish(**args)
            return {}
        return enter
    assert_kept_apart(stores, case_keys(request), serving(one), serving(other))


def test_another_sglang_version_never_gets_the_pages(
        stores: dict[str, Any], publish: Callable[..., None], request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    publish()

    def version(number: str) -> Serving:
        def enter() -> dict[str, Any]:
            monkeypatch.setattr(sglang, "__version__", number)
            return {}
        return enter
    assert_kept_apart(stores, case_keys(request), version("0.5.23"), version("0.5.24"))


def test_model_overrides_fingerprint_alike_in_any_key_order(
        tmp_path: Path, publish: Callable[..., None]) -> None:
    stores = {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}}}
    publish(json_model_override_args=ROPE)
    written(stores)
    rope = json.loads(ROPE)["rope_scaling"]
    reordered = json.dumps({"rope_scaling": dict(reversed(list(rope.items())))})
    for overrides, found in ((reordered, 5), ('{"rope_scaling": null}', 0), ("{}", 0)):
        publish(json_model_override_args=overrides)
        b = backend({**MODEL, **stores}, LayerFirstHostPool())
        try:
            assert b.batch_exists(KEYS) == found, overrides
        finally:
            b.close()


@pytest.mark.parametrize("stated", [
    {"load_format": "dummy"}, {"quantization": "fp8"}, {"model_override_args": json.loads(ROPE)},
    {"attention_backend": "fa3"}, {"kv_cache_dtype": "fp8_e5m2"},
])
def test_without_server_args_the_extra_configs_statements_are_fingerprinted(
        stores: dict[str, Any], request: pytest.FixtureRequest,
        stated: dict[str, Any]) -> None:
    # an SGLang that publishes no server args (or a backend built outside a server)
    with pytest.raises(ValueError, match="not set"):
        runtime_context.get_server_args()
    assert_kept_apart(stores, case_keys(request), lambda: {}, lambda: stated)


def test_the_servers_own_args_win_over_the_extra_configs_statements(
        tmp_path: Path, publish: Callable[..., None]) -> None:
    stores = {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}}}
    publish(load_format="auto", quantization="fp8")
    written(stores)
    b = backend({**MODEL, **stores, "load_format": "dummy", "quantization": None},
                LayerFirstHostPool())
    try:  # the server serves real fp8 weights, whatever the extra config says
        assert b.batch_exists(KEYS) == 5
    finally:
        b.close()


def test_dummy_weights_are_identified_by_the_config_they_are_drawn_from(
        tmp_path: Path, publish: Callable[..., None]) -> None:
    # SGLang seeds every dummy parameter alike: one config's dummy servers compute the same
    # KV (a copy of the config elsewhere too), never a real model's; no weight file is read
    stores = {"kv_stores": {"fs": {"path": str(tmp_path / "fs"), "read_gbps": 1.0}}}
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": 1e4}
    models = {}
    for name, theta in (("model", 1e4), ("copy", 1e4), ("other", 5e5)):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "config.json").write_text(
            json.dumps({**config, "rope_theta": theta, "_name_or_path": name}))
    publish(model_path=str(models["model"]), load_format="dummy")
    written(stores, {"model_identity": None})
    for name, found in (("copy", 5), ("other", 0)):
        publish(model_path=str(models[name]), load_format="dummy")
        b = backend({**stores}, LayerFirstHostPool())
        try:
            assert b.batch_exists(KEYS) == found, name
        finally:
            b.close()
