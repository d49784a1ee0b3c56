"""The one place that wires the tier: configuration and KV layout in, manager and worker out.

Everything is measured or opened before the objects that need it are built, so nothing is
assigned after construction: the link is timed, the disk is opened and its index rebuilt,
the tiers' read rates are probed, then the planner, the indexes and the manager are made.
The remote tier's secret is read here, once: its MAC key signs and verifies blocks, and its
key id is mixed into the store's key namespace, so instances with different secrets never
see each other's blocks while clients' namespaces stay as they are.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tier.below import BelowHost
from kvtier.tier.config import MIN_SECRET_NBYTES, TierConfig, host_slot_count
from kvtier.tier.driver import Tier
from kvtier.tier.faults import NO_FAULTS, Faults
from kvtier.tier.index.base import SecondaryIndex
from kvtier.tier.index.host import HostTier
from kvtier.tier.index.remote import RemotePresence, RemoteTier
from kvtier.tier.keys import Medium
from kvtier.tier.layout import KVLayout
from kvtier.tier.manager import TierManager, job_ids
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.redis_url import is_cluster_url
from kvtier.tier.residency_log import ResidencyLog
from kvtier.tier.worker.block_mac import BlockMac
from kvtier.tier.worker.codec import encoded_nbytes
from kvtier.tier.worker.disk_open import open_disk, read_disk_index
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.io import TierIO
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.probes import measure_disk_gbps, measure_link, remote_rate
from kvtier.tier.worker.stores import DiskBlocks, RemoteBlocks, SecondaryStore
from kvtier.tier.worker.worker import TierWorker

if TYPE_CHECKING:
    from kvtier.tier.worker.remote_store import KeyValueStore

log = logging.getLogger(__name__)
DISK, REMOTE = Medium.DISK.value, Medium.REMOTE.value
MAX_SECRET_FILE_NBYTES = 4096  # a secret file holds one secret; more is the wrong file
NO_SECRET_WARNING = (
    "kvtier: the remote tier has no secret, so its blocks are checksummed, not authenticated: "
    "whoever can write to that store chooses the KV every kvtier instance on it serves. Set "
    "remote_kv_secret_file to a file holding the same random secret (at least 16 bytes, e.g. "
    "`head -c 32 /dev/urandom | base64 > FILE`) on every instance.")


def build(config: TierConfig, layout: KVLayout, namespace: bytes, block_size: int,
          prefill_tokens_per_s: float, faults: Faults = NO_FAULTS) -> Tier:
    """The host tier over `layout` (and disk / Redis below it when configured).

    `namespace`: the fingerprint digest every block below host carries; `block_size`:
    tokens per block; `prefill_tokens_per_s`: the client's measured prefill speed, the
    planner's starting recompute estimate; `faults`: what a test makes fail."""
    _enabled(config)
    mac = remote_mac(config)  # a bad secret file stops the build before anything is allocated
    with ExitStack() as undo:  # anything opened is closed again if a later step fails
        host, link = _host_and_link(config, layout, faults, undo)
        calibration = measure_link(link, host, prefill_tokens_per_s)
        stores: list[SecondaryStore] = []
        indexes: list[SecondaryIndex] = []
        if config.disk_enabled:
            disk, disk_index = _disk(config, host, namespace, block_size, undo)
            stores.append(disk)
            indexes.append(disk_index)
            calibration.tier_gbps[DISK] = _disk_rate(config, host.slot_bytes)
        if config.remote_enabled:
            remote = RemoteBlocks(_open_remote(config, namespace, undo, mac), mac,
                                  host.slot_bytes)
            stores.append(remote)
            indexes.append(_presence(remote.store, undo))
            calibration.tier_gbps[REMOTE] = remote_rate(remote.store, host.slot_bytes,
                                                        config.remote_kv_read_gbps)
        manager = _manager(config, block_size, host.num_slots, host.slot_bytes, host.encoding,
                           link.layout.block_nbytes, calibration, indexes)
        io = TierIO(host, namespace, stores, faults.below, faults.slow)
        tier = Tier(manager, TierWorker(host, link, io))
        undo.pop_all()
    return tier


@dataclass(frozen=True)
class SchedulerTier:
    """The bookkeeping half, for a client whose bytes live in another process."""

    manager: TierManager
    resources: ExitStack  # the presence thread's own store connection, closed last

    def close(self) -> None:
        self.manager.close()
        self.resources.close()


