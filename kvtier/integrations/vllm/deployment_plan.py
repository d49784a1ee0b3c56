"""What the connector's scheduler and worker processes derive alike from vLLM's configuration:
block geometry, the expected KV layout, the fingerprint every stored block carries, and each
tensor-parallel rank's share of the tier's sizes."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import vllm

from kvtier.errors import ConfigError
from kvtier.integrations.kit.epochs import read_identity_file
from kvtier.integrations.kit.groups import Window, servable_groups
from kvtier.integrations.kit.identity import config_identity, weights_identity
from kvtier.integrations.kit.parallel import Split
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.worker_side import ExpectedLayout
from kvtier.tier import (
    GIB,
    Fingerprint,
    TierConfig,
    check_fits,
    configured_stores,
    heads_first_coded_shape,
    host_slot_count,
    host_slot_nbytes,
    tenant_rule,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
IDENTITY_IN_KEYS = "in-keys"  # the stored namespace's weights part where resets move it


@dataclass(frozen=True)
class DeploymentPlan:
    """What both processes derive alike from vLLM's configuration. Under tensor parallelism
    a block here is one rank's slice of it (its heads, all layers): each rank stores, writes
    below host and restores only its own slice, in its own storage."""

    block_size: int
    block_nbytes: int  # one block of one rank, all layers
    expected: ExpectedLayout
    fingerprint: Fingerprint  # rank-free: the chain every rank's keys come from
    world_size: int
    rank: int  # this process's worker rank (0 in the scheduler: it reads rank 0's storage)
    config: TierConfig  # this rank's share of the sizes, its own disk directory
    windows: tuple[Window | None, ...]  # per KV cache group (None: every block is kept)
    # model_identity_file given: the weights' identity moves with each cache reset (the
    # version a weight sync loaded), so it lives in the key chain alone (`namespace`)
    identity_moves: bool = False

    @property
    def namespace(self) -> bytes:
        """What this rank's blocks below host carry (and its Redis keys start with): a block
        of another fingerprint, split or rank is refused. Where the identity moves with
        resets, the weights' part is left to the keys (chained from the identity in force):
        the headers and prefixes stay those of a fresh vLLM started on the version a reset
        moved to, so the two share; before, a reset instance kept its start version's, and a
        fresh one on the new version restored nothing from it."""
        base = (replace(self.fingerprint, weights_digest=IDENTITY_IN_KEYS)
                if self.identity_moves else self.fingerprint)
        if self.world_size == 1:
            return base.namespace()
        return base.of_shard(f"rank={self.rank}").namespace()


def _kernels(vllm_config: VllmConfig, platform: Any) -> str:
    """What decides how the attention kernels lay a block's bytes out: the CPU ISA; on CUDA
    the attention backend asked for (or "auto") and the GPU's compute capability, from which
    vLLM's automatic choice follows."""
    if platform.device_type == "cpu":
        return f"cpu-{torch.backends.cpu.get_cpu_capability()}"
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    capability = platform.get_device_capability()
    sm = "unknown" if capability is None else f"{capability.major}{capability.minor}"
    return f"cuda-sm{sm}-{getattr(chosen, 'name', chosen) or 'auto'}"


def _computes_with(vllm_config: VllmConfig) -> str:
    """What vLLM computes KV with beyond the weights: the model's configuration (without
    the fields naming where it was read from: the same bytes at another path share), the
    compute dtype, on-the-fly quantization, the model's implementation and how its kernels
    are compiled."""
    model = vllm_config.model_config
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(compilation, "mode", None), "name", None)
    return "|".join((config_identity(model.hf_config.to_json_string(use_diff=False)),
                     f"dtype={model.dtype}", f"quantization={model.quantization}",
                     f"model_impl={getattr(model, 'model_impl', None)}",
                     f"enforce_eager={model.enforce_eager}", f"compile={mode}"))


def announce(plan: DeploymentPlan, config: TierConfig) -> None:
    """Say at start who the tenants are and how the tier is sized across ranks (the
    scheduler's process, once), and refuse a total the host cannot hold (each rank checks
    only its own share) or quotas naming tenants nothing can name."""
    line, warn = tenant_rule(config.tenant_source, config.kv_tenant_quotas, config.quota_set)
    (log.warning if warn else log.info)(line)
    if plan.world_size == 1:
        return
    check_fits(config.kv_offloading_size * GIB)
    shares = "".join(  # each store's share, as it says (the disk's: its size and directory)
        f"; {s.kind.name} on rank 0: {dict(s.kind.rank_share(s.knobs, 0, plan.world_size))}"
        for s in configured_stores(config) if not s.kind.shared)
    log.info("kvtier: %d tensor-parallel ranks: kv_offloading_size=%g GiB in total, %g GiB "
             "per rank: %d host slots of %d bytes (one rank's heads of a block)%s",
             plan.world_size, config.kv_offloading_size, plan.config.kv_offloading_size,
             plan.expected.host_slots, plan.block_nbytes, shares)


