"""The scheduler's side of the host tier: what goes down, what comes back, what is pinned.

Primitives (bookkeeping only; bytes move in `transfer/` once the engine submits the jobs):
  store(block_ids, keys, tokens)     device blocks -> host slots; each device block is held by
                                     one extra pool reference until its copy is known complete
  host_hits(keys, tokens) -> int     leading keys the host tier holds, confirmed by token ids
  load(request_id, keys, block_ids)  host slots -> freshly allocated device blocks
  finish(ref, success, seconds)      the engine reports every finished job here
  take_jobs()                        jobs decided since the last call, for the engine to submit
  demote_idle(), write_back()        the two background policies, run once per step
Between a job's creation and `finish`, its host slots are pinned in the tier and its device
blocks in the pool: neither can be evicted or handed out again.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.cache.block import BlockKey
from kvtier.cache.block_pool import BlockPool
from kvtier.config import OffloadConfig
from kvtier.deep_offload import DeepOffload
from kvtier.planner import Planner
from kvtier.tiers.host import HostTier

SWAP_PREFIX = b"swap:"


def swap_key(request_id: str, block_index: int) -> BlockKey:
    """Key of a preempted sequence's partial last block: not content-addressable, per request."""
    return SWAP_PREFIX + f"{request_id}:{block_index}".encode()


@dataclass(frozen=True)
class BlockTransfer:
    """A job for the transfer engine: device_blocks[i] <-> host_slots[i]."""

    ref: int
    kind: Literal["store", "load"]
    device_blocks: tuple[int, ...]
    host_slots: tuple[int, ...]
    layerwise: bool = False


@dataclass(frozen=True)
class LoadDone:
    """A finished load, for the scheduler to apply to its sequence."""

    request_id: str
    success: bool
    num_blocks: int
    nbytes: int
    seconds: float


@dataclass
class _Job:
    transfer: BlockTransfer
    keys: list[BlockKey]
    request_id: str | None = None
    predicted_s: float | None = None
    demote: bool = False  # idle demotion: forget the device copy once the host has it
    # Blocks taken from the eviction end of the free queue (write-back, demotion) go back
    # there; others (write-through, swap) return as recently used.
    from_eviction_end: bool = False
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class OffloadStats:
    stored_blocks: int = 0
    loaded_blocks: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    demoted_blocks: int = 0  # idle blocks whose device copy was dropped
    store_refused: int = 0  # stores the host tier could not make room for


