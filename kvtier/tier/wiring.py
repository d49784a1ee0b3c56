"""The one place that wires the tier: configuration and KV layout in, manager and worker out.

Everything is measured or opened before the objects that need it are built, so nothing is
assigned after construction: the link is timed, the disk is opened and its index rebuilt,
the tiers' read rates are probed, then the planner, the indexes and the manager are made.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tier.below import BelowHost
from kvtier.tier.config import TierConfig, host_slot_count
from kvtier.tier.index.disk import DiskTier
from kvtier.tier.index.host import HostTier
from kvtier.tier.index.remote import RemotePresence, RemoteTier
from kvtier.tier.keys import Medium
from kvtier.tier.layout import KVLayout
from kvtier.tier.manager import TierManager, job_ids
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.worker.disk_store import DiskStore
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.io import TierIO
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.probes import measure_disk_gbps, measure_link, open_disk, remote_rate
from kvtier.tier.worker.worker import TierWorker

if TYPE_CHECKING:
    from kvtier.tier.worker.redis_store import RedisStore


@dataclass(frozen=True)
class Tier:
    """A built tier: the scheduler's side and the bytes' side, joined by jobs and results."""

    manager: TierManager
    worker: TierWorker
    presence: RemotePresence | None = None  # the remote presence thread, closed with the tier

    def close(self) -> None:
        """Stop every thread and give the memory back; jobs that never ran fail (unpinned)."""
        if self.presence is not None:
            self.presence.close()
        self.manager.apply(self.worker.close())


def build(config: TierConfig, layout: KVLayout, namespace: bytes, block_size: int,
          prefill_tokens_per_s: float) -> Tier:
    """The host tier over `layout` (and disk / Redis below it when configured).

    `namespace`: the fingerprint digest every block below host carries; `block_size`:
    tokens per block; `prefill_tokens_per_s`: the client's measured prefill speed, the
    planner's starting recompute estimate."""
    _enabled(config)
    with ExitStack() as undo:  # anything opened is closed again if a later step fails
        host, link = _host_and_link(config, layout, undo)
        calibration = measure_link(link, host, prefill_tokens_per_s)
        disk_store, disk_tier = None, None
        if config.disk_enabled:
            disk_store, disk_tier = open_disk(config, host, namespace, block_size)
            undo.callback(disk_store.close)
            rate = config.disk_kv_read_gbps or measure_disk_gbps(
                Path(str(config.disk_kv_path)), host.slot_bytes)
            cap = config.disk_kv_max_gbps
            calibration.tier_gbps[Medium.DISK.value] = min(rate, cap) if cap else rate
        remote_store = None
        if config.remote_enabled:
            from kvtier.tier.worker.redis_store import RedisStore  # the client only if used

            remote_store = RedisStore(str(config.remote_kv_url), namespace,
                                      config.remote_kv_ttl_s)
            undo.callback(remote_store.close)
            calibration.tier_gbps[Medium.REMOTE.value] = remote_rate(
                remote_store, host.slot_bytes, config.remote_kv_read_gbps)
        tier = _assemble(config, block_size, host, link, Planner(calibration), namespace,
                         disk_store, disk_tier, remote_store)
        undo.pop_all()
    return tier


def _assemble(config: TierConfig, block_size: int, host: HostPool, link: TransferEngine,
              planner: Planner, namespace: bytes, disk_store: DiskStore | None,
              disk_tier: DiskTier | None, remote_store: RedisStore | None) -> Tier:
    ids = job_ids()
    host_tier = HostTier(host.num_slots, config.eviction_policy)
    presence = RemotePresence(remote_store.exists_many) if remote_store is not None else None
    below = io = None
    if disk_tier is not None or presence is not None:
        remote_tier = RemoteTier(presence) if presence is not None else None
        below = BelowHost(host_tier, disk_tier, remote_tier, host.slot_bytes, ids,
                          host.encoding)
        io = TierIO(host, namespace, disk_store, remote_store,
                    disk_max_gbps=config.disk_kv_max_gbps)
    manager = TierManager(config, block_size, host_tier, planner, link.layout.block_nbytes,
                          below, ids)
    worker = TierWorker(host, link, io, disk_store, remote_store)
    return Tier(manager, worker, presence)


def build_scheduler_side(config: TierConfig, block_size: int, block_nbytes: int,
                         calibration: Calibration) -> TierManager:
    """The manager alone, for a client whose bytes live in another process (vLLM's
    scheduler): a host index of exactly the slots `build_worker_side` will allocate."""
    _host_only(config)
    slots = host_slot_count(config.kv_offloading_size, block_nbytes)
    return TierManager(config, block_size, HostTier(slots, config.eviction_policy),
                       Planner(calibration), block_nbytes, None, job_ids())


def build_worker_side(config: TierConfig, layout: KVLayout) -> TierWorker:
    """The worker alone, over the KV memory the engine registered (vLLM's worker)."""
    _host_only(config)
    with ExitStack() as undo:
        host, link = _host_and_link(config, layout, undo)
        undo.pop_all()
    return TierWorker(host, link)


def _host_and_link(config: TierConfig, layout: KVLayout, undo: ExitStack
                   ) -> tuple[HostPool, TransferEngine]:
    """The host pool and the device link over it, both undone by `undo` on a failure."""
    host = HostPool.from_size(config.kv_offloading_size, layout,
                              encoding=config.kv_offload_dtype or "")
    undo.callback(host.release)
    link = TransferEngine(layout, host, config.blocks_per_chunk,
                          store_gbps=config.max_store_gbps)
    undo.callback(link.close)
    return host, link


def _enabled(config: TierConfig) -> None:
    if not config.enabled:
        raise ConfigError("the tier is off (kv_offloading_size=0); give it a size in GiB")


def _host_only(config: TierConfig) -> None:
    _enabled(config)
    if config.disk_enabled or config.remote_enabled:
        raise ConfigError(
            "with the scheduler and the worker in two processes kvtier serves the host tier "
            "only for now: unset disk_kv_path/disk_kv_size and remote_kv_url")
