"""`KvtierStorage`: SGLang's `HiCacheStorage` over kvtier's stores (`kvtier.tier.PageStore`).

SGLang owns the host pool; kvtier writes its pages down and reads them back into it. The
zero-copy v1 calls (`interface_v1: 1`) move a page through one flat page tensor of SGLang's
(`get_data_page` / `set_from_flat_data_page`, so any host layout works); the older calls
take and fill page tensors directly. A call never raises into SGLang's storage threads: a
failure is a False (a miss), logged once per kind.

A page's fingerprint holds what SGLang computes its KV with besides the weights' files, read
from the server args SGLang publishes in its process (`sglang.srt.runtime_context`, the
values in effect): the load format, dtype, online quantization and KV scales, model overrides
(RoPE scaling), the model's implementation, the KV cache dtype, the attention backends and
SGLang's version. Where no server args can be read, the extra config's statements of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.kit.identity import config_identity, weights_identity
from kvtier.tier import GIB, Fingerprint, PageStore, TierConfig, knob_names

log = logging.getLogger(__name__)

# SGLang's server args a page's KV depends on besides the weights' files (model_path, read
# too, only names where the weights are)
COMPUTES_WITH = ("load_format", "revision", "dtype", "quantization", "quantization_param_path",
                 "modelopt_quant", "modelopt_checkpoint_restore_path", "model_impl",
                 "json_model_override_args", "kv_cache_dtype", "attention_backend",
                 "prefill_attention_backend", "decode_attention_backend")
# the extra config's names for those an operator states where SGLang's server args cannot be
# read (an SGLang without them published, a backend built outside a server)
STATED = {"load_format": "load_format", "revision": "revision", "dtype": "dtype",
          "quantization": "quantization", "model_override_args": "json_model_override_args",
          "kv_cache_dtype": "kv_cache_dtype", "attention_backend": "attention_backend"}
# SGLang's own keys in the extra config; kvtier's model keys; the rest are TierConfig's.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
MODEL_KEYS = frozenset({"model_path", "model_identity", *STATED})
_announced: set[str] = set()  # what this process has said it fingerprints (said once)


class KvtierStorage(HiCacheStorage):
    """kvtier's disk, Redis/Valkey and shared-directory stores as SGLang's HiCache L3."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self._knobs = {k: v for k, v in extra.items() if k not in SGLANG_KEYS | MODEL_KEYS}
        fields = knob_names()
        unknown = sorted(set(self._knobs) - set(fields))
        if unknown:
            raise ConfigError(f"hicache storage extra config has unknown key(s) "
                              f"{', '.join(map(repr, unknown))}; kvtier's store knobs are: "
                              f"{', '.join(sorted(fields))}")
        served = _served_with()
        self.computes_with = _computes_with(served, extra)
        model = str(extra.get("model_path") or (served or {}).get("model_path")
                    or storage_config.model_name or "")
        try:
            self.identity = _weights(model, (served or extra).get("revision"),
                                     extra.get("model_identity"),
                                     self.computes_with.get("load_format", "auto"))
        except ConfigError as e:
            raise ConfigError(f"hicache storage extra config: {e}; or give model_path (the "
                              "weights' directory) or model_identity") from None
        self.writer = storage_config.is_storage_writer  # MLA: one rank writes the shared KV
        self.store: PageStore | None = None
        self.page_size = 0
        self._logged: set[str] = set()

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the stores once SGLang's host pool says what a page is."""
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            return
        self.page_size = int(mem_pool_host.page_size)
        page = mem_pool_host.get_dummy_flat_data_page()
        page_nbytes = page.numel() * page.element_size()
        host_gib = max(mem_pool_host.size * mem_pool_host.size_per_token / GIB, 1e-6)
        config = TierConfig.of(**{"kv_offloading_size": host_gib, **self._knobs})
        self.store = PageStore.open(config, self._namespace(mem_pool_host), page_nbytes)
        log.info("kvtier: SGLang HiCache storage over %s, pages of %d bytes",
                 ", ".join(self.store.names), page_nbytes)

    # -- SGLang's zero-copy v1 calls --------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._guard("exists", lambda: self._pages().exists(_keys(keys)), 0)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        def run() -> list[bool]:
            pool = self.mem_pool_host
            pages = [pool.get_dummy_flat_data_page() for _ in keys]
            ok = self._pages().get(_keys(keys), [_bytes(p) for p in pages])
            for i, good in enumerate(ok):
                if good:
                    pool.set_from_flat_data_page(int(host_indices[i * self.page_size]),
                                                 pages[i])
            return ok
        return self._guard("get", run, [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        if not self.writer:
            return [True] * len(keys)  # another rank writes this shared KV

        def run() -> list[bool]:
            pool = self.mem_pool_host
            pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True)
                     .contiguous() for i in range(len(keys))]
            return self._pages().put(_keys(keys), [_bytes(p) for p in pages])
        return self._guard("set", run, [False] * len(keys))

    # -- the older calls, page tensors in and out --------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if target_locations is None:
            return [None] * len(keys)
        targets = list(target_locations)
        ok = self._guard("get", lambda: self._pages().get(
            _keys(keys), [_bytes(t) for t in targets]), [False] * len(keys))
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.writer:
            return True
        if values is None:
            return False
        pages = [v.contiguous() for v in values]
        return all(self._guard("set", lambda: self._pages().put(
            _keys(keys), [_bytes(p) for p in pages]), [False]))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Nothing: shared stores hold other instances' pages, kept or expired by their own
        policy (disk evicts LRU, Redis by its TTL and maxmemory)."""

    def get_stats(self) -> dict[str, Any] | None:
        return self.store.stats() if self.store is not None else None

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # -----------------------------------------------------------------------------------
    def _namespace(self, pool: Any) -> bytes:
        """The fingerprint every page carries: the weights and what SGLang computes KV with
        besides them (`computes_with`), the page's geometry and dtype, SGLang's layout and
        this rank's slice (MLA KV is the same on every TP rank, but under decode context
        parallelism each DCP rank holds its own share of a page's tokens under the same page
        key)."""
        c = self.storage_config
        how = dict(self.computes_with)
        version = how.pop("sglang")
        kv_cache_dtype = how.pop("kv_cache_dtype", None)
        backend = how.pop("attention_backend", None)
        computes = "".join(f"|{k}={v}" for k, v in sorted(how.items()))
        mla = bool(c.is_mla_model)
        dcp_size = int(getattr(c, "dcp_size", 1))  # SGLang before 0.5.23 has no DCP
        dcp = f"dcp{c.dcp_rank}of{dcp_size}" if dcp_size > 1 else ""
        shard = dcp if mla else f"tp{c.tp_rank}"
        fingerprint = Fingerprint(
            weights_digest=self.identity,
            architecture=f"sglang:{Path(str(c.model_name or '')).name}:mla={mla}{computes}",
            kv_dtype=str(pool.dtype) + (f"/{kv_cache_dtype}" if kv_cache_dtype else ""),
            block_size=self.page_size, tokenizer_digest="",
            attention_backend=f"sglang-{version}-hicache:{pool.layout}"
                              + (f":{backend}" if backend else ""),
            parallel=f"tp={c.tp_size},pp={c.pp_size},cp={c.attn_cp_size}"
                     + (f",dcp={dcp_size}" if dcp else ""),
            shard=f"{shard}pp{c.pp_rank}cp{c.attn_cp_rank}")
        return fingerprint.namespace()

    def _pages(self) -> PageStore:
        if self.store is None:
            raise KvtierError("no host pool registered yet")
        return self.store

    def _guard(self, what: str, run: Any, failed: Any) -> Any:
        """`run()`, or `failed` (a miss) where it raises: SGLang's threads never see it."""
        try:
            return run()
        except (KvtierError, OSError, ValueError) as e:
            if what not in self._logged:
                self._logged.add(what)
                log.warning("kvtier: a HiCache %s failed (%s); its pages are misses (logged "
                            "once)", what, e)
            return failed