def build_scheduler_side(config: TierConfig, block_size: int, block_nbytes: int,
                         calibration: Calibration, namespace: bytes,
                         coded_shape: tuple[int, ...] | None = None,
                         residency: bool = False) -> SchedulerTier:
    """The manager alone (vLLM's scheduler): a host index of exactly the slots
    `build_worker_side` will allocate, the disk index read from the file the worker owns,
    and Redis asked for presence only. The tiers' read rates are measured here, where the
    planner lives. With 8-bit host slots (`kv_offload_dtype`) a slot's size follows from
    `coded_shape`, the block as the codec reads it (`KVLayout.coded_block_shape`).
    `residency`: keep the host and disk residency changes (`take_residency_changes`)."""
    _enabled(config)
    changes = ResidencyLog(enabled=residency)
    encoding = config.kv_offload_dtype or ""
    slot_bytes = host_slot_nbytes(block_nbytes, coded_shape, encoding)
    with ExitStack() as undo:
        indexes: list[SecondaryIndex] = []
        if config.disk_enabled:
            indexes.append(read_disk_index(config, slot_bytes, encoding, namespace, block_size,
                                           changes))
            calibration.tier_gbps[DISK] = _disk_rate(config, slot_bytes)
        if config.remote_enabled:
            # Presence only: the store's namespace, no warning (the worker side gives it).
            store = _open_remote(config, namespace, undo, remote_mac(config, warn=False))
            indexes.append(_presence(store, undo))
            calibration.tier_gbps[REMOTE] = remote_rate(store, slot_bytes,
                                                        config.remote_kv_read_gbps)
        manager = _manager(config, block_size,
                           host_slot_count(config.kv_offloading_size, slot_bytes),
                           slot_bytes, encoding, block_nbytes, calibration, indexes, changes)
        side = SchedulerTier(manager, undo.pop_all())
    return side


def host_slot_nbytes(block_nbytes: int, coded_shape: tuple[int, ...] | None,
                     encoding: str) -> int:
    """Bytes of one host slot for a block of `block_nbytes`: itself, or with an 8-bit
    `encoding` its encoding's, from `coded_shape` (the block as the codec reads it)."""
    if not encoding:
        return block_nbytes
    if coded_shape is None:
        raise ConfigError("kv_offload_dtype (8-bit host slots) needs the block's shape as the "
                          "codec reads it; this client gives none: unset it")
    return encoded_nbytes(coded_shape, encoding)


def build_worker_side(config: TierConfig, layout: KVLayout, namespace: bytes,
                      block_size: int, faults: Faults = NO_FAULTS) -> TierWorker:
    """The worker alone, over the KV memory the engine registered (vLLM's worker): it owns
    the host pool, the disk file (opened, locked, its bad slots invalidated) and the Redis
    connection its I/O thread reads and writes through."""
    _enabled(config)
    mac = remote_mac(config)
    with ExitStack() as undo:
        host, link = _host_and_link(config, layout, faults, undo)
        stores: list[SecondaryStore] = []
        if config.disk_enabled:
            stores.append(_disk(config, host, namespace, block_size, undo)[0])
        if config.remote_enabled:
            stores.append(RemoteBlocks(_open_remote(config, namespace, undo, mac), mac,
                                       host.slot_bytes))
        io = TierIO(host, namespace, stores, faults.below, faults.slow)
        undo.pop_all()
    return TierWorker(host, link, io)


def _manager(config: TierConfig, block_size: int, host_slots: int, slot_bytes: int,
             encoding: str, block_nbytes: int, calibration: Calibration,
             tiers: list[SecondaryIndex], changes: ResidencyLog | None = None) -> TierManager:
    """The bookkeeping: the host index, the planner (over `calibration`, the tiers' read
    rates measured in) and the manager over the tiers below host."""
    ids = job_ids()
    host = HostTier(host_slots, config.eviction_policy, changes)
    below = BelowHost(host, tiers, slot_bytes, ids, encoding)
    return TierManager(config, block_size, host, Planner(calibration), block_nbytes, below, ids,
                       changes)


