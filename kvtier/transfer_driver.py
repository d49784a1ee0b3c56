"""The engine's side of the host tier: builds it, feeds the scheduler's jobs to the transfer
engine, and hands finished jobs back.

Primitives: `build(config, runner, pool)`, `submit(jobs)`, `reap()`, `layer_barrier(batch)`,
`finish_layerwise(batch)`, `wait_any()`, `close()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from kvtier.cache.block_pool import BlockPool
from kvtier.config import EngineConfig
from kvtier.deep_driver import DeepDriver
from kvtier.deep_offload import FetchDone
from kvtier.errors import ConfigError
from kvtier.model.runner import ModelRunner
from kvtier.offload import BlockTransfer, HostOffload, LoadDone
from kvtier.planner import Calibration, Planner
from kvtier.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from kvtier.sequence import SamplingParams, Sequence
from kvtier.tiers.host import HostTier
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_memory import HostPool
from kvtier.transfer.spec import Direction, TransferResult, TransferSpec

CALIBRATION_BLOCKS = 8
CALIBRATION_PREFILL_TOKENS = 256


class TransferDriver:
    def __init__(self, offload: HostOffload, transfer: TransferEngine, host: HostPool,
                 deep: DeepDriver | None = None) -> None:
        self.offload = offload
        self.transfer = transfer
        self.host = host
        self.deep = deep  # disk / remote below the host tier
        self.scheduler: Scheduler | None = None
        self._job_of: dict[int, int] = {}  # offload ref -> transfer job id
        self._ref_of: dict[int, int] = {}

    @classmethod
    def build(cls, config: EngineConfig, runner: ModelRunner, pool: BlockPool,
              namespace: bytes) -> TransferDriver:
        """`namespace`: the engine's fingerprint digest, which every block below host carries."""
        if not config.cache.enable_prefix_caching:
            raise ConfigError(
                "kv_offloading_size > 0 needs enable_prefix_caching=True: the host tier finds "
                "blocks by their prefix keys, so nothing would ever be offloaded"
            )
        oc = config.offload
        host = HostPool.from_size(oc.kv_offloading_size, runner.kv,
                                  encoding=oc.kv_offload_dtype or "")
        transfer = TransferEngine(runner.kv, host, oc.blocks_per_chunk,
                                  store_gbps=oc.max_store_gbps)
        try:
            calibration = calibrate(runner, transfer, host)
        except BaseException:
            transfer.close()
            raise
        tier = HostTier(host.num_slots, oc.eviction_policy)
        planner = Planner(calibration)
        offload = HostOffload(oc, pool, tier, planner, runner.block_bytes)
        try:
            deep = DeepDriver.build(oc, host, tier, namespace, runner.block_size, planner)
        except BaseException:
            transfer.close()
            host.release()
            raise
        if deep is not None:
            offload.deep = deep.deep
        return cls(offload, transfer, host, deep)

    def submit(self, jobs: Iterable[BlockTransfer]) -> None:
        for job in jobs:
            direction = Direction.STORE if job.kind == "store" else Direction.LOAD
            spec = TransferSpec(direction, job.device_blocks, job.host_slots, job.layerwise)
            job_id = self.transfer.submit(spec)
            self._job_of[job.ref] = job_id
            self._ref_of[job_id] = job.ref
        if self.deep is not None:
            self.deep.submit()  # fetches the scheduler started, writes of finished stores

    def _apply(self, result: TransferResult) -> LoadDone | None:
        ref = self._ref_of.pop(result.job_id)
        del self._job_of[ref]
        done = self.offload.finish(ref, result.success, result.seconds)
        if done is not None and self.scheduler is not None:
            self.scheduler.load_done(done)
        return done

    def reap(self) -> None:
        """Apply every job that finished since the last call."""
        for result in self.transfer.poll():
            self._apply(result)
        if self.deep is not None:
            self._fetched(self.deep.reap())

    def _fetched(self, done: list[FetchDone]) -> None:
        if self.scheduler is not None:
            for d in done:
                self.scheduler.fetch_done(d)

    def wait_any(self) -> None:
        """Nothing can run until a transfer lands (a swap frees blocks, a load wakes a
        sequence): block on the oldest job in flight."""
        if self._ref_of:
            self._apply(self.transfer.wait(min(self._ref_of)))
        elif self.deep is not None and self.deep.busy:  # a fetch from disk / remote
            self._fetched(self.deep.wait_any())

    def layer_barrier(self, batch: SchedulerOutput) -> Callable[[int], None] | None:
        """For layerwise loads in this step: block layer l's attention until l has arrived."""
        jobs = [self._job_of[s.wait_ref] for s in batch.scheduled if s.wait_ref is not None]
        if not jobs:
            return None

        def barrier(layer: int) -> None:
            for job in jobs:
                self.transfer.wait_layer(job, layer)  # False (failed) is handled after the step

        return barrier

    def finish_layerwise(self, batch: SchedulerOutput) -> set[str]:
        """Collect this step's layerwise loads; the ids of sequences whose load failed (their
        step computed over partial bytes and must be discarded)."""
        void: set[str] = set()
        for s in batch.scheduled:
            if s.wait_ref is not None and s.wait_ref in self._job_of:
                done = self._apply(self.transfer.wait(self._job_of[s.wait_ref]))
                if done is not None and not done.success:
                    void.add(s.seq.request_id)
        return void

    def drain(self) -> None:
        """Submit what the scheduler decided and wait until no transfer is in flight."""
        self.submit(self.offload.take_jobs())
        while self.busy:
            self.wait_any()

    @property
    def busy(self) -> bool:
        return bool(self._ref_of) or (self.deep is not None and self.deep.busy)

    def write_down(self) -> None:
        """Before a clean exit with a disk or remote tier: every cached block still only on
        device or host goes down (two hops) and the disk is synced, so the next process (or
        another one sharing the Redis) finds it."""
        if self.deep is None:
            return
        self.drain()
        self.deep.flush()  # what only host holds goes down first: the batches below evict it
        batch = max(1, self.offload.tier.num_slots // 2)  # a host smaller than the device
        for _ in range(-(-self.offload.pool.num_blocks // batch)):  # bounded: stores may fail
            if not self.offload.demote_all(batch):  # demoted blocks leave the device cache
                break
            self.drain()
            self.deep.flush()

    def close(self) -> None:
        """Stop the workers and give the host pool's memory back, even if this object lives
        on (a traceback, a test framework) after the engine is done with it."""
        self.transfer.close()
        if self.deep is not None:
            self.deep.close()
        self.host.release()


def calibrate(runner: ModelRunner, transfer: TransferEngine, host: HostPool) -> Calibration:
    """Measure this machine's link and prefill speed before serving (the planner's start)."""
    n = min(CALIBRATION_BLOCKS, runner.num_blocks, host.num_slots)
    blocks = tuple(range(n))
    transfer.wait(transfer.submit(TransferSpec(Direction.STORE, blocks, blocks)))
    for _ in range(2):
        full = transfer.wait(transfer.submit(TransferSpec(Direction.LOAD, blocks, blocks)))
    one = transfer.wait(transfer.submit(TransferSpec(Direction.LOAD, blocks[:1], blocks[:1])))
    transfer.poll()
    transfer.reset_stats()
    per_block = max((full.seconds - one.seconds) / max(n - 1, 1), 1e-9)
    gbps = runner.block_bytes / per_block / 1e9
    overhead = max(one.seconds - runner.block_bytes / (gbps * 1e9), 0.0)
    tokens = min(CALIBRATION_PREFILL_TOKENS, runner.num_blocks * runner.block_size - 1)
    seq = Sequence("calibration", [1 + (i * 7) % 50 for i in range(tokens)],
                   SamplingParams(max_tokens=1, temperature=0.0))
    used = list(range(-(-tokens // runner.block_size)))
    chunk = ScheduledSeq(seq, 0, tokens, used)
    runner.execute([chunk])  # warm-up
    start = time.perf_counter()
    runner.execute([chunk])
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    prefill_tps = tokens / (time.perf_counter() - start)
    return Calibration(link_gbps=gbps, transfer_overhead_s=overhead,
                       prefill_tokens_per_s=prefill_tps)
