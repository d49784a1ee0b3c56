"""What the tier measures before it serves.

Primitives:
  measure_link(link, host)          host <-> device GB/s and per-job overhead (a few blocks)
  measure_disk_gbps(dir, bytes)     cold read rate of the disk tier's filesystem
  remote_rate(store, bytes, given)  the starting Redis read rate (bad credentials fail here)
Measuring only: reopening the disk tier is `disk_open.py`'s.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.tier.jobs import Job
from kvtier.tier.keys import Medium
from kvtier.tier.planner import Calibration
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.unavailable import RemoteUnavailable

if TYPE_CHECKING:
    from kvtier.tier.worker.remote_store import KeyValueStore

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
    # Negative ids: the manager's count from 0, these are delivered before it starts, and a
    # test's link faults (for serving) pass them by.
    link.wait(link.submit(Job(-1, Medium.DEVICE, Medium.HOST, ids, device_blocks=ids)))
    for i in range(2):
        full = link.wait(link.submit(Job(-2 - i, Medium.HOST, Medium.DEVICE, ids,
                                         device_blocks=ids)))
    one = link.wait(link.submit(Job(-4, Medium.HOST, Medium.DEVICE, ids[:1],
                                    device_blocks=ids[:1])))
    link.poll()
    link.reset_stats()
    block_bytes = link.layout.block_nbytes
    per_block = max((full.seconds - one.seconds) / max(n - 1, 1), 1e-9)
    gbps = block_bytes / per_block / 1e9
    overhead = max(one.seconds - block_bytes / (gbps * 1e9), 0.0)
    return Calibration(link_gbps=gbps, transfer_overhead_s=overhead,
                       prefill_tokens_per_s=prefill_tokens_per_s)


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


def remote_rate(store: KeyValueStore, block_bytes: int, configured: float | None) -> float:
    """The planner's starting Redis read rate; bad credentials fail here, at start
    (ConfigError), while an unreachable server only warns: serving goes on without it."""
    try:
        store.check()
    except RemoteUnavailable as e:
        log.warning("kvtier: remote tier %s unreachable at start (%s); serving goes on, "
                    "its blocks are misses until it answers", store.url_for_log, e)
        return configured or UNMEASURED_REMOTE_GBPS
    return configured or measure_remote_gbps(store, block_bytes)


def measure_remote_gbps(store: KeyValueStore, block_bytes: int) -> float:
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
