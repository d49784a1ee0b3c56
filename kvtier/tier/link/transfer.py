"""Asynchronous KV transfer jobs between the device pool and the host pool.

Jobs and results are the tier's own (`jobs.Job`, `jobs.Result`), ids the caller's:
  submit(job) -> job id               queue a store (DEVICE -> HOST) or a load (HOST -> DEVICE)
  poll() -> [Result]                  jobs finished since the last poll; never blocks
  wait(job_id, timeout) -> Result     block the host until the job is complete
  oldest() -> job id                  the earliest submitted job not yet delivered
  wait_layer(job_id, layer) -> bool   layer `layer` of a load is usable; False: the job failed
  is_done(job_id)                     finished, delivered or not
  stats() / reset_stats()             bytes, busy seconds, jobs, failures, link utilisation
  close()                             stop the worker, fail every job that did not finish
Each result is delivered once, by `poll` or by `wait`. From `submit` until then the job's
device blocks and host slots are the engine's: the caller must not reuse or free them.

One worker thread takes jobs a step at a time (a chunk of `blocks_per_chunk` blocks, or one
layer of a layerwise load), always from the load queue first: loads are on the critical
path, so a load submitted behind a long store waits for at most one chunk. With `load_gbps`
(`max_load_gbps`) the loads average at most that rate: on CPU a load step is usable only
when its bytes would have crossed at the cap; on CUDA the next load step starts late. On CPU
the worker copies; on CUDA it issues copies on one side stream per direction and records an
event after each step. A job's copies start only after the work queued on the submitting
thread's current stream at `submit` (so a store never reads KV that compute is still
writing, and a load never overwrites a block an earlier kernel still reads); consumers of a
load wait on its events.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from kvtier.tier.faults import LinkFault, no_link_fault
from kvtier.tier.jobs import Job, Result
from kvtier.tier.keys import Medium
from kvtier.tier.layout import KVLayout, as_layout
from kvtier.tier.link.copy import CopyTeam, layer_index, move_blocks, move_layer
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.job import (
    LOAD,
    STORE,
    Copy,
    JobState,
    check_link_job,
    check_link_setup,
)
from kvtier.tier.link.stats import DirectionCounter, TransferStats
from kvtier.tier.link.threads import use_one_thread


class InjectedTransferFault(RuntimeError):
    """Raised inside the worker when the `fault` hook asks a step to fail."""


CUDA_POLL_S = 1e-4  # how often a host wait re-queries a CUDA event
CLOSE_JOIN_S = 5.0  # close() gives the worker this long to finish its current step
DELIVERED_MEMORY = 4096  # outcomes of delivered jobs kept for late wait_layer/is_done calls
CLOSED_ERROR = "transfer engine closed before the job finished"


class TransferEngine:
    """Moves blocks between the device's KV memory and `host`, asynchronously, one worker,
    loads first. `device` is a `KVLayout` (or kvtier's own contiguous KV tensor)."""

    def __init__(
        self,
        device: KVLayout | torch.Tensor,
        host: HostPool,
        blocks_per_chunk: int = 16,
        fault: LinkFault = no_link_fault,
        store_gbps: float | None = None,
        load_threads: int = 1,
        load_gbps: float | None = None,
    ) -> None:
        """`load_threads`: CPU threads that share a whole-block load (`copy.CopyTeam`);
        `load_gbps`: the loads' average bandwidth cap (`max_load_gbps`)."""
        layout = as_layout(device)
        check_link_setup(layout, host, blocks_per_chunk)
        self.layout = layout
        self.host = host
        self.blocks_per_chunk = blocks_per_chunk
        self.fault = fault
        self.store_gbps = store_gbps  # CPU: cap on store bandwidth, so stores yield to compute
        self.load_gbps = load_gbps
        self._load_free_at = 0.0  # worker only: when the loads so far have crossed at the cap
        self._cuda = layout.is_cuda
        self._team = CopyTeam(1 if self._cuda else load_threads)
        self._streams: dict[Medium, Any] = {}
        if self._cuda:
            self._streams = {d: torch.cuda.Stream(device=layout.device) for d in (LOAD, STORE)}
        self._cond = threading.Condition()
        self._queues: dict[Medium, deque[Copy]] = {d: deque() for d in (LOAD, STORE)}
        self._jobs: dict[int, Copy] = {}  # submitted and not yet delivered, in that order
        self._inflight: list[Copy] = []
        self._finished: deque[Copy] = deque()  # in order of completion
        self._delivered: OrderedDict[int, bool] = OrderedDict()
        self._closing = False
        self._counters = {d: DirectionCounter() for d in (LOAD, STORE)}
        self._since = time.perf_counter()
        self._worker = threading.Thread(target=self._run, name="kvtier-transfer", daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> int:
        """Queue a job (its id is the caller's); its copies start after the current stream's
        work queued so far. ValueError for a job the link cannot run."""
        check_link_job(job, self.layout.num_blocks, self.host.num_slots)
        # Stores go in chunks so a load never waits behind a long one; a whole-block load is
        # one step (nothing preempts it, and each step costs a worker hand-off).
        chunks = 1 if job.dst is LOAD else math.ceil(job.num_blocks / self.blocks_per_chunk)
        steps = self.layout.num_layers if job.layerwise else max(1, chunks)
        copy = Copy(job, num_steps=steps)
        if self._cuda:
            copy.ready_event = torch.cuda.Event()
            copy.ready_event.record(torch.cuda.current_stream(self.layout.device))
        elif job.layerwise:
            copy.index = layer_index(job.device_blocks, job.host_slots)
        with self._cond:
            if self._closing:
                raise RuntimeError("transfer engine is closed; no new jobs")
            if job.id in self._jobs:
                raise ValueError(f"job {job.id} is already in flight")
            self._delivered.pop(job.id, None)
            self._jobs[job.id] = copy
            self._queues[job.dst].append(copy)
            self._cond.notify_all()
        return job.id

    def oldest(self) -> int | None:
        """The earliest submitted job whose result is not yet delivered (None: none is)."""
        with self._cond:
            return next(iter(self._jobs), None)

    def pending(self, job_id: int) -> bool:
        """Submitted, and its result not yet delivered."""
        with self._cond:
            return job_id in self._jobs

    def poll(self) -> list[Result]:
        """Results of the jobs finished since the last call, in order of completion."""
        with self._cond:
            self._reap_locked()
            return [self._deliver_locked(self._finished[0]) for _ in range(len(self._finished))]

    def wait(self, job_id: int, timeout: float | None = None) -> Result:
        """Block the host until the job is complete (TimeoutError after `timeout` seconds).

        On CUDA this waits for the copy itself, not just its issue: the result hands the host
        slots and device blocks back to their owners, who may reuse them from the CPU.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            job = self._pending_locked(job_id)
            while True:
                self._reap_locked()
                if job.state is JobState.FINISHED:
                    return self._deliver_locked(job)
                self._cond.wait(self._wait_slice_locked(job, deadline))

    def wait_layer(self, job_id: int, layer: int, timeout: float | None = None) -> bool:
        """True once layer `layer` of a load can be read; False if the job failed first.

        False means "recompute these tokens": the job's blocks hold partial bytes. On CUDA
        the host waits only until the layer's copy is issued; the current stream is then made
        to wait on its event, so compute queued afterwards reads the layer after it lands. A
        job that is not layerwise counts as arrived when the whole job has.
        """
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} is not in 0..{self.layout.num_layers - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if job_id in self._delivered:
                return self._delivered[job_id]
            job = self._pending_locked(job_id)
            while True:
                self._reap_locked()
                arrived = self._layer_ready_locked(job, layer)
                if arrived is not None or job.state is JobState.FINISHED:
                    break
                self._cond.wait(self._wait_slice_locked(job, deadline))
        if arrived is None:  # finished without that layer
            return not job.error
        if self._cuda and arrived is not True:
            torch.cuda.current_stream(self.layout.device).wait_event(arrived)
        return True

    def is_done(self, job_id: int) -> bool:
        """Whether the job has finished (successfully or not), delivered or not."""
        with self._cond:
            if job_id in self._delivered:
                return True
            job = self._pending_locked(job_id)
            self._reap_locked()
            return job.state is JobState.FINISHED

    def stats(self) -> TransferStats:
        """Counters per direction since construction or the last `reset_stats()`."""
        with self._cond:
            self._reap_locked()
            elapsed = time.perf_counter() - self._since
            return TransferStats(elapsed, self._counters[STORE].freeze(elapsed),
                                 self._counters[LOAD].freeze(elapsed))

    def reset_stats(self) -> None:
        with self._cond:
            self._counters = {d: DirectionCounter() for d in (LOAD, STORE)}
            self._since = time.perf_counter()

    def close(self) -> None:
        """Stop the worker after its current step; jobs not finished by then fail."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._worker.join(timeout=CLOSE_JOIN_S)
        self._team.close()
        for stream in self._streams.values():
            stream.synchronize()  # nothing issued is still writing when close returns
        with self._cond:
            for queue in self._queues.values():
                while queue:
                    job = queue.popleft()
                    job.error = job.error or CLOSED_ERROR
                    self._retire_locked(job)  # CUDA: finishes once its issued copies have
            self._reap_locked()
            self._cond.notify_all()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        if not self._cuda:
            use_one_thread()  # compute keeps its OpenMP team and its cores (threads.py)
        while True:
            with self._cond:
                while not self._closing and self._head_locked() is None:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._head_locked()
                assert job is not None
            try:
                self._step(job)
            except Exception as e:  # a failed job must never take the worker down with it
                self._fail(job, f"{type(e).__name__}: {e}")

    def _head_locked(self) -> Copy | None:
        """The next job to advance: loads first, then stores, each in order of submission."""
        for direction in (LOAD, STORE):
            if self._queues[direction]:
                return self._queues[direction][0]
        return None

    def _step(self, job: Copy) -> None:
        """Copy (CPU) or issue (CUDA) the job's next step, then account for it."""
        idx, spec = job.next_step, job.job
        if spec.id >= 0 and self.fault(spec, idx):  # the start-up probe's own never fail
            raise InjectedTransferFault(f"injected fault in step {idx} of job {job.id}")
        if self._closing:
            return
        paced = self.load_gbps is not None and job.direction is LOAD
        if paced and self._cuda:  # the copy runs at full speed: the next one starts late
            self._pause_until(self._load_free_at)
        start = time.perf_counter()
        event = None
        if self._cuda:
            stream = self._streams[job.direction]
            with torch.cuda.stream(stream):
                if job.start_event is None:
                    stream.wait_event(job.ready_event)  # compute queued before submit
                    job.start_event = torch.cuda.Event(enable_timing=True)
                    job.start_event.record(stream)
                nbytes = self._copy(job, idx)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
        else:
            nbytes = self._copy(job, idx)
        if paced:
            assert self.load_gbps is not None
            self._load_free_at = (max(start, self._load_free_at)
                                  + nbytes / (self.load_gbps * 1e9))
            if not self._cuda:  # what the link would have taken: usable only then
                self._pause_until(self._load_free_at)
        end = time.perf_counter()
        with self._cond:
            if job.state is not JobState.QUEUED:  # closed meanwhile
                return
            job.started = start if job.started is None else job.started
            job.next_step += 1
            job.bytes += nbytes
            if event is not None:
                job.events.append(event)
            else:
                self._counters[job.direction].bytes += nbytes
                self._counters[job.direction].busy_s += end - start
            if spec.layerwise:
                job.layers_ready = idx + 1
            if job.next_step == job.num_steps:
                self._queues[job.direction].popleft()
                self._retire_locked(job)
            self._cond.notify_all()
            if self.store_gbps and event is None and job.direction is STORE:
                # Stores are background work: pause so they average at most store_gbps and
                # leave memory bandwidth to decode. A submitted load wakes the worker early.
                self._cond.wait(max(0.0, nbytes / (self.store_gbps * 1e9) - (end - start)))

    def _pause_until(self, when: float) -> None:
        """The worker waits until `when` (perf_counter), or until the engine closes."""
        with self._cond:
            while not self._closing and (left := when - time.perf_counter()) > 0:
                self._cond.wait(left)

    def _copy(self, job: Copy, idx: int) -> int:
        spec, host, encoding = job.job, self.host.tensor, self.host.encoding
        if spec.layerwise:
            return move_layer(self.layout, host, idx, spec.device_blocks, spec.host_slots,
                              job.index, encoding)
        per_step = spec.num_blocks if job.direction is LOAD else self.blocks_per_chunk
        lo, hi = idx * per_step, (idx + 1) * per_step
        return move_blocks(self.layout, host, spec.device_blocks[lo:hi],
                           spec.host_slots[lo:hi], job.direction is STORE, encoding,
                           self._team if job.direction is LOAD else None)

    def _fail(self, job: Copy, error: str) -> None:
        event = None
        if self._cuda and job.start_event is not None:
            try:  # covers whatever the failed step issued before raising
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._streams[job.direction])
            except Exception:
                event = None
        with self._cond:
            if job.state is not JobState.QUEUED:
                return
            job.error = error
            if event is not None:
                job.events.append(event)
            queue = self._queues[job.direction]
            if job in queue:
                queue.remove(job)
            self._retire_locked(job)
            self._cond.notify_all()

    def _retire_locked(self, job: Copy) -> None:
        """A job with nothing left to issue: finished now (CPU) or when its events are."""
        if job.events:
            job.state = JobState.INFLIGHT
            self._inflight.append(job)
        else:
            self._finish_locked(job)

    def _reap_locked(self) -> None:
        """Finish the CUDA jobs whose last event has completed."""
        done = [j for j in self._inflight if j.events[-1].query()]
        self._inflight = [j for j in self._inflight if j not in done]
        for job in done:
            self._finish_locked(job)

    def _finish_locked(self, job: Copy) -> None:
        counter = self._counters[job.direction]
        if job.events:  # CUDA: time the copies on the GPU's own clock
            seconds = job.start_event.elapsed_time(job.events[-1]) / 1e3
            counter.bytes += job.bytes
            counter.busy_s += seconds
        else:
            seconds = 0.0 if job.started is None else time.perf_counter() - job.started
        counter.jobs += 1
        counter.failures += bool(job.error)
        job.result = Result.whole(job.id, job.job.num_blocks, not job.error, job.bytes,
                                  seconds, job.error, time.perf_counter())
        job.state = JobState.FINISHED
        job.index = None
        self._finished.append(job)
        self._cond.notify_all()

    def _deliver_locked(self, job: Copy) -> Result:
        self._finished.remove(job)
        del self._jobs[job.id]
        assert job.result is not None
        self._delivered[job.id] = job.result.success
        while len(self._delivered) > DELIVERED_MEMORY:
            self._delivered.popitem(last=False)
        return job.result

    def _pending_locked(self, job_id: int) -> Copy:
        if job_id not in self._jobs:
            state = "already delivered" if job_id in self._delivered else "unknown"
            raise ValueError(f"transfer job {job_id} is {state}")
        return self._jobs[job_id]

    def _layer_ready_locked(self, job: Copy, layer: int) -> Any:
        """None until the layer is in place; then True (CPU) or the CUDA event to wait on."""
        if job.job.layerwise:
            if job.layers_ready <= layer:
                return None
            return job.events[layer] if self._cuda else True
        if job.error or job.state is JobState.QUEUED:
            return None  # failed, or not all issued yet
        return job.events[-1] if self._cuda else (True if job.state is JobState.FINISHED else None)

    def _wait_slice_locked(self, job: Copy, deadline: float | None) -> float | None:
        """How long the next condition wait may sleep; TimeoutError past the deadline."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(f"transfer job {job.id} still running at its timeout")
        if job.state is JobState.INFLIGHT:  # the GPU, not the worker, will finish it
            return CUDA_POLL_S if remaining is None else min(remaining, CUDA_POLL_S)
        return remaining
