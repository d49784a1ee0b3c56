"""TierWorker: the bytes side of the tier. Jobs in, results out, routed by (src, dst) medium.

Primitives:
  submit(job)                 DEVICE<->HOST jobs go to the link (one copy worker, loads first;
                              side streams on CUDA), jobs below host to the I/O thread
  poll() -> [Result]          jobs finished since the last poll; never blocks
  wait(job_id) -> Result      block until one device <-> host job is complete
  wait_any() -> [Result]      block until some job finishes (the oldest link job first)
  wait_layer(job_id, layer)   a layerwise load's layer `layer` can be read (False: it failed)
  close() -> [Result]         stop both threads; the jobs that never ran come back failed
  report() -> WorkerReport    the link's traffic, the host pool's memory, the stores' state
Job ids are the manager's; a job's host slots and device blocks belong to the worker from
submit until its result is delivered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.tier.jobs import Job, Result
from kvtier.tier.keys import Medium
from kvtier.tier.layout import KVLayout
from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.spec import Direction, TransferResult, TransferSpec, TransferStats

if TYPE_CHECKING:  # the stores come with the tiers below host; Redis' client only with Redis
    from kvtier.tier.worker.disk_store import DiskStore
    from kvtier.tier.worker.io import TierIO
    from kvtier.tier.worker.redis_store import RedisStore

IO_WAIT_S = 1.0  # how long wait_any sleeps on the I/O thread before the caller looks again


@dataclass(frozen=True)
class WorkerReport:
    """What the bytes side reports of itself (the scheduler side's is `TierStats`)."""

    link: TransferStats  # device <-> host traffic, both directions
    memory: Mapping[str, Any]  # the host pool: bytes asked, allocated, pinned, resident
    stores: Mapping[str, Any]  # "disk": path and size, "remote": errors and URL
    host_slots: int


class TierWorker:
    """Owns the host pool, the device link and the I/O to the tiers below host."""

    def __init__(self, host: HostPool, link: TransferEngine, io: TierIO | None = None,
                 disk: DiskStore | None = None, remote: RedisStore | None = None) -> None:
        self.host, self.link, self.io = host, link, io
        self.disk, self.remote = disk, remote
        self._link_id: dict[int, int] = {}  # job id -> link job id
        self._job_id: dict[int, int] = {}  # link job id -> job id

    @property
    def layout(self) -> KVLayout:
        return self.link.layout

    @property
    def host_slots(self) -> int:
        return self.host.num_slots

    def submit(self, job: Job) -> None:
        if job.below_host:
            assert self.io is not None, f"job {job.id} goes below host, and no tier is there"
            self.io.submit(job)
            return
        direction = Direction.STORE if job.dst is Medium.HOST else Direction.LOAD
        link_id = self.link.submit(TransferSpec(direction, job.device_blocks, job.host_slots,
                                                job.layerwise))
        self._link_id[job.id] = link_id
        self._job_id[link_id] = job.id

    def poll(self) -> list[Result]:
        results = [self._result(r) for r in self.link.poll()]
        if self.io is not None:
            results += self.io.poll()
        return results

    def wait(self, job_id: int) -> Result:
        return self._result(self.link.wait(self._link_id[job_id]))

    def wait_any(self) -> list[Result]:
        """Block until a job lands: the oldest device <-> host job, else any I/O job."""
        if self._job_id:
            return [self._result(self.link.wait(min(self._job_id)))]
        if self.io is not None and self.io.busy:
            return self.io.wait_any(timeout=IO_WAIT_S)
        return []

    def wait_layer(self, job_id: int, layer: int) -> bool:
        return self.link.wait_layer(self._link_id[job_id], layer)

    def in_flight(self, job_id: int) -> bool:
        """A device <-> host job submitted whose result is not yet delivered."""
        return job_id in self._link_id

    @property
    def busy(self) -> bool:
        return bool(self._job_id) or (self.io is not None and self.io.busy)

    def report(self) -> WorkerReport:
        return WorkerReport(self.link.stats(), self.host.stats(), self._store_stats(),
                            self.host.num_slots)

    def _store_stats(self) -> dict[str, Any]:
        """What the stores below host say of themselves (for LLM.stats())."""
        out: dict[str, Any] = {}
        if self.disk is not None:
            out["disk"] = {"path": str(self.disk.path), "file_bytes": self.disk.file_nbytes}
        if self.remote is not None:
            out["remote"] = {"errors": self.remote.errors, "last_error": self.remote.last_error,
                             "url": self.remote.url_for_log}
        return out

    def flush(self) -> None:
        """Sync the disk tier: what a restart will find."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> list[Result]:
        """Stop the link and the I/O thread, then give the stores and the host memory back
        (even if this object lives on after the engine is done with it). Returns the
        results of the jobs that never finished, for the manager to unpin."""
        self.link.close()
        if self.io is not None:
            self.io.close()
        results = self.poll()
        self.flush()  # what the I/O thread wrote before it stopped is what a restart finds
        for store in (self.disk, self.remote):
            if store is not None:
                store.close()
        self.host.release()
        return results

    def _result(self, r: TransferResult) -> Result:
        job_id = self._job_id.pop(r.job_id)
        del self._link_id[job_id]
        return Result.whole(job_id, r.spec.num_blocks, r.success, r.bytes, r.seconds, r.error,
                            r.finished_at)
