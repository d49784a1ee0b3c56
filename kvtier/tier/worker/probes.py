"""What the tier measures before it serves, and the disk it reopens.

Primitives:
  measure_link(link, host)          host <-> device GB/s and per-job overhead (a few blocks)
  measure_disk_gbps(dir, bytes)     cold read rate of the disk tier's filesystem
  remote_rate(store, bytes, given)  the starting Redis read rate (bad credentials fail here)
  open_disk(config, ...)            the slot file, its index rebuilt from what is on it
  read_disk_index(config, ...)      that index alone, read only (the file is another's)
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tier.config import GIB, TierConfig
from kvtier.tier.index.disk import DiskTier
from kvtier.tier.jobs import Reason
from kvtier.tier.planner import Calibration
from kvtier.tier.worker.block_format import BlockHeader, max_header_nbytes
from kvtier.tier.worker.disk_store import DiskStore, read_headers, round_up
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.spec import Direction, TransferSpec
from kvtier.tier.worker.unavailable import RemoteUnavailable

if TYPE_CHECKING:
    from kvtier.tier.worker.redis_store import RedisStore

log = logging.getLogger(__name__)

CALIBRATION_BLOCKS = 8
UNMEASURED_REMOTE_GBPS = 0.5  # a Redis unreachable at start: assume a slow network
UNMEASURED_DISK_GBPS = 0.5  # a disk whose calibration failed: assume a slow one
SCRATCH_HEADROOM = 2  # the calibration writes only where twice its scratch is free


def measure_link(link: TransferEngine, host: HostPool, prefill_tokens_per_s: float,
                 blocks: int = CALIBRATION_BLOCKS) -> Calibration:
    """This machine's link before serving (the planner's start): a store of a few blocks,
    then two whole loads and a one-block load, timed; stats are reset after."""
    n = min(blocks, link.layout.num_blocks, host.num_slots)
    ids = tuple(range(n))
    link.wait(link.submit(TransferSpec(Direction.STORE, ids, ids)))
    for _ in range(2):
        full = link.wait(link.submit(TransferSpec(Direction.LOAD, ids, ids)))
    one = link.wait(link.submit(TransferSpec(Direction.LOAD, ids[:1], ids[:1])))
    link.poll()
    link.reset_stats()
    block_bytes = link.layout.block_nbytes
    per_block = max((full.seconds - one.seconds) / max(n - 1, 1), 1e-9)
    gbps = block_bytes / per_block / 1e9
    overhead = max(one.seconds - block_bytes / (gbps * 1e9), 0.0)
    return Calibration(link_gbps=gbps, transfer_overhead_s=overhead,
                       prefill_tokens_per_s=prefill_tokens_per_s)


def open_disk(config: TierConfig, host: HostPool, namespace: bytes, block_size: int
               ) -> tuple[DiskStore, DiskTier]:
    """The slot file, and its index rebuilt from the blocks a previous process left there."""
    num_slots, header = disk_geometry(config, host.slot_bytes, block_size)
    store = DiskStore(str(config.disk_kv_path), num_slots, host.slot_bytes, header)
    try:
        unusable: Counter[str] = Counter()
        found = store.scan(unusable)
        tier, rejected = _adopt(config, found, unusable, num_slots, namespace,
                                host.slot_bytes, host.encoding)
        for slot in rejected:
            store.invalidate(slot)
    except BaseException:
        store.close()
        raise
    adopted = len(tier.complete_keys())
    if adopted:
        log.info("kvtier: disk tier %s: %d blocks from an earlier process", store.path, adopted)
    return store, tier


def read_disk_index(config: TierConfig, slot_bytes: int, encoding: str, namespace: bytes,
                    block_size: int) -> DiskTier:
    """The disk tier's index from its file, read only: for the process that keeps the index
    while another owns the file (`open_disk` there adopts, and invalidates, the same slots)."""
    num_slots, header = disk_geometry(config, slot_bytes, block_size)
    unusable: Counter[str] = Counter()
    found = read_headers(str(config.disk_kv_path), num_slots, slot_bytes, header, unusable)
    return _adopt(config, found, unusable, num_slots, namespace, slot_bytes, encoding)[0]


def disk_geometry(config: TierConfig, slot_bytes: int, block_size: int) -> tuple[int, int]:
    """(slots, header bytes) of the disk tier's file: the same in every process."""
    header = max_header_nbytes(block_size)
    probe_slot = round_up(header) + round_up(slot_bytes)
    num_slots = int(config.disk_kv_size * GIB // probe_slot)
    if num_slots < 1:
        raise ConfigError(
            f"disk_kv_size={config.disk_kv_size} GiB holds no block of {probe_slot:,} bytes; "
            "raise it")
    return num_slots, header


def _adopt(config: TierConfig, found: list[tuple[int, BlockHeader]],
           unusable: Counter[str], num_slots: int, namespace: bytes, slot_bytes: int,
           encoding: str) -> tuple[DiskTier, list[int]]:
    """An index of the blocks of this namespace and shape; the slots it could not take.
    Blocks of another fingerprint (the weights changed, say) or shape are counted."""
    ours = []
    for slot, h in found:
        if h.namespace != namespace or h.encoding != encoding:
            unusable[Reason.FINGERPRINT.value] += 1
        elif h.payload_nbytes != slot_bytes:
            unusable[Reason.SIZE.value] += 1
        else:
            ours.append((slot, h.key, h.tokens))
    tier = DiskTier(num_slots, config.eviction_policy, unusable)
    if unusable:
        log.warning("kvtier: disk tier %s holds blocks this process will not serve (%s): "
                    "written under another model, configuration or format, or damaged",
                    config.disk_kv_path, ", ".join(f"{n} {r}" for r, n in unusable.items()))
    return tier, tier.adopt(ours)


def measure_disk_gbps(directory: Path, block_bytes: int, blocks: int = CALIBRATION_BLOCKS
                      ) -> float:
    """Read GB/s of the disk tier's filesystem: `blocks` blocks written, synced, dropped from
    the page cache where the kernel allows, then read back (a scratch file, removed after).
    Where the scratch would leave the filesystem short (the slot file took it, as sized) or
    the disk fails, the planner starts from a slow guess instead: a disk that fits serves."""
    path = directory / f".kvtier-calibration-{os.getpid()}"
    try:
        free = shutil.disk_usage(directory).free
        if free < SCRATCH_HEADROOM * blocks * block_bytes:
            raise OSError(errno.ENOSPC, f"{free} bytes free, the calibration writes "
                                        f"{blocks * block_bytes}")
        return _timed_read(path, os.urandom(block_bytes), blocks)
    except OSError as e:  # a full or failing disk must not stop serving: assume a slow one
        path.unlink(missing_ok=True)
        why = e.strerror or str(e)
        log.warning("kvtier: the disk tier's read rate could not be measured in %s (%s); "
                    "the planner starts from %.1f GB/s (set disk_kv_read_gbps to say)",
                    directory, why, UNMEASURED_DISK_GBPS)
        return UNMEASURED_DISK_GBPS


def _timed_read(path: Path, payload: bytes, blocks: int) -> float:
    block_bytes = len(payload)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        for i in range(blocks):
            os.pwrite(fd, payload, i * block_bytes)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for i in range(blocks):
            os.pread(fd, block_bytes, i * block_bytes)
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return blocks * block_bytes / max(seconds, 1e-9) / 1e9


def remote_rate(store: RedisStore, block_bytes: int, configured: float | None) -> float:
    """The planner's starting Redis read rate; bad credentials fail here, at start
    (ConfigError), while an unreachable server only warns: serving goes on without it."""
    try:
        store.check()
    except RemoteUnavailable as e:
        log.warning("kvtier: remote tier %s unreachable at start (%s); serving goes on, "
                    "its blocks are misses until it answers", store.url_for_log, e)
        return configured or UNMEASURED_REMOTE_GBPS
    return configured or measure_remote_gbps(store, block_bytes)


def measure_remote_gbps(store: RedisStore, block_bytes: int) -> float:
    """Read GB/s from Redis (a batched get of a few blocks put under scratch keys, timed
    after one warm-up get)."""
    keys = [b"calibration:%d:%d" % (os.getpid(), i) for i in range(CALIBRATION_BLOCKS)]
    payload = os.urandom(block_bytes)
    try:
        store.put_many([(k, payload) for k in keys])
        store.get_many(keys)  # warm-up: a fresh process's first large replies page-fault
        start = time.perf_counter()
        store.get_many(keys)
        seconds = time.perf_counter() - start
        store.delete_many(keys)
    except RemoteUnavailable as e:
        log.warning("kvtier: remote tier %s unreachable at start (%s); serving goes on, "
                    "its blocks are misses until it answers", store.url_for_log, e)
        return UNMEASURED_REMOTE_GBPS
    return CALIBRATION_BLOCKS * block_bytes / max(seconds, 1e-9) / 1e9
