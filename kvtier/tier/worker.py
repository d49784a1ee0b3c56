"""TierWorker: the bytes side of the tier. Jobs in, results out, routed by (src, dst) medium.

Primitives:
  submit(job)                 DEVICE<->HOST jobs go to the link (one copy worker, loads first;
                              side streams on CUDA), jobs below host to the I/O thread
  poll() -> [Result]          jobs finished since the last poll; never blocks
  wait(job_id) -> Result      block until one device <-> host job is complete
  wait_any() -> [Result]      block until some job finishes (the oldest link job first)
  wait_fetches(timeout) -> [Result]   block until no fetch below host is outstanding (or
                              `timeout`): for a caller whose step has nothing else to do
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
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.stats import TransferStats
from kvtier.tier.link.transfer import TransferEngine

if TYPE_CHECKING:
    from kvtier.tier.io.store import SecondaryStore
    from kvtier.tier.io.thread import TierIO

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

    def __init__(self, host: HostPool, link: TransferEngine, io: TierIO) -> None:
        self.host, self.link, self.io = host, link, io  # io: its stores, maybe none

    @property
    def layout(self) -> KVLayout:
        return self.link.layout

    @property
    def host_slots(self) -> int:
        return self.host.num_slots

    def store(self, medium: Medium) -> SecondaryStore:
        """The bytes side of the tier below host of this medium (KeyError: none)."""
        return self.io.stores[medium]

    def submit(self, job: Job) -> None:
        if job.below_host:
            self.io.submit(job)
            return
        self.link.submit(job)

    def poll(self) -> list[Result]:
        return self.link.poll() + self.io.poll()

    def wait(self, job_id: int, timeout: float | None = None) -> Result:
        """TimeoutError if the device <-> host job is not done within `timeout`."""
        return self.link.wait(job_id, timeout)

    def wait_any(self) -> list[Result]:
        """Block until a job lands: the oldest device <-> host job, else any I/O job."""
        oldest = self.link.oldest()
        if oldest is not None:
            return [self.link.wait(oldest)]
        if self.io.busy:
            return self.io.wait_any(timeout=IO_WAIT_S)
        return []

    def wait_fetches(self, timeout: float) -> list[Result]:
        """Results of the I/O thread, once no fetch into host rows is outstanding (or after
        `timeout`): an idle engine step spends its time here instead of spinning."""
        return self.io.wait_fetches(timeout)

    def wait_layer(self, job_id: int, layer: int) -> bool:
        return self.link.wait_layer(job_id, layer)

    def in_flight(self, job_id: int) -> bool:
        """A device <-> host job submitted whose result is not yet delivered."""
        return self.link.pending(job_id)

    @property
    def busy(self) -> bool:
        return self.link.oldest() is not None or self.io.busy

    def report(self) -> WorkerReport:
        stores = {m.value: s.describe() for m, s in self.io.stores.items()}
        return WorkerReport(self.link.stats(), self.host.stats(), stores, self.host.num_slots)

    def flush(self) -> None:
        """Sync the stores below host: what a restart will find."""
        for store in self.io.stores.values():
            store.flush()

    def close(self) -> list[Result]:
        """Stop the link and the I/O thread, then give the stores and the host memory back
        (even if this object lives on after the engine is done with it). Returns the
        results of the jobs that never finished, for the manager to unpin."""
        self.link.close()
        self.io.close()
        results = self.poll()
        self.flush()  # what the I/O thread wrote before it stopped is what a restart finds
        for store in self.io.stores.values():
            store.close()
        self.host.release()
        return results