def _served_with() -> dict[str, Any] | None:
    """The server args SGLang serves this process with (`COMPUTES_WITH` and model_path), as
    its runtime context resolved them (an "auto" attention backend is the one chosen); None
    where none are published or this SGLang has no such accessor."""
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:  # SGLang before its runtime context: the retired global accessor
        try:
            from sglang.srt.server_args import get_global_server_args
            legacy = get_global_server_args()
        except (ImportError, ValueError, RuntimeError):
            return None
        return {name: getattr(legacy, name, None) for name in (*COMPUTES_WITH, "model_path")}
    context = get_context()
    try:
        args = context.server_args
    except ValueError:  # nothing published: not a server's process
        return None

    def leaf(name: str) -> Any:
        try:
            return context.config_leaf(name)
        except (ValueError, AttributeError):  # not projected: the raw input
            return getattr(args, name, None)
    return {name: leaf(name) for name in (*COMPUTES_WITH, "model_path")}


def _computes_with(served: dict[str, Any] | None, extra: dict[str, Any]) -> dict[str, str]:
    """What SGLang computes a page's KV with besides the weights' files, canonical (so equal
    configurations fingerprint alike): the server's args where found, else the extra config's
    statements; always SGLang's version. Said once per process at INFO."""
    stated = {STATED[k]: v for k, v in extra.items() if k in STATED}
    if served is None:
        inputs = {name: _canonical(name, value) for name, value in stated.items()}
        source = ("the extra config (SGLang's server args were not found; state the rest "
                  f"there: {', '.join(k for k in STATED if STATED[k] not in stated)})")
    else:
        inputs = {name: _canonical(name, served.get(name)) for name in COMPUTES_WITH}
        prefill = inputs.pop("prefill_attention_backend")
        decode = inputs.pop("decode_attention_backend")
        chosen = inputs["attention_backend"]
        prefill, decode = (chosen if b == "None" else b for b in (prefill, decode))
        inputs["attention_backend"] = (prefill if prefill == decode
                                       else f"prefill:{prefill},decode:{decode}")
        for name, value in stated.items():
            if _canonical(name, value) != inputs[name]:
                log.warning("kvtier: the extra config states %s=%r, but SGLang serves with %s; "
                            "kvtier fingerprints the server's", name, value, inputs[name])
        source = "SGLang's server args"
    inputs["sglang"] = str(getattr(sglang, "__version__", "unknown"))
    said = ", ".join(f"{k}={v}" for k, v in sorted(inputs.items()))
    if said not in _announced:
        _announced.add(said)
        log.info("kvtier: SGLang pages are fingerprinted with %s, from %s", said, source)
    return inputs


