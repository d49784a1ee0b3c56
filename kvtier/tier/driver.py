"""The in-process driver: a manager and a worker in one process, joined by jobs and results.

A client with both sides in one process (kvtier's engine) drives the tier through these and
adds only what is its own (the device pool's references, idle demotion); vLLM's connector
carries jobs and results between its two processes itself.
  submit()            every job decided since the last call goes to the worker
  reap() -> [Event]   what finished since the last call, applied (never blocks)
  wait_any()          block until a job lands or a presence answer comes
  wait(job_id)        block until one device <-> host job lands (a layerwise load)
  drain()             until nothing is in flight
  write_down_host()   every host block a local tier lacks goes down, then synced
StoreDone events are the client's: it holds the device blocks a store reads until then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tier.books.manager import TierManager
from kvtier.tier.jobs import Event, Result
from kvtier.tier.worker import TierWorker


@dataclass(frozen=True)
class Tier:
    """A built tier: the scheduler's side and the bytes' side, joined by jobs and results."""

    manager: TierManager
    worker: TierWorker

    def submit(self) -> None:
        for job in self.manager.take_jobs():
            self.worker.submit(job)

    def reap(self) -> list[Event]:
        return self._apply(self.worker.poll())

    def wait_any(self) -> list[Event]:
        """Nothing can run until a job lands (a swap frees blocks, a load or fetch wakes a
        request) or a presence answer comes: block on the oldest job, else on the answer."""
        self.submit()
        results = self.worker.wait_any()
        if not results:
            self.manager.wait_presence()
        return self._apply(results)

    def wait(self, job_id: int) -> list[Event]:
        """Block until the device <-> host job `job_id` lands (nothing if it already has)."""
        if not self.worker.in_flight(job_id):
            return []
        return self._apply([self.worker.wait(job_id)])

    def wait_layer(self, job_id: int, layer: int) -> bool:
        """Layer `layer` of a layerwise load can be read (False: the load failed)."""
        return self.worker.wait_layer(job_id, layer)

    @property
    def busy(self) -> bool:
        return self.manager.busy or self.worker.busy

    def drain(self) -> list[Event]:
        """Submit what was decided and wait until no job is in flight; the events seen."""
        events = self.reap()
        while self.busy:
            events += self.wait_any()
        return events

    def write_down_host(self) -> list[Event]:
        """Every block complete on host that a local tier (disk) lacks goes down and the
        store is synced: what a restart finds."""
        self.manager.write_down_host()
        events = self.drain()
        self.worker.flush()
        return events

    def close(self) -> None:
        """Stop every thread and give the memory back; jobs that never ran fail (unpinned)."""
        self.manager.close()
        self.manager.apply(self.worker.close())

    def _apply(self, results: Sequence[Result]) -> list[Event]:
        events = self.manager.apply(results)
        self.submit()  # a finished store may have queued writes below host
        return events
