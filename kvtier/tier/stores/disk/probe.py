"""The disk tier's read rate for the planner: measured on its filesystem at start, unless the
operator gave it (`disk_kv_read_gbps`)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from kvtier.tier.io.probe import cold_read_gbps

log = logging.getLogger(__name__)

CALIBRATION_BLOCKS = 8  # blocks written and read back

UNMEASURED_DISK_GBPS = 0.5  # a disk whose calibration failed: assume a slow one
SCRATCH_HEADROOM = 2  # the calibration writes only where twice its scratch is free


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
        return cold_read_gbps(path, block_bytes, blocks)
    except OSError as e:  # a full or failing disk must not stop serving: assume a slow one
        path.unlink(missing_ok=True)
        why = e.strerror or str(e)
        log.warning("kvtier: the disk tier's read rate could not be measured in %s (%s); "
                    "the planner starts from %.1f GB/s (set disk_kv_read_gbps to say)",
                    directory, why, UNMEASURED_DISK_GBPS)
        return UNMEASURED_DISK_GBPS