class HostOffload:
    """Coordinates the device pool, the host tier's slots and the planner for the scheduler."""

    def __init__(self, config: OffloadConfig, pool: BlockPool, tier: HostTier, planner: Planner,
                 block_bytes: int) -> None:
        self.config = config
        self.pool = pool
        self.tier = tier
        self.planner = planner
        self.block_bytes = block_bytes
        self.jobs: dict[int, _Job] = {}
        self._outbox: list[BlockTransfer] = []
        self._refs = itertools.count()
        self.stats = OffloadStats()
        self.deep: DeepOffload | None = None  # disk / remote below the host tier, if any
        self.lossy = bool(config.kv_offload_dtype)  # host slots hold 8-bit encodings

    def take_jobs(self) -> list[BlockTransfer]:
        jobs, self._outbox = self._outbox, []
        return jobs

    @property
    def pending_stores(self) -> int:
        return sum(1 for j in self.jobs.values() if j.transfer.kind == "store")

    def store(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], demote: bool = False,
              from_eviction_end: bool = False) -> bool:
        """Copy blocks the host lacks; False if the tier could not make room (nothing changes)."""
        if not keys:
            return True
        prepared = self.tier.prepare_store(keys, tokens)
        if prepared is None:
            self.stats.store_refused += 1
            return False
        if not prepared.keys:
            return True
        where = {k: b for k, b in zip(keys, block_ids)}
        blocks = tuple(where[k] for k in prepared.keys)
        self.pool.touch(blocks)  # the device bytes must outlive the copy
        self._add(_Job(BlockTransfer(next(self._refs), "store", blocks, tuple(prepared.slots)),
                       list(prepared.keys), demote=demote, from_eviction_end=from_eviction_end))
        return True

    def host_hits(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]]) -> int:
        return self.tier.lookup(keys, tokens) if keys else 0

    def load(self, request_id: str, keys: Sequence[BlockKey], block_ids: Sequence[int],
             layerwise: bool, predicted_s: float | None) -> int:
        slots = self.tier.prepare_load(keys)
        self.tier.touch(keys)
        transfer = BlockTransfer(next(self._refs), "load", tuple(block_ids), tuple(slots),
                                 layerwise)
        self._add(_Job(transfer, list(keys), request_id, predicted_s))
        return transfer.ref

    def _add(self, job: _Job) -> None:
        self.jobs[job.transfer.ref] = job
        self._outbox.append(job.transfer)

    def finish(self, ref: int, success: bool, seconds: float) -> LoadDone | None:
        """Apply a finished job; a load returns what its sequence needs to know."""
        job = self.jobs.pop(ref)
        t = job.transfer
        nbytes = len(t.device_blocks) * self.block_bytes
        if t.kind == "store":
            self.tier.complete_store(job.keys, success)
            if success:
                self.stats.stored_blocks += len(job.keys)
                self.stats.stored_bytes += nbytes
                if self.deep is not None:  # the second hop: host -> disk / remote
                    self.deep.host_stored([k for k in job.keys if not k.startswith(SWAP_PREFIX)])
            else:
                self.stats.failed_stores += 1
            # Idle or about-to-be-evicted blocks go back where they were: first to be reused.
            self.pool.free(t.device_blocks, evict_first=success and job.from_eviction_end)
            if success and job.demote:
                idle = [b for b in t.device_blocks
                        if self.pool.ref_cnt[b] == 0 and self.pool.key[b] is not None]
                self.pool.uncache(idle)
                self.stats.demoted_blocks += len(idle)
            return None
        self.tier.complete_load(job.keys, success)
        swap_keys = [k for k in job.keys if k.startswith(SWAP_PREFIX)]
        if swap_keys:
            self.tier.remove(swap_keys)  # a preempted sequence's own blocks serve it once
        if success and self.config.kv_write_policy == "write_back":
            # Exclusive tiers: the device copy is now the one that counts and is written back
            # when evicted, so the host slot is freed and the two pools add up in capacity.
            self.tier.remove(job.keys)
        if success:
            self.stats.loaded_blocks += len(job.keys)
            self.stats.loaded_bytes += nbytes
            self.planner.observe_transfer(nbytes, seconds, job.predicted_s)
        else:
            self.stats.failed_loads += 1
        assert job.request_id is not None
        return LoadDone(job.request_id, success, len(job.keys), nbytes, seconds)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Drop a request's swap entries (it finished or was aborted before waking)."""
        swap_keys = [k for k in keys if k.startswith(SWAP_PREFIX)]
        if swap_keys:
            self.tier.remove(swap_keys)

    def demote_idle(self, now: float) -> None:
        """Cached device blocks unused for `idle_offload_s`: make sure the host has them, then
        drop the device copy, so an idle session stops holding device memory."""
        if self.config.idle_offload_s <= 0:
            return
        cutoff = now - self.config.idle_offload_s
        idle = self.pool.cached_free(self.pool.num_blocks, idle_before=cutoff)
        self._store_free_blocks(idle, demote=True)

    def demote_all(self, limit: int | None = None) -> int:
        """Push cached, unused device blocks down to host and drop their device copy (what
        `idle_offload_s` does after a while, now), at most `limit` of them; how many were
        taken. For `kvtier selftest`, tests, and the write-down at shutdown."""
        blocks = self.pool.cached_free(self.pool.num_blocks)[:limit]
        self._store_free_blocks(blocks, demote=True)
        return len(blocks)

    def write_back(self, watermark: int) -> None:
        """The next `watermark` blocks the device would evict go down if the host lacks them.
        Under `write_back` this is how blocks reach the host at all (and the tiers are
        exclusive: a block woken from host leaves it, see finish). Under `write_through` it
        catches what a full host refused at finish, instead of losing it to eviction."""
        # `allocate` takes uncached free blocks first: only the cached blocks that the
        # next `watermark` allocations would reach need to be on host already.
        at_risk = watermark - self.pool.num_free_uncached()
        if at_risk > 0:
            self._store_free_blocks(self.pool.cached_free(at_risk), demote=False)

    def _store_free_blocks(self, blocks: list[int], demote: bool) -> None:
        missing_blocks, keys, tokens, on_host = [], [], [], []
        for block in blocks:
            key = self.pool.key[block]
            assert key is not None
            if self.tier.lookup([key]) == 1 or (self.deep is not None
                                                and self.deep.on_disk(key)):
                on_host.append(block)  # safe below the device already
                continue
            missing_blocks.append(block)
            keys.append(key)
            tokens.append(self.pool.tokens[block] or ())
        if demote and on_host:
            self.pool.uncache(on_host)
            self.stats.demoted_blocks += len(on_host)
        if keys:
            self.store(missing_blocks, keys, tokens, demote=demote, from_eviction_end=True)