def _canonical(name: str, value: Any) -> str:
    """One input as the fingerprint holds it: model overrides as key-sorted JSON (`{}` when
    none), a KV scales file by a digest of its bytes, an enum by its value."""
    if name == "json_model_override_args":
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            return str(value)  # SGLang would not start with it; fingerprinted as given
        return json.dumps(value or {}, sort_keys=True, separators=(",", ":"))
    if name == "modelopt_quant" and isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    if name == "quantization_param_path" and value:
        try:
            return "blake2b:" + hashlib.blake2b(Path(value).read_bytes(),
                                                digest_size=16).hexdigest()
        except OSError:
            return str(value)
    value = getattr(value, "value", value)
    return str(value).lower() if name == "load_format" else str(value)


def _weights(model: str, revision: str | None, pinned: str | None, load_format: str) -> str:
    """The weights' identity (`weights_identity`, for the files SGLang's load format reads);
    under load_format=dummy, that of the config SGLang draws them from, without reading a
    weight: SGLang seeds every dummy parameter alike (`initialize_dummy_weights`), so dummy
    servers of one config compute the same KV, and "dummy:" keeps it from the real model's."""
    if load_format != "dummy":
        return weights_identity(model, revision, pinned, load_format)
    if pinned is not None:
        return "dummy:" + weights_identity(model, revision, pinned)
    config = Path(model) / "config.json"
    if not config.is_file():
        return "dummy:" + weights_identity(model, revision)  # a hub name pinned to a commit
    try:
        text = config_identity(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"kvtier cannot read {config} to identify dummy weights: {e}") from e
    return "dummy:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _keys(keys: list[str]) -> list[bytes]:
    """SGLang's page hashes (hex) as kvtier keys; any other string as its UTF-8 bytes."""
    out = []
    for key in keys:
        try:
            out.append(bytes.fromhex(key))
        except ValueError:
            out.append(key.encode())
    return out


def _bytes(page: torch.Tensor) -> memoryview:
    """A contiguous page tensor's bytes, no copy (any dtype, bf16 included)."""
    return memoryview(page.view(torch.uint8).numpy()).cast("B")
