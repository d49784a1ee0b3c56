"""The shared store's read rate for the planner, measured at start (bad credentials fail
here, an unreachable server only warns)."""

from __future__ import annotations

import logging
import os
import time

from kvtier.tier.stores.redis.kv import KeyValueStore
from kvtier.tier.stores.redis.unavailable import RemoteUnavailable

log = logging.getLogger(__name__)

CALIBRATION_BLOCKS = 8  # blocks written and read back

UNMEASURED_REMOTE_GBPS = 0.5  # a Redis unreachable at start: assume a slow network


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
