"""The connector's worker half: vLLM's registered KV tensors become a `KVLayout` under a
`TierWorker`, and each step's jobs run around the forward pass. Each step's copies are
waited for: loads finish before the forward pass reads them, stores before `wait_for_save`
returns (so vLLM may free or reuse the blocks at once). On CPU they are plain copies, well
under a millisecond a block; on CUDA they run on the link's side streams from a pinned host
pool, a store ordered after the compute queued before it by an event.
Jobs below host (host rows written on to disk or Redis, fetches back into host rows) run on
the tier's I/O thread, across steps; their results go back with whichever step sees them.

  register(kv_caches)   validate the tensors (shape, dtype, contiguity, one storage) against
                        what the scheduler planned for, and allocate the host pool
  start_below(jobs)     queue the step's jobs below host on the I/O thread (before the
                        forward pass: `bind_connector_metadata`)
  load(jobs) / save(jobs)   run the step's host -> device / device -> host jobs (load also
                        queues the jobs below host not queued yet)
  take_results()        for the scheduler (worker metadata): this step's, and the I/O
                        thread's since the last call; failed loads' blocks apart
  take_received(idle)   the requests whose asynchronous loads landed (vLLM's
                        finished_recving; a failed one's blocks among the load errors)
An instance that only produces (kv_role kv_producer: prefills handed to other instances)
lands its writes below host before each forward pass, so its handoffs reach the shared
store at the I/O thread's own speed.
A load the scheduler marked asynchronous (`async_loading.py`) is not waited for: it runs on
the link beside this step and the next, and its request is reported once it has landed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import (
    NO_FAULTS,
    Faults,
    Job,
    KVLayout,
    Medium,
    Result,
    TierConfig,
    TierWorker,
    build_worker_side,
    heads_first_coded_shape,
)

# How long a step with no tokens to compute waits for a fetch below host. Under vLLM on 2
# cores, an engine spinning empty steps held the GIL beside the I/O thread while a woken
# request's fetch ran; a request arriving meanwhile waits at most this long for its step.
IDLE_FETCH_WAIT_S = 0.02
# How long a step with no tokens to compute waits for an asynchronous load to land, for
# the same reason: vLLM would otherwise spin empty steps until it has.
IDLE_LOAD_WAIT_S = 0.05
# How long a producer's step waits for its writes below host before its forward pass: a store
# slower than this (or unreachable, until its own timeouts) costs each step no more.
WRITES_FIRST_MAX_S = 2.0


@dataclass(frozen=True)
class ExpectedLayout:
    """What the scheduler side planned for: vLLM's per-layer paged cache in its LBHNC layout
    (the one vLLM CPU uses and the connector requests on CUDA), each layer
    [num_blocks, num_kv_heads, block_size, 2 * head_size], contiguous. On CUDA the layers
    may be allocated one by one; on CPU vLLM 0.32 puts them in one allocation, and anything
    else is refused there (fail closed).

    An attention kernel that pages in smaller blocks than the scheduler (vLLM splits each
    manager block into r kernel blocks) would change what a block's bytes mean without the
    scheduler side, which names blocks, knowing it: refused, with the block size that fits.

    Under vLLM's hybrid allocator the KV cache groups share their per-layer tensors (layer i
    of every group is one tensor), and a block id is one group's at a time: a block is then
    the group-size tensors of `layers` (the largest group's), and every other registered
    layer must be a view of one of them."""

    layers: tuple[str, ...]  # the distinct KV tensors a block spans, in their stored order
    num_blocks: int
    layer_block_shape: tuple[int, ...]  # [num_kv_heads, block_size, head_size + head_size_v]
    dtype: Any
    host_slots: int

    def check(self, registered: Mapping[str, Any]) -> KVLayout:
        missing = [name for name in self.layers if name not in registered]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for {', '.join(missing[:3])}, "
                              f"which kvtier planned for; refusing an unknown KV layout")
        layers = {name: registered[name] for name in self.layers}
        for name, t in layers.items():
            self._check_layer(name, t)
        distinct = {t.data_ptr() for t in layers.values()}
        if len(distinct) != len(layers):
            raise ConfigError("vLLM's KV tensors of one KV cache group share memory; kvtier "
                              "refuses a layout it does not know (fail closed)")
        for name, t in registered.items():
            if name not in layers and (t.data_ptr() not in distinct
                                       or tuple(t.shape) != self.shape or t.dtype != self.dtype):
                raise ConfigError(f"vLLM's KV tensor {name} is not one of the shared tensors "
                                  f"kvtier planned for; refusing an unknown KV layout")
        storages = {t.untyped_storage().data_ptr() for t in layers.values()}
        cuda = all(t.is_cuda for t in layers.values())
        if len(storages) != 1 and not (cuda and len(storages) == len(layers)):
            raise ConfigError(f"vLLM's KV tensors live in {len(storages)} allocations; kvtier "
                              "knows one allocation for all layers (vLLM 0.32's CPU backend) "
                              "or, on CUDA, one per layer")
        return KVLayout.from_layers(layers, heads_first=True)

    @property
    def coded_shape(self) -> tuple[int, ...]:
        """A block as kvtier's 8-bit codec reads it: [layers, block_size, 2, heads, head_dim]
        (the scheduler sizes 8-bit host slots by it without the tensors)."""
        return heads_first_coded_shape(len(self.layers), self.layer_block_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.layer_block_shape)

    def _check_layer(self, name: str, t: Any) -> None:
        """A ConfigError naming the tensor for any shape, dtype or stride but the planned."""
        heads, tokens, width = self.layer_block_shape
        shape = tuple(t.shape)
        if len(shape) == 4 and shape[1:] != (heads, tokens, width) and shape[0] > \
                self.num_blocks and shape[0] % self.num_blocks == 0 \
                and shape[2] * (shape[0] // self.num_blocks) == tokens:
            raise ConfigError(
                f"vLLM's attention kernel pages KV in blocks of {shape[2]} tokens, the "
                f"scheduler in blocks of {tokens}; kvtier keys and stores scheduler blocks "
                f"and would have to know the kernel's split on both sides: start vLLM with "
                f"--block-size {shape[2]}")
        want = (self.num_blocks, heads, tokens, width)
        if shape != want or t.dtype != self.dtype or not t.is_contiguous():
            raise ConfigError(
                f"vLLM's KV tensor {name} is {shape} {t.dtype} (contiguous="
                f"{t.is_contiguous()}); kvtier knows vLLM's contiguous LBHNC layout {want} "
                f"{self.dtype} only and refuses any other (fail closed)")

class WorkerSide:
    """A TierWorker over vLLM's KV caches, run one step at a time."""

    def __init__(self, config: TierConfig, expected: ExpectedLayout, namespace: bytes,
                 block_size: int, faults: Faults = NO_FAULTS, writes_first: bool = False
                 ) -> None:
        """`writes_first`: an instance that only produces (vLLM's kv_role kv_producer) lands
        its writes below host before each forward pass (`_land_writes`)."""
        self.config = config
        self.writes_first = writes_first
        self.expected = expected
        self.namespace = namespace  # the fingerprint every block below host carries
        self.block_size = block_size
        self.faults = faults  # what a test makes fail (KVTIER_FAULT_LOADS=1: every load)
        self.worker: TierWorker | None = None
        self._results: list[Result] = []
        self._load_errors: set[int] = set()
        self._sent: set[str] = set()
        self._receiving: dict[int, tuple[str, tuple[int, ...]]] = {}  # async load -> request
        self._received: set[str] = set()
        self._started: set[int] = set()  # this step's jobs below host, already submitted

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        layout = self.expected.check(kv_caches)
        worker = build_worker_side(self.config, layout, self.namespace, self.block_size,
                                   self.faults)
        if worker.host_slots != self.expected.host_slots:
            worker.close()
            raise ConfigError(f"the host pool holds {worker.host_slots} slots but the "
                              f"scheduler planned {self.expected.host_slots}; refusing to run")
        self.worker = worker

    def load(self, jobs: Sequence[Job], invalid: Sequence[int] = (), idle: bool = False,
             async_loads: Sequence[tuple[int, str]] = (), received: Sequence[str] = ()
             ) -> None:
        """Host -> device jobs, complete before the forward pass reads the blocks; jobs
        below host start on the I/O thread (fetches ahead of writes). `invalid`: blocks the
        scheduler side did not load though vLLM counts them restored: load errors. `idle`:
        this step computes nothing, so it waits (up to IDLE_FETCH_WAIT_S) for fetches
        below host: their results go back in this step instead of the engine spinning empty
        steps beside the I/O thread, and the waiting request is offered its prefix at once.
        `async_loads`: (job, request) of the loads not waited for (`take_received` tells when
        each has landed); `received`: requests vLLM waits on with nothing to load."""
        self._load_errors.update(invalid)
        self._received.update(received)
        apart = dict(async_loads)
        loads = [j for j in jobs if j.dst is Medium.DEVICE]
        if self.worker is None:  # never registered: every load fails now, each told at once
            self._received.update(apart[j.id] for j in loads if j.id in apart)
            apart = {}
        self._run([j for j in loads if j.id not in apart])
        for job in (j for j in loads if j.id in apart):
            assert self.worker is not None
            self._receiving[job.id] = (apart[job.id], job.device_blocks)
            self.worker.submit(job)
        self.start_below(jobs)
        if idle and self.worker is not None and not self.writes_first:
            self._results += self.worker.wait_fetches(IDLE_FETCH_WAIT_S)

    def start_below(self, jobs: Sequence[Job]) -> None:
        """The step's jobs below host (writes on, fetches) start on the I/O thread, once
        each: called before the forward pass where the engine allows (vLLM starts a step's
        loads after it when none is synchronous, and a write decided for the step would
        start a whole forward pass late), and by `load` for the rest."""
        below = [j for j in jobs if j.below_host and j.id not in self._started]
        self._started = {j.id for j in jobs if j.below_host}  # this step's, submitted once
        if self.worker is None:  # never registered: every job fails, nothing is served
            self._results += [Result(j.id, (False,) * len(j.keys),
                                     ("no KV caches registered",) * len(j.keys), 0, 0.0)
                              for j in below]
            return
        for job in below:
            self.worker.submit(job)
        if below and self.writes_first:
            self._land_writes()

    def _land_writes(self) -> None:
        """A producer's writes below host land before its next forward pass (at most
        WRITES_FIRST_MAX_S), rather than share its cores with the next prefill: its
        handoffs reach the shared store at the I/O thread's own speed, and the prefill
        waits the writes' time."""
        assert self.worker is not None
        deadline = time.monotonic() + WRITES_FIRST_MAX_S
        while self.worker.busy and time.monotonic() < deadline:
            self._results += self.worker.wait_any()

    def save(self, jobs: Sequence[Job], sending: Sequence[str] = ()) -> None:
        """Device -> host jobs of blocks this step filled, complete before vLLM may reuse them;
        `sending`: finished requests whose held blocks those jobs copied (`take_sent`)."""
        self._run([j for j in jobs if j.src is Medium.DEVICE])
        self._sent.update(sending)

    def take_sent(self) -> set[str]:
        """Finished requests whose held blocks are copied (or failed: not served), for vLLM
        to free."""
        sent, self._sent = self._sent, set()
        return sent

    def _run(self, jobs: Sequence[Job]) -> None:
        if not jobs:
            return
        if self.worker is None:  # never registered: every job fails, nothing is served
            self._results += [Result.whole(j.id, j.num_blocks, False, 0, 0.0,
                                           "no KV caches registered") for j in jobs]
            self._load_errors.update(b for j in jobs if j.dst is Medium.DEVICE
                                     for b in j.device_blocks)
            return
        assert self.worker is not None
        for job in jobs:
            self.worker.submit(job)
        for job in jobs:
            result = self.worker.wait(job.id)
            self._results.append(result)
            if job.dst is Medium.DEVICE and not result.success:
                self._load_errors.update(job.device_blocks)

    def take_received(self, idle: bool = False) -> set[str]:
        """Requests whose asynchronous loads landed since the last call (a failed one's
        blocks are load errors by now). `idle`: no tokens were computed this step, so wait
        a little for the oldest load rather than have vLLM spin."""
        self._collect()
        if idle and not self._received and self._receiving and self.worker is not None:
            with contextlib.suppress(TimeoutError):
                self._take(self.worker.wait(next(iter(self._receiving)), IDLE_LOAD_WAIT_S))
        received, self._received = self._received, set()
        return received

    def take_results(self) -> list[Result]:
        self._collect()  # the I/O thread's, and the asynchronous loads' that landed
        results, self._results = self._results, []
        return results

    def _collect(self) -> None:
        """What the worker finished since the last look: every result for the scheduler;
        an asynchronous load's request is received, its blocks load errors if it failed."""
        if self.worker is not None:
            for result in self.worker.poll():
                self._take(result)

    def _take(self, result: Result) -> None:
        self._results.append(result)
        request = self._receiving.pop(result.job_id, None)
        if request is not None:
            self._received.add(request[0])
            if not result.success:
                self._load_errors.update(request[1])

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()  # queued writes below host land (and are synced) first
            self.worker = None