def _disk(config: TierConfig, host: HostPool, namespace: bytes, block_size: int,
          undo: ExitStack) -> tuple[DiskBlocks, SecondaryIndex]:
    """The disk file (opened, locked, its index rebuilt), closed by `undo` on a failure."""
    store, index = open_disk(config, host, namespace, block_size)
    undo.callback(store.close)
    return DiskBlocks(store, config.disk_kv_max_gbps), index


def _presence(store: KeyValueStore, undo: ExitStack) -> RemoteTier:
    """The remote tier's index: presence asked of `store` on a thread of its own."""
    tier = RemoteTier(RemotePresence(store.exists_many))
    undo.callback(tier.close)
    return tier


def _disk_rate(config: TierConfig, slot_bytes: int) -> float:
    """The disk tier's read rate for the planner: configured, else measured; capped."""
    rate = config.disk_kv_read_gbps or measure_disk_gbps(Path(str(config.disk_kv_path)),
                                                         slot_bytes)
    cap = config.disk_kv_max_gbps
    return min(rate, cap) if cap else rate


def _open_remote(config: TierConfig, namespace: bytes, undo: ExitStack, mac: BlockMac | None
                 ) -> KeyValueStore | None:
    if not config.remote_enabled:
        return None
    if mac is not None:  # another secret, another key space: never found, never deleted
        namespace = mac.store_namespace(namespace)
    url = str(config.remote_kv_url)
    store: KeyValueStore
    if is_cluster_url(url):  # the clients only if used
        from kvtier.tier.worker.redis_cluster_store import ClusterStore

        store = ClusterStore(url, namespace, config.remote_kv_ttl_s,
                             read_replicas=config.remote_kv_read_replicas,
                             write_timeout_s=config.remote_write_timeout_s)
    else:
        from kvtier.tier.worker.redis_store import RedisStore

        store = RedisStore(url, namespace, config.remote_kv_ttl_s,
                           write_timeout_s=config.remote_write_timeout_s)
    undo.callback(store.close)
    return store


def remote_mac(config: TierConfig, warn: bool = True) -> BlockMac | None:
    """The remote tier's MAC from the configured secret (the file read now), or None; with a
    remote tier and no secret, `warn` logs once that the store is trusted blindly."""
    if not config.remote_enabled:
        return None
    secret = _read_secret(config)
    if secret is None:
        if warn:
            log.warning(NO_SECRET_WARNING)
        return None
    return BlockMac.from_secret(secret)


def _read_secret(config: TierConfig) -> bytes | None:
    """The secret's bytes (a file's, surrounding whitespace stripped); ConfigError naming
    the knob and the path, never the secret."""
    if config.remote_kv_secret is not None:
        return config.remote_kv_secret.encode()
    path = config.remote_kv_secret_file
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_FILE_NBYTES + 1).strip()
    except OSError as e:
        raise ConfigError(f"remote_kv_secret_file={path!r} cannot be read "
                          f"({e.strerror or type(e).__name__}); name a readable file holding "
                          "the remote tier's secret") from None
    if len(secret) > MAX_SECRET_FILE_NBYTES:
        raise ConfigError(f"remote_kv_secret_file={path!r} holds more than "
                          f"{MAX_SECRET_FILE_NBYTES} bytes; it should hold one secret")
    if not secret:
        raise ConfigError(f"remote_kv_secret_file={path!r} is empty; put a random secret of at "
                          "least 16 bytes in it (`head -c 32 /dev/urandom | base64 > FILE`)")
    if len(secret) < MIN_SECRET_NBYTES:
        raise ConfigError(f"remote_kv_secret_file={path!r} holds fewer than "
                          f"{MIN_SECRET_NBYTES} bytes; use a longer random secret")
    return secret


def _host_and_link(config: TierConfig, layout: KVLayout, faults: Faults, undo: ExitStack
                   ) -> tuple[HostPool, TransferEngine]:
    """The host pool and the device link over it, both undone by `undo` on a failure."""
    host = HostPool.from_size(config.kv_offloading_size, layout,
                              encoding=config.kv_offload_dtype or "")
    undo.callback(host.release)
    link = TransferEngine(layout, host, config.blocks_per_chunk, faults.link,
                          store_gbps=config.max_store_gbps, load_threads=config.load_threads)
    undo.callback(link.close)
    return host, link


def _enabled(config: TierConfig) -> None:
    if not config.enabled:
        raise ConfigError("the tier is off (kv_offloading_size=0); give it a size in GiB")
