"""The tier's knobs, named as vLLM and SGLang users know them (`kv_offloading_size`, ...).

`EngineConfig.offload` is one of these; a vLLM connector builds one from its extra config.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import registry
from kvtier.tier.deadline import FETCH_DEADLINE_S
from kvtier.tier.knobs import Bounds, check_bounds, check_types
from kvtier.tier.load_policy import LoadPolicy
from kvtier.tier.tenant_source import TenantSource

KV_OFFLOAD_DTYPES = ("int8", "fp8")
MIN_SECRET_NBYTES = 16  # a remote_kv_secret shorter than this is refused
SAFE_RAM_SHARE = 0.8  # a host pool may take at most this share of the RAM available at start
GIB = 1024**3
DAY_S = 86400.0  # `kv_retention_max_s`'s default: OpenAI's "24h" retention
MAX_TENANT_CHARS = 256


def host_slot_count(size_gib: float, slot_bytes: int) -> int:
    """Slots a host pool of `size_gib` holds: one rule, so a scheduler that only counts
    slots and a worker that allocates them (two processes under vLLM) always agree."""
    num_slots = int(size_gib * GIB // slot_bytes)
    if num_slots < 1:
        raise ConfigError(
            f"kv_offloading_size={size_gib:g} GiB holds no block: one block is "
            f"{slot_bytes} bytes ({slot_bytes / GIB:.6f} GiB); raise it")
    return num_slots


def check_quota(knob: str, quota: Any) -> None:
    """One tenant's quota map, {tier: GiB}: ConfigError naming `knob` otherwise."""
    if not isinstance(quota, dict):
        raise ConfigError(f"{knob}={quota!r} must be an object of tier -> GiB, as "
                          '{"host": 0.5, "disk": 4}')
    tiers = quota_tiers()
    for tier, gib in quota.items():
        if tier not in tiers:
            raise ConfigError(f"{knob} names the tier {tier!r}; quotas are per "
                              f"{' and '.join(tiers)}")
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or \
                not math.isfinite(gib) or gib < 0:
            raise ConfigError(f"{knob}[{tier!r}]={gib!r} must be a finite number of GiB >= 0")


def quota_tiers() -> tuple[str, ...]:
    """The tiers whose books count blocks per tenant: host, and each store of this process's
    own (a shared store's blocks are every instance's)."""
    return ("host", *(kind.name for kind in registry.built_in() if not kind.shared))


