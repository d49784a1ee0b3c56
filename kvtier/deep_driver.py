"""The engine's side of the disk and remote tiers: builds them, feeds their jobs to the tier
I/O thread, hands finished ones back, and writes the cache down at shutdown.

Primitives: `DeepDriver.build(...)` (None when no tier below host is configured),
`submit()`, `reap() -> [FetchDone]`, `wait_any()`, `flush()`, `stats()`, `close()`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from kvtier.config import OffloadConfig
from kvtier.deep_offload import DeepOffload, FetchDone, TierOutcome
from kvtier.errors import ConfigError, KvtierError
from kvtier.planner import Planner
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer.block_format import max_header_nbytes
from kvtier.transfer.disk_store import DiskStore, round_up
from kvtier.transfer.host_memory import HostPool
from kvtier.transfer.redis_store import RedisStore, RemoteUnavailable
from kvtier.transfer.tier_io import TierIO, TierIOResult, TierIOSpec

log = logging.getLogger(__name__)

GIB = 1024**3
CALIBRATION_BLOCKS = 8
UNMEASURED_REMOTE_GBPS = 0.5  # a Redis unreachable at start: assume a slow network


class DeepDriver:
    def __init__(self, deep: DeepOffload, io: TierIO, planner: Planner,
                 disk: DiskStore | None, remote: RedisStore | None) -> None:
        self.deep, self.io, self.planner = deep, io, planner
        self.disk, self.remote = disk, remote
        self._ref_of: dict[int, int] = {}  # tier I/O job id -> deep offload ref
        self.remote_errors = 0  # presence queries answered "absent" because Redis was down

    @classmethod
    def build(cls, config: OffloadConfig, host: HostPool, host_tier: HostTier, namespace: bytes,
              block_size: int, planner: Planner) -> DeepDriver | None:
        if not (config.disk_enabled or config.remote_enabled):
            return None
        disk_store = remote_store = None
        try:
            disk_tier = None
            if config.disk_enabled:
                disk_store, disk_tier = _open_disk(config, host, namespace, block_size)
                rate = config.disk_kv_read_gbps or measure_disk_gbps(
                    Path(str(config.disk_kv_path)), host.slot_bytes)
                cap = config.disk_kv_max_gbps
                planner.calibration.tier_gbps["disk"] = min(rate, cap) if cap else rate
            if config.remote_enabled:
                remote_store = RedisStore(str(config.remote_kv_url), namespace,
                                          config.remote_kv_ttl_s)
                planner.calibration.tier_gbps["remote"] = _remote_rate(
                    remote_store, host.slot_bytes, config.remote_kv_read_gbps)
            deep = DeepOffload(host_tier, disk_tier, None, host.slot_bytes, host.encoding)
            io = TierIO(host, namespace, disk_store, remote_store,
                        disk_max_gbps=config.disk_kv_max_gbps)
        except BaseException:
            for store in (disk_store, remote_store):
                if store is not None:
                    store.close()
            raise
        driver = cls(deep, io, planner, disk_store, remote_store)
        if remote_store is not None:
            deep.remote = RemoteTier(driver._exists)
        return driver

    def _exists(self, keys: Any) -> list[bool]:
        """Presence in Redis for the scheduler's lookup; an outage answers "absent"."""
        assert self.remote is not None
        try:
            return self.remote.exists_many(list(keys))
        except KvtierError:  # unreachable, or credentials revoked since start: a miss
            self.remote_errors += 1
            return [False] * len(keys)

    def submit(self) -> None:
        for t in self.deep.take_jobs():
            spec = TierIOSpec(t.kind, t.keys, t.tokens, t.host_slots, t.tiers, t.disk_slots)
            self._ref_of[self.io.submit(spec)] = t.ref

    def _apply(self, results: list[TierIOResult]) -> list[FetchDone]:
        done: list[FetchDone] = []
        for r in results:
            ref = self._ref_of.pop(r.job_id)
            fetched = self.deep.finish(TierOutcome(ref, r.ok, r.reasons, r.nbytes, r.seconds))
            if fetched is not None:
                done.append(fetched)
                if fetched.source is not None and r.nbytes:
                    self.planner.observe_tier(fetched.source, r.nbytes, r.seconds)
        self.submit()  # finished writes unpin rows; nothing new, but a fetch may queue writes
        return done

    def reap(self) -> list[FetchDone]:
        return self._apply(self.io.poll())

    def wait_any(self) -> list[FetchDone]:
        self.submit()
        return self._apply(self.io.wait_any(timeout=1.0)) if self._ref_of else []

    @property
    def busy(self) -> bool:
        """A job decided (perhaps not yet submitted) or running."""
        return bool(self.deep.jobs)

    def drain(self) -> None:
        while self.busy:
            self.wait_any()

    def flush(self) -> None:
        """Write every host block the disk lacks down and fsync: what a restart will find."""
        self.deep.write_down_host()
        self.drain()
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict[str, Any]:
        s = self.deep.stats
        out: dict[str, Any] = {
            "written_blocks": dict(s.written), "written_bytes": dict(s.written_bytes),
            "write_failures": dict(s.write_failures), "encoding": self.deep.encoding or None,
            "fetched_blocks": dict(s.fetched), "fetched_bytes": dict(s.fetched_bytes),
            "misses": dict(s.misses), "refused": s.refused,
            "tier_gbps": dict(self.planner.calibration.tier_gbps),
        }
        if self.deep.disk is not None and self.disk is not None:
            d = self.deep.disk.stats
            out["disk"] = {"used_slots": d.used, "capacity_slots": d.capacity,
                           "hits": d.hits, "evictions": d.evictions, "path": str(self.disk.path),
                           "file_bytes": self.disk.file_nbytes}
        if self.deep.remote is not None and self.remote is not None:
            r = self.deep.remote.stats
            out["remote"] = {"hits": r.hits, "stores": r.stores, "errors": self.remote.errors,
                             "lookups_answered_absent": self.remote_errors,
                             "last_error": self.remote.last_error,
                             "url": self.remote.url_for_log}
        return out

    def close(self) -> None:
        self.io.close()
        self._apply(self.io.poll())  # jobs that never ran fail: unpin their slots
        for store in (self.disk, self.remote):
            if store is not None:
                store.close()