def deployment_plan(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
          config: TierConfig, own: ConnectorSettings, rank: int) -> DeploymentPlan:
    split = Split.of(vllm_config.parallel_config)
    share = split.share(config, rank)
    served = servable_groups(kv_cache_config.kv_cache_groups if kv_cache_config else None)
    assert kv_cache_config is not None
    spec = served[0].group.kv_cache_spec  # every group's blocks have its shape
    platform = vllm.platforms.current_platform
    if platform.device_type not in ("cpu", "cuda"):
        raise ConfigError(f"kvtier's connector runs on vLLM's CPU and CUDA backends; this is "
                          f"{platform.device_type} (its paged layout is not supported)")
    block_size = int(spec.block_size)
    # LBHNC (vLLM CPU's only layout; requested on CUDA by get_required_kvcache_layout):
    # each layer [num_blocks, num_kv_heads, block_size, head_size + head_size_v], the heads
    # this rank holds (the spec is rank 0's worker's, and every rank holds as many)
    width = int(spec.head_size) + int(getattr(spec, "head_size_v", None) or spec.head_size)
    layer_block_shape = (int(spec.num_kv_heads), block_size, width)
    # a block spans the largest group's layers: under the hybrid allocator every group's
    # layer i is one shared tensor (a block id is one group's at a time)
    layers = tuple(max((g.group for g in served), key=lambda g: len(g.layer_names)).layer_names)
    dtype = spec.dtype
    nbytes = len(layers) * math.prod(layer_block_shape) * \
        torch.empty((), dtype=dtype).element_size()
    if config.kv_offload_dtype and width % 2:
        raise ConfigError(f"kv_offload_dtype={config.kv_offload_dtype} needs K and V of one "
                          f"head size (this model's are {spec.head_size} and "
                          f"{width - int(spec.head_size)}); unset it")
    slot_bytes = host_slot_nbytes(nbytes, heads_first_coded_shape(len(layers), layer_block_shape),
                                  config.kv_offload_dtype or "")
    try:
        host_slots = host_slot_count(share.kv_offloading_size, slot_bytes)
    except ConfigError as e:
        if split.world_size == 1:
            raise
        raise ConfigError(f"{e} (kv_offloading_size={config.kv_offloading_size:g} GiB is the "
                          f"total over {split.world_size} ranks: each gets 1/"
                          f"{split.world_size})") from None
    expected = ExpectedLayout(layers, int(kv_cache_config.num_blocks), layer_block_shape, dtype,
                              host_slots)
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    backend = f"vllm-{vllm.__version__}-{_kernels(vllm_config, platform)}-per-layer-HBNC"
    if len(served) > 1 or served[0].window is not None:  # how each group keeps its blocks
        backend += "-" + "|".join(g.describe for g in served)
    pinned = own.model_identity
    if own.model_identity_file is not None:
        pinned = read_identity_file(own.model_identity_file)
    fingerprint = Fingerprint(
        # the engine's instance id (set once, pickled to every worker): its scheduler and
        # workers agree on an unshared identity that no other engine or restart shares
        weights_digest=weights_identity(model.model, model.revision, pinned=pinned,
                                        load_format=vllm_config.load_config.load_format,
                                        instance=str(getattr(vllm_config, "instance_id", ""))),
        architecture=_computes_with(vllm_config),
        # layers kept out of an 8-bit KV cache hold other bytes than the rest
        kv_dtype=f"{str(dtype).removeprefix('torch.')}/{cache.cache_dtype}/skip="
                 f"{getattr(cache, 'kv_cache_dtype_skip_layers', None)}",
        block_size=block_size,
        tokenizer_digest="",  # keys are over token ids: the tokenizer does not change KV
        attention_backend=backend,
        kv_offload_encoding=config.kv_offload_dtype or "",
        parallel=split.describe(),
    )
    return DeploymentPlan(block_size, nbytes, expected, fingerprint, split.world_size, rank, share,
                 tuple(g.window for g in served), own.model_identity_file is not None)
