"""Engine knobs as frozen dataclasses, named as vLLM and SGLang users already know them."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig, check_bounds, check_types, store_aliases

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CacheConfig:
    """The device KV pool: how many blocks of how many tokens, and whether prefixes are reused."""

    block_size: int = 16
    kv_cache_size: float = 1.0  # GiB of device memory for KV blocks
    num_device_blocks: int | None = None  # an exact block count; wins over kv_cache_size
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        check_types(self)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size={self.block_size} must be a power of two in 1..256")
        if self.num_device_blocks is not None and self.num_device_blocks < 1:
            raise ConfigError(f"num_device_blocks={self.num_device_blocks} must be >= 1")
        if self.num_device_blocks is None and not self.kv_cache_size > 0:
            raise ConfigError(f"kv_cache_size={self.kv_cache_size} GiB must be > 0")
        check_bounds(self, {"kv_cache_size": (0.0, 2.0**20), "num_device_blocks": (1, 2**31)})


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (chunked prefill)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the device pool

    def validate(self) -> None:
        check_types(self)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2")
        check_bounds(self, {"max_num_seqs": (1, 2**20), "max_num_batched_tokens": (1, 2**31),
                            "max_model_len": (2, 2**31)})


class Choice(str, enum.Enum):
    """A knob with a few named values; prints as the name a user types ("write_back")."""

    def __str__(self) -> str:
        return self.value


class WritePolicy(Choice):
    """When a finished prefix goes down to host: at once, or when the device evicts it."""

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"  # exclusive tiers: a loaded block leaves host, written back later


class PreemptionMode(Choice):
    AUTO = "auto"  # the planner picks swap or recompute per sequence
    SWAP = "swap"
    RECOMPUTE = "recompute"


class LoadMode(Choice):
    # layer-wise where the copies run on an engine of their own (CUDA's copy streams), async
    # on a CPU, where copies and compute share the cores: there a layer-wise wake measured
    # slower than an async one at every length (benchmarks/wake.py, 2 cores: 2048 tokens
    # 137 vs 105 ms, 4096 tokens 193 vs 148 ms)
    AUTO = "auto"
    ASYNC = "async"  # wait for the whole load before the request's first step
    LAYERWISE = "layerwise"  # overlap the load with compute, layer by layer

    def on(self, device_type: str) -> LoadMode:
        """What AUTO is on this kind of device ("cpu", "cuda"); any other mode itself."""
        if self is not LoadMode.AUTO:
            return self
        return LoadMode.ASYNC if device_type == "cpu" else LoadMode.LAYERWISE


@dataclass(frozen=True)
class OffloadPolicy:
    """How kvtier's engine uses the tier: policies the engine honours, not the tier (under vLLM
    the connector refuses them). Strings from the user become enums here, once."""

    kv_write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    idle_offload_s: float = 0.0  # demote cached blocks idle this long even without pressure; 0=off
    preemption_mode: PreemptionMode = PreemptionMode.AUTO
    load_mode: LoadMode = LoadMode.AUTO
    max_offload_tokens: int | None = None  # per request

    def on(self, device_type: str) -> OffloadPolicy:
        """This policy with `load_mode` settled for the engine's device (AUTO resolved)."""
        return dataclasses.replace(self, load_mode=self.load_mode.on(device_type))

    def __post_init__(self) -> None:
        for name, kind in (("kv_write_policy", WritePolicy), ("preemption_mode", PreemptionMode),
                           ("load_mode", LoadMode)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                choices = ", ".join(m.value for m in kind)
                raise ConfigError(f"{name}={value!r} is not one of {choices}") from None

    def validate(self) -> None:
        check_types(self)
        if self.idle_offload_s < 0:
            raise ConfigError(f"idle_offload_s={self.idle_offload_s} must be >= 0 (0 = off)")
        if self.max_offload_tokens is not None and self.max_offload_tokens < 0:
            raise ConfigError(f"max_offload_tokens={self.max_offload_tokens} must be >= 0")
        check_bounds(self, {"idle_offload_s": (0.0, 1e9), "max_offload_tokens": (0, 2**31)})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from; `from_knobs` takes the flat keyword style of vLLM."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    seed: int = 0
    # Every token's numerics independent of batch composition and chunking (CPU only), so a
    # restored or recomputed session matches a never-preempted one bit for bit. Costs speed.
    batch_invariant: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload: TierConfig = field(default_factory=TierConfig)
    policy: OffloadPolicy = field(default_factory=OffloadPolicy)

    def validate(self) -> None:
        check_types(self)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        self.cache.validate()
        self.scheduler.validate()
        self.offload.validate()
        self.policy.validate()

    @classmethod
    def from_knobs(cls, model: str | None = None, **knobs: Any) -> EngineConfig:
        """Route flat knobs (`block_size=16, max_num_seqs=8`) to the sub-config that owns them."""
        own = {f.name for f in dataclasses.fields(cls)} - set(SECTIONS)
        sections: dict[str, dict[str, Any]] = {name: {} for name in (*SECTIONS, "engine")}
        owners = {name: "engine" for name in own}
        for section, section_cls in SECTIONS.items():
            owners.update({f.name: section for f in dataclasses.fields(section_cls)})
        owners.update({name: "offload" for name in store_aliases()})  # the stores' flat knobs
        for key, value in knobs.items():
            if key not in owners:
                known = ", ".join(sorted(owners))
                raise ConfigError(f"unknown engine knob {key!r}; known knobs: {known}")
            sections[owners[key]][key] = value
        sections["engine"].setdefault("model", model)
        config = cls(
            **{name: section_cls(**sections[name]) for name, section_cls in SECTIONS.items()
               if name != "offload"},
            offload=TierConfig.of(**sections["offload"]), **sections["engine"],
        )
        config.validate()
        return config


SECTIONS: dict[str, type] = {
    "cache": CacheConfig, "scheduler": SchedulerConfig, "offload": TierConfig,
    "policy": OffloadPolicy,
}


@dataclasses.dataclass(frozen=True)
class Knob:
    """One flat knob as the CLI offers it: its name, its type as written, its default."""

    name: str
    type: str
    default: Any


def knob_fields() -> list[Knob]:
    """Every flat knob, in a stable order (engine first, the stores' flat names last), for
    the CLI and the server."""
    engine = [f for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
    fields = engine + [f for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    out = [Knob(f.name, str(f.type), f.default) for f in fields]
    for alias, (kind, knob) in store_aliases().items():
        [field] = [f for f in dataclasses.fields(kind.knobs_type) if f.name == knob]
        out.append(Knob(alias, str(field.type), field.default))
    return out
