"""The one place that wires the tier: configuration and KV layout in, manager and worker out.

Everything is measured or opened before the objects that need it are built, so nothing is
assigned after construction: the link is timed, each configured store (`registry.py`) is
opened, its index rebuilt or connected and its read rate probed, then the planner, the
indexes and the manager are made. The builders loop over the stores; none is named here.
The deployment's secret is read here, once: its MAC key signs and verifies the blocks of the
stores other instances share, and its key id is mixed into their key namespace, so instances
with different secrets never see each other's blocks while clients' namespaces stay as
they are.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.books.residency_log import ResidencyLog
from kvtier.tier.books.retention_file import RetentionFile
from kvtier.tier.books.tenancy import Quotas, Tenancy
from kvtier.tier.config import MIN_SECRET_NBYTES, TierConfig, host_slot_count, quota_blocks
from kvtier.tier.driver import Tier
from kvtier.tier.faults import NO_FAULTS, Faults
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.io.kind import StoreSite, configured_stores
from kvtier.tier.io.store import SecondaryStore
from kvtier.tier.io.thread import TierIO
from kvtier.tier.layout import KVLayout
from kvtier.tier.link.codec import encoded_nbytes
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.probe import measure_link
from kvtier.tier.link.transfer import TransferEngine
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.worker import TierWorker

log = logging.getLogger(__name__)
MAX_SECRET_FILE_NBYTES = 4096  # a secret file holds one secret; more is the wrong file
NO_SECRET_WARNING = (
    "kvtier: the shared stores have no secret, so their blocks are checksummed, not "
    "authenticated: "
    "whoever can write to that store chooses the KV every kvtier instance on it serves. Set "
    "remote_kv_secret_file to a file holding the same random secret (at least 16 bytes, e.g. "
    "`head -c 32 /dev/urandom | base64 > FILE`) on every instance.")


def build(config: TierConfig, layout: KVLayout, namespace: bytes, block_size: int,
          prefill_tokens_per_s: float, faults: Faults = NO_FAULTS) -> Tier:
    """The host tier over `layout`, and every configured store below it (`registry.py`).

    `namespace`: the fingerprint digest every block below host carries; `block_size`:
    tokens per block; `prefill_tokens_per_s`: the client's measured prefill speed, the
    planner's starting recompute estimate; `faults`: what a test makes fail."""
    _enabled(config)
    mac = shared_mac(config)  # a bad secret file stops the build before anything is allocated
    with ExitStack() as undo:  # anything opened is closed again if a later step fails
        host, link = _host_and_link(config, layout, faults, undo)
        calibration = measure_link(link, host, prefill_tokens_per_s)
        tenancy = make_tenancy(config, host.slot_bytes)
        site = StoreSite(config, namespace, block_size, host.slot_bytes, host.encoding, mac,
                         undo, tenancy=tenancy)
        stores: list[SecondaryStore] = []
        indexes: list[SecondaryIndex] = []
        for kind, knobs in configured_stores(config):
            opened = kind.open_both(site, knobs)
            stores.append(opened.store)
            indexes.append(opened.index)
            calibration.tier_gbps[kind.medium.value] = opened.read_gbps
        manager = _manager(config, block_size, host.num_slots, host.slot_bytes, host.encoding,
                           link.layout.block_nbytes, calibration, indexes, tenancy)
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
    `build_worker_side` will allocate, and each store's books (the disk index read from the
    file the worker owns, Redis asked for presence only). The stores' read rates are
    measured here, where the planner lives. With 8-bit host slots (`kv_offload_dtype`) a
    slot's size follows from `coded_shape`, the block as the codec reads it
    (`KVLayout.coded_block_shape`). `residency`: keep the host and disk residency changes
    (`take_residency_changes`)."""
    _enabled(config)
    changes = ResidencyLog(enabled=residency)
    encoding = config.kv_offload_dtype or ""
    slot_bytes = host_slot_nbytes(block_nbytes, coded_shape, encoding)
    with ExitStack() as undo:
        # The store's namespace without the warning (the worker side gives it).
        tenancy = make_tenancy(config, slot_bytes)
        site = StoreSite(config, namespace, block_size, slot_bytes, encoding,
                         shared_mac(config, warn=False), undo, changes, tenancy)
        indexes: list[SecondaryIndex] = []
        for kind, knobs in configured_stores(config):
            index, read_gbps = kind.open_books(site, knobs)
            indexes.append(index)
            calibration.tier_gbps[kind.medium.value] = read_gbps
        manager = _manager(config, block_size,
                           host_slot_count(config.kv_offloading_size, slot_bytes),
                           slot_bytes, encoding, block_nbytes, calibration, indexes, tenancy,
                           changes)
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
    the host pool and each store's bytes (the disk file opened, locked and its bad slots
    invalidated; the Redis connection its I/O thread reads and writes through)."""
    _enabled(config)
    mac = shared_mac(config)
    with ExitStack() as undo:
        host, link = _host_and_link(config, layout, faults, undo)
        site = StoreSite(config, namespace, block_size, host.slot_bytes, host.encoding, mac,
                         undo)
        stores = [kind.open_bytes(site, knobs) for kind, knobs in configured_stores(config)]
        io = TierIO(host, namespace, stores, faults.below, faults.slow)
        undo.pop_all()
    return TierWorker(host, link, io)


def _manager(config: TierConfig, block_size: int, host_slots: int, slot_bytes: int,
             encoding: str, block_nbytes: int, calibration: Calibration,
             tiers: list[SecondaryIndex], tenancy: Tenancy,
             changes: ResidencyLog | None = None) -> TierManager:
    """The bookkeeping: the host index, the planner (over `calibration`, the tiers' read
    rates measured in) and the manager over the tiers below host."""
    ids = job_ids()
    if config.max_load_gbps is not None:  # loads are paced to it: planned at it too
        calibration.link_gbps = min(calibration.link_gbps, config.max_load_gbps)
    host = HostTier(host_slots, config.eviction_policy, changes, tenancy)
    below = BelowHost(host, tiers, slot_bytes, ids, encoding)
    return TierManager(config, block_size, host, Planner(calibration), block_nbytes, below, ids,
                       changes)


def make_tenancy(config: TierConfig, slot_bytes: int) -> Tenancy:
    """Owners, quotas (the knobs' GiB in blocks of `slot_bytes`) and retention, kept
    across restarts beside the disk tier's file when there is one."""
    quotas = Quotas(quota_blocks(config.kv_tenant_quota, slot_bytes),
                    {t: quota_blocks(q, slot_bytes) for t, q in config.kv_tenant_quotas.items()})
    where = config.retention_dir
    return Tenancy(quotas, config.kv_retention_max_s,
                   RetentionFile(where) if where is not None else None,
                   erase_expired=config.kv_retention_erase)


def shared_mac(config: TierConfig, warn: bool = True) -> BlockMac | None:
    """The MAC of the stores other instances share, from the configured secret (the file read
    now), or None; with such a store and no secret, `warn` logs once that the store is
    trusted blindly."""
    if not any(kind.shared for kind, _ in configured_stores(config)):
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
                          store_gbps=config.max_store_gbps, load_gbps=config.max_load_gbps,
                          load_threads=config.load_threads)
    undo.callback(link.close)
    return host, link


def _enabled(config: TierConfig) -> None:
    if not config.enabled:
        raise ConfigError("the tier is off (kv_offloading_size=0); give it a size in GiB")