def _open_disk(config: OffloadConfig, host: HostPool, namespace: bytes, block_size: int
               ) -> tuple[DiskStore, DiskTier]:
    """The slot file, and its index rebuilt from the blocks a previous process left there."""
    header = max_header_nbytes(block_size)
    probe_slot = round_up(header) + round_up(host.slot_bytes)
    num_slots = int(config.disk_kv_size * GIB // probe_slot)
    if num_slots < 1:
        raise ConfigError(
            f"disk_kv_size={config.disk_kv_size} GiB holds no block of {probe_slot:,} bytes; "
            "raise it")
    store = DiskStore(str(config.disk_kv_path), num_slots, host.slot_bytes, header)
    try:
        tier = DiskTier(num_slots, config.eviction_policy)
        found = [(slot, h.key, h.tokens) for slot, h in store.scan()
                 if h.namespace == namespace and h.payload_nbytes == host.slot_bytes
                 and h.encoding == host.encoding]
        for slot in tier.adopt(found):
            store.invalidate(slot)
    except BaseException:
        store.close()
        raise
    if found:
        log.info("kvtier: disk tier %s: %d blocks from an earlier process", store.path,
                 len(found))
    return store, tier


def measure_disk_gbps(directory: Path, block_bytes: int, blocks: int = CALIBRATION_BLOCKS
                      ) -> float:
    """Read GB/s of the disk tier's filesystem: `blocks` blocks written, synced, dropped from
    the page cache where the kernel allows, then read back (a scratch file, removed after)."""
    payload = os.urandom(block_bytes)
    path = directory / f".kvtier-calibration-{os.getpid()}"
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


def _remote_rate(store: RedisStore, block_bytes: int, configured: float | None) -> float:
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
