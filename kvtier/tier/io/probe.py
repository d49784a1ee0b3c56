"""A filesystem's cold read rate, as the planner's starting point for a store on it: a few
blocks written to a scratch file, synced, dropped from the page cache where the kernel
allows, read back and timed; the file is removed after."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cold_read_gbps(path: Path, block_bytes: int, blocks: int) -> float:
    """GB/s reading `blocks` blocks of `block_bytes` back from a scratch file at `path`
    (OSError where the filesystem fails; the scratch is gone either way)."""
    payload = os.urandom(block_bytes)
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