def quota_blocks(quota: dict[str, float], slot_bytes: int) -> dict[str, int]:
    """A {tier: GiB} quota in blocks of `slot_bytes`."""
    return {tier: int(gib * GIB // slot_bytes) for tier, gib in quota.items()}


def available_ram_bytes() -> int:
    """RAM the kernel says a new allocation can get without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the field is in kB
    except OSError:
        pass
    # No /proc (macOS, sandboxes): free physical pages, a lower bound of what is available.
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(size_bytes: float, available_bytes: int | None = None) -> None:
    """Refuse a pool larger than SAFE_RAM_SHARE of the RAM available now (ConfigError)."""
    available = available_ram_bytes() if available_bytes is None else available_bytes
    limit = SAFE_RAM_SHARE * available
    if size_bytes > limit:
        raise ConfigError(
            f"kv_offloading_size={size_bytes / GIB:.2f} GiB exceeds {SAFE_RAM_SHARE:.0%} of "
            f"available host RAM ({available / GIB:.2f} GiB available, limit "
            f"{limit / GIB:.2f} GiB); lower kv_offloading_size"
        )


_RATE: Bounds = (0.0, 1e6)  # GB/s; "> 0" is checked with its own message
_SECONDS: Bounds = (0.0, 1e9)
# Ranges of the numeric knobs: past these a value is a typo, not a machine.
BOUNDS: dict[str, Bounds] = {
    "kv_offloading_size": (0.0, 2.0**20),  # GiB: 1 PiB of host memory
    "max_load_tokens": (0, 2**31),
    "blocks_per_chunk": (1, 2**20),
    "load_copy_threads": (1, 256),
    "max_store_gbps": _RATE,
    "max_load_gbps": _RATE,
    "fetch_deadline_s": (0.0, 3600.0),
    "kv_retention_max_s": (0.0, 366 * DAY_S),
    "kv_tenant_labels": (1, 10_000),
}


@dataclass(frozen=True)
class TierConfig:
    """The host-memory KV tier and the tiers below it: off until given a size, as in vLLM.
    What the tier itself enforces, under any client; an engine's policies for using it
    (write-back, idle demotion, preemption, layer-wise loads) are that engine's own."""

    kv_offloading_size: float = 0.0  # GiB of host memory (pinned on CUDA); 0 = off
    eviction_policy: str = "lru"  # host tier: lru | arc
    # Restore or recompute a prefix found in the tier: auto (the planner) | always | never |
    # threshold:TOKENS:INFLIGHT (a fixed rule to compare against, load_policy.py)
    load_policy: str = "auto"
    max_load_tokens: int | None = None  # per request; the rest is recomputed
    blocks_per_chunk: int = 16
    # Cap on background store bandwidth (GB/s, CPU): stores yield memory bandwidth to
    # decode, which is bound by it. None: copy as fast as the link allows. Loads never wait.
    max_store_gbps: float | None = None
    # Cap on host -> device load bandwidth (GB/s, averaged over every load): the restore
    # bandwidth a deployment gives wakes, so decode keeps the rest. The planner plans loads
    # at it. None: as fast as the link allows.
    max_load_gbps: float | None = None
    # CPU threads that share a whole-block host -> device load a request waits on (nothing
    # computes beside it); None: two where the machine has two cores. Layer-wise loads and
    # stores keep one thread: they run beside compute.
    load_copy_threads: int | None = None
    # The MAC secret of the stores instances share (>= 16 bytes, the same on every instance
    # sharing them): a fetched block counts only with a valid MAC under it. Prefer the file
    # (read when the tier is built): vLLM logs its kv-transfer config. Never printed.
    remote_kv_secret: str | None = field(default=None, repr=False)
    remote_kv_secret_file: str | None = None
    # The longest a wake waits on a store below host (seconds): a fetch gets 4x its predicted time
    # (at least 0.5 s) up to this cap, and what has not landed by then is recomputed (a miss,
    # reason "deadline"), and the planner recomputes from that tier until it recovers.
    fetch_deadline_s: float = FETCH_DEADLINE_S
    # Lossy demotion: blocks leave the device as int8 or fp8 with per-head scales (4x fewer
    # bytes than float32, 2x than 16-bit, on the host link, in host memory and below); None:
    # exact bytes.
    kv_offload_dtype: str | None = None
    # The stores below host memory, staged through it (device -> host -> store and back), by
    # name, each with its own knobs, checked by that store (`registry.py`): {"disk": {"path":
    # "/var/kvtier", "size": 100}, "redis": {"url": "redis://host:6379/0"}, "fs": {"path":
    # "/mnt/shared/kv"}}, or a store of your own as {"my_pkg.kv:STORE": {...}}. Walked nearest
    # first: disk, redis, fs, then your own. Their flat names (disk_kv_size, remote_kv_url,
    # ...) are accepted by `TierConfig.of` and every client's config (registry.fold).
    kv_stores: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Retention a request may ask for (kvtier serve's `kv_retention_s` or OpenAI's
    # `prompt_cache_retention`, vLLM's `kv_transfer_params` `kvtier_retention_s`): the longest
    # granted, in seconds (longer is refused, "refused:over_max"); 0 turns retention off.
    kv_retention_max_s: float = DAY_S
    # Zero data retention: a retention that expires erases its blocks from every tier (the
    # device's cached copy and host memory's dropped, a disk slot overwritten with zeros, a
    # shared store's key deleted) and its hash from the retention file, on the next step;
    # False: they stay, as ordinary cached blocks.
    kv_retention_erase: bool = False
    # What names a request's tenant where no API key (or kvtier serve's --tenant-header)
    # does: "none", every such request is one tenant; "cache_salt", its cache_salt, only where
    # the operator's router sets it and clients cannot (a client minting a salt per request
    # would never be over quota, and its neighbour would lose first: tenant_source.py).
    kv_tenant_from: str = "none"
    # Quotas per tenant (see kv_tenant_from), GiB per slot
    # tier: {"host": 0.5, "disk": 4}. A tenant over its quota loses blocks first when a tier
    # must evict, and a retention over it is refused ("refused:quota"). Unset: no quota.
    kv_tenant_quota: dict[str, float] = field(default_factory=dict)
    # Named tenants' own quotas, replacing the default for them: {"alice": {"host": 2}}.
    kv_tenant_quotas: dict[str, dict[str, float]] = field(default_factory=dict)
    # Tenants named in the per-tenant counters (/metrics, vLLM's stats): the ones holding
    # most, the rest counted together as "other", so labels stay bounded.
    kv_tenant_labels: int = 16

    @property
    def enabled(self) -> bool:
        return self.kv_offloading_size > 0

    @property
    def load_threads(self) -> int:
        """`load_copy_threads`, or its default for this machine."""
        if self.load_copy_threads is not None:
            return self.load_copy_threads
        return min(2, os.cpu_count() or 1)

    def validate(self) -> None:
        check_types(self)
        if self.kv_offloading_size < 0:
            raise ConfigError(
                f"kv_offloading_size={self.kv_offloading_size} GiB must be >= 0 (0 = off)"
            )
        if self.max_load_tokens is not None and self.max_load_tokens < 0:
            raise ConfigError(f"max_load_tokens={self.max_load_tokens} must be >= 0")
        if self.blocks_per_chunk < 1:
            raise ConfigError(f"blocks_per_chunk={self.blocks_per_chunk} must be >= 1")
        for name in ("max_store_gbps", "max_load_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be > 0 (or unset)")
        LoadPolicy.parse(self.load_policy)
        TenantSource.parse(self.kv_tenant_from)
        self._validate_quotas()
        self._validate_deep_tiers()
        stores = registry.configured(self)  # each store checks its own knobs
        self._validate_secret(shared=any(store.kind.shared for store in stores))
        if stores and not self.enabled:
            raise ConfigError(
                f"the tiers below host ({', '.join(s.kind.name for s in stores)}) are staged "
                "through host memory: set kv_offloading_size (GiB of host memory) as well")
        check_bounds(self, BOUNDS)

    @property
    def tenant_source(self) -> TenantSource:
        return TenantSource.parse(self.kv_tenant_from)

    @property
    def quota_set(self) -> bool:
        """Any quota configured, default or named."""
        return bool(self.kv_tenant_quota) or bool(self.kv_tenant_quotas)

    @property
    def retention_dir(self) -> str | None:
        """Where retention deadlines are kept across restarts: the first directory a store
        below host owns in this process alone (the disk tier's)."""
        for store in registry.configured(self):
            where: str | None = store.kind.state_dir(store.knobs)
            if where is not None:
                return where
        return None

    @classmethod
    def of(cls, **knobs: Any) -> TierConfig:
        """A config from flat knobs, the stores' flat names (`disk_kv_size`) moved into
        `kv_stores`; ConfigError naming a knob that is none of the tier's."""
        knobs = registry.fold(knobs)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(knobs) - names)
        if unknown:
            raise ConfigError(f"unknown tier knob(s) {', '.join(map(repr, unknown))}; the "
                              f"tier's knobs are: {', '.join(sorted(knob_names()))}")
        return cls(**knobs)

    def _validate_quotas(self) -> None:
        """The quota maps: tiers named as `quota_tiers`, sizes finite GiB >= 0, tenant names
        non-empty strings."""
        check_quota("kv_tenant_quota", self.kv_tenant_quota)
        if not isinstance(self.kv_tenant_quotas, dict):
            raise ConfigError(f"kv_tenant_quotas={self.kv_tenant_quotas!r} must be an object "
                              "of tenant name -> {tier: GiB}")
        for tenant, quota in self.kv_tenant_quotas.items():
            if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
                raise ConfigError(f"kv_tenant_quotas names the tenant {tenant!r}; a tenant is "
                                  f"a non-empty string of at most {MAX_TENANT_CHARS} characters")
            check_quota(f"kv_tenant_quotas[{tenant!r}]", quota)

    def _validate_deep_tiers(self) -> None:
        if not self.fetch_deadline_s > 0:
            raise ConfigError(f"fetch_deadline_s={self.fetch_deadline_s} must be > 0 seconds: "
                              "the longest a wake waits on a store below host before the rest is "
                              f"recomputed (default {FETCH_DEADLINE_S:g})")
        if self.kv_offload_dtype is not None:
            if self.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
                raise ConfigError(f"kv_offload_dtype={self.kv_offload_dtype!r} is not one of "
                                  f"{', '.join(KV_OFFLOAD_DTYPES)} (or unset for exact bytes)")
            if not self.enabled:
                raise ConfigError("kv_offload_dtype encodes blocks on their way down to host "
                                  "memory (and below): set kv_offloading_size as well")

    def _validate_secret(self, shared: bool) -> None:
        """The MAC secret's knobs (`shared`: a store that instances share is configured);
        messages name the knob, never the secret."""
        secret, path = self.remote_kv_secret, self.remote_kv_secret_file
        if secret is not None and path is not None:
            raise ConfigError("remote_kv_secret and remote_kv_secret_file are both set; keep "
                              "remote_kv_secret_file (vLLM logs its kv-transfer config)")
        if (secret is not None or path is not None) and not shared:
            name = "remote_kv_secret" if secret is not None else "remote_kv_secret_file"
            raise ConfigError(f"{name} is set but no store that instances share is configured "
                              "in kv_stores; it authenticates those stores' blocks")
        if secret is not None and len(secret.encode()) < MIN_SECRET_NBYTES:
            raise ConfigError(f"remote_kv_secret is shorter than {MIN_SECRET_NBYTES} bytes; "
                              "use a long random one, e.g. `head -c 32 /dev/urandom | base64`")
        if path is not None and not path.strip():
            raise ConfigError("remote_kv_secret_file is blank; unset it or name the file "
                              "holding the secret")


def knob_names() -> list[str]:
    """Every knob `TierConfig.of` takes: its fields and the stores' flat names."""
    return [f.name for f in fields(TierConfig)] + list(registry.aliases())
