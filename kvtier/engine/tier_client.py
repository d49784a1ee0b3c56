"""The engine's side of the tier: the device-pool half that the library never touches.

`TierClient` joins kvtier's `BlockPool` to a built `Tier`: it takes an extra reference on
each device block a store reads and drops it on `StoreDone` (uncaching an idle block once
its bytes are on host), runs the two pool policies (idle demotion, write-back of blocks
about to be evicted), and moves jobs and results between the manager and the worker.
`NullTier` is the same face with no tier behind it, so the engine loop has no branches;
both implement `EngineTier`, which the type checker holds them to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from kvtier.cache.block_pool import BlockPool
from kvtier.config import EngineConfig, OffloadPolicy, WritePolicy
from kvtier.engine.batch import SchedulerOutput
from kvtier.engine.engine_tier import EngineTier
from kvtier.engine.prefill_rate import measure_prefill
from kvtier.errors import ConfigError
from kvtier.model.runner import ModelRunner
from kvtier.tier import (
    NO_MATCH,
    BlockKey,
    Event,
    Faults,
    Grant,
    HintReply,
    KvHints,
    KVLayout,
    Match,
    Medium,
    Prefetch,
    Purged,
    Refusal,
    RequestOutcome,
    StoreDone,
    Tier,
    TierStats,
    WorkerReport,
    build,
    chain_parents,
)

PREFILL_OBSERVE_TOKENS = 64  # steps with at least this much prefill refine the planner


class TierClient:
    """A tier under kvtier's device pool."""

    def __init__(self, tier: Tier, pool: BlockPool, policy: OffloadPolicy) -> None:
        self.tier = tier
        self.manager = tier.manager
        self.worker = tier.worker
        self.pool = pool
        self.policy = policy  # how this engine uses the tier
        self.demoted_blocks = 0  # idle blocks whose device copy was dropped
        self._stalls: dict[str, float] = {}  # request id -> layerwise wait in the last step

    @classmethod
    def build(cls, config: EngineConfig, runner: ModelRunner, pool: BlockPool,
              namespace: bytes, faults: Faults) -> EngineTier:
        """`namespace`: the engine's fingerprint digest, which every block below host
        carries. A NullTier when `kv_offloading_size` is 0."""
        policy = config.policy.on(runner.device.type)  # AUTO settled once, here
        if not config.offload.enabled:
            return NullTier(policy)
        if not config.cache.enable_prefix_caching:
            raise ConfigError(
                "kv_offloading_size > 0 needs enable_prefix_caching=True: the host tier finds "
                "blocks by their prefix keys, so nothing would ever be offloaded"
            )
        tier = build(config.offload, KVLayout.from_contiguous(runner.kv), namespace,
                     runner.block_size, measure_prefill(runner), faults)
        return cls(tier, pool, policy)

    # -- what the scheduler asks ---------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def lossy(self) -> bool:
        return self.manager.lossy

    @property
    def block_bytes(self) -> int:
        return self.manager.block_bytes

    @property
    def below_host(self) -> bool:
        return self.manager.below_host

    def report(self) -> TierStats:
        return self.manager.report()

    def worker_report(self) -> WorkerReport:
        return self.worker.report()

    def match(self, request_id: str, keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], preempted: bool, compute_ahead: int = 0,
              parent: BlockKey | None = None, tail: Sequence[int] = ()) -> Match | None:
        """`compute_ahead`: prompt tokens of running sequences not computed yet; `parent`
        and `tail`: a breakpoint's part of a block may end the match (TierManager.match)."""
        return self.manager.match(request_id, keys, tokens, preempted, compute_ahead, parent,
                                  tail)

    def prefetch(self, request_id: str, keys: Sequence[BlockKey],
                 tokens: Sequence[Sequence[int]], tenant: str = "") -> Prefetch:
        """Bring this prefix up into host now, within `tenant`'s prefetch budget (waiting
        for a shared store's presence answer, at most its wait)."""
        found = self.manager.prefetch(request_id, keys, tokens, tenant)
        if found is None:
            self.manager.wait_presence()
            found = self.manager.prefetch(request_id, keys, tokens, tenant)
        return found or Prefetch()

    def allocated(self, request_id: str, match: Match, blocks: Sequence[int],
                  layerwise: bool, swap_in: bool) -> int | None:
        exclusive = self.policy.kv_write_policy is WritePolicy.WRITE_BACK
        return self.manager.allocated(request_id, match, blocks, layerwise, exclusive, swap_in)

    def outcome(self, request_id: str) -> RequestOutcome:
        return self.manager.outcome(request_id)

    def finished(self, request_id: str, swap_keys: Sequence[BlockKey] = ()) -> None:
        self.manager.finished(request_id, swap_keys)

    def purge(self, keys: Sequence[BlockKey]) -> tuple[Purged, list[Event]]:
        """Remove `keys` from every tier, the erasing below host done before it returns
        (every job in flight lands meanwhile: their events are the scheduler's)."""
        return self._erased(lambda: self.manager.purge(keys))

    def purge_tenant(self, tenant: str) -> tuple[Purged, list[BlockKey], list[Event]]:
        """Remove every block `tenant` owns from every tier (as `purge`); the keys too, for
        the device's copies."""
        keys: list[BlockKey] = []

        def purge() -> Purged:
            purged, found = self.manager.purge_tenant(tenant)
            keys.extend(found)
            return purged

        purged, events = self._erased(purge)
        return purged, keys, events

    def _erased(self, purge: Callable[[], Purged]) -> tuple[Purged, list[Event]]:
        """Run `purge`, then wait for its erase jobs (and every other job in flight): what
        it purged, with the erase failures those jobs met, and the jobs' events."""
        below = self.manager.report().below
        before = dict(below.erase_failures) if below is not None else {}
        purged = purge()
        events = self.drain()
        below = self.manager.report().below
        after = dict(below.erase_failures) if below is not None else {}
        failed = {Medium(m): n - before.get(m, 0) for m, n in after.items()
                  if n > before.get(m, 0)}
        return replace(purged, erase_failures=failed), events

    def forget(self, keys: Sequence[BlockKey]) -> None:
        self.manager.forget(keys)

    def swap_worth_it(self, tokens: int, num_blocks: int, mode: str) -> bool:
        """Whether a preempted sequence's KV should go to host rather than be recomputed."""
        decision = self.manager.decide(tokens, num_blocks * self.block_bytes, mode)
        return decision.choice == "restore"

    def store(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], demote: bool = False,
              evict_first: bool = False, tenant: str = "", prefix: bool = False) -> bool:
        """Copy device blocks the host lacks (new ones are `tenant`'s); False if the host
        could not make room. `prefix`: the keys are a sequence's from its first block (the
        tiers then drop it from its tail)."""
        blocks = self.manager.store(block_ids, keys, tokens, demote, evict_first, tenant,
                                    chain_parents(keys) if prefix else None)
        if blocks is None:
            return False
        self.pool.touch(blocks)  # the device bytes must outlive the copy
        return True

    def answer(self, request_id: str, hints: KvHints, keys: Sequence[BlockKey],
               tokens: Sequence[Sequence[int]], parts: Mapping[int, BlockKey] | None = None
               ) -> HintReply:
        """What the finished request's hints ask of its full blocks (retention, an expected
        return) and of the parts of blocks its breakpoints kept (`parts`), answered by the
        tier."""
        return self.manager.answer(request_id, hints, keys, tokens, parts)

    def stage_returns(self) -> None:
        """Sessions due back soon come up; blocks whose retention expired are erased (with
        kv_retention_erase), the device's free cached copies too."""
        expired = self.manager.stage_returns()
        if expired:
            self.pool.purge(expired)

    # -- the two pool policies -----------------------------------------------------------

    def demote_idle(self, now: float) -> None:
        """Cached device blocks unused for `idle_offload_s`: make sure the host has them, then
        drop the device copy, so an idle session stops holding device memory."""
        if self.policy.idle_offload_s <= 0:
            return
        cutoff = now - self.policy.idle_offload_s
        self._store_free_blocks(self.pool.cached_free(self.pool.num_blocks, idle_before=cutoff),
                                demote=True)

    def demote_all(self, limit: int | None = None) -> int:
        """Push cached, unused device blocks down to host and drop their device copy (what
        `idle_offload_s` does after a while, now), at most `limit`; how many were taken."""
        blocks = self.pool.cached_free(self.pool.num_blocks)[:limit]
        self._store_free_blocks(blocks, demote=True)
        return len(blocks)

    def write_back(self, watermark: int) -> None:
        """The next `watermark` blocks the device would evict go down if no tier below holds
        them. Under `write_back` this is how blocks reach the host at all (and the tiers are
        exclusive); under `write_through` it catches what a full host refused at finish."""
        # `allocate` takes uncached free blocks first: only the cached blocks that the
        # next `watermark` allocations would reach need to be below the device already.
        at_risk = watermark - self.pool.num_free_uncached()
        if at_risk > 0:
            self._store_free_blocks(self.pool.cached_free(at_risk), demote=False)

    def _store_free_blocks(self, blocks: list[int], demote: bool) -> None:
        missing, keys, tokens, safe = [], [], [], []
        for block in blocks:
            key = self.pool.key[block]
            assert key is not None
            if self.manager.holds(key):
                safe.append(block)
                continue
            missing.append(block)
            keys.append(key)
            tokens.append(self.pool.tokens[block] or ())
        if demote and safe:
            self.pool.uncache(safe)
            self.demoted_blocks += len(safe)
        if keys:
            self.store(missing, keys, tokens, demote=demote, evict_first=True)

    # -- jobs and results: the tier drives them; StoreDone is the pool's -------------------

    def submit(self) -> None:
        """Hand every job decided since the last call to the worker."""
        self.tier.submit()

    def reap(self) -> list[Event]:
        """Apply every job that finished since the last call; the events for the scheduler."""
        return self._pool_events(self.tier.reap())

    def wait_any(self) -> list[Event]:
        """Nothing can run until a job lands or a presence answer comes: block on it."""
        return self._pool_events(self.tier.wait_any())

    def _pool_events(self, events: Sequence[Event]) -> list[Event]:
        """Settle the device pool's side of every StoreDone; the rest for the scheduler."""
        for event in events:
            if isinstance(event, StoreDone):
                self._stored(event)
        return [e for e in events if not isinstance(e, StoreDone)]

    def _stored(self, done: StoreDone) -> None:
        # Idle or about-to-be-evicted blocks go back where they were: first to be reused.
        self.pool.free(done.device_blocks, evict_first=done.success and done.evict_first)
        if done.success and done.demote:
            idle = [b for b in done.device_blocks
                    if self.pool.ref_cnt[b] == 0 and self.pool.key[b] is not None]
            self.pool.uncache(idle)
            self.demoted_blocks += len(idle)

    def layer_barrier(self, batch: SchedulerOutput) -> Callable[[int], None] | None:
        """For layerwise loads in this step: block layer l's attention until l has arrived."""
        jobs = [(s.seq.request_id, s.wait_ref) for s in batch.scheduled
                if s.wait_ref is not None]
        if not jobs:
            return None

        def barrier(layer: int) -> None:
            for rid, job in jobs:
                begin = time.perf_counter()
                self.tier.wait_layer(job, layer)  # False (failed) is handled after the step
                self._stalls[rid] = self._stalls.get(rid, 0.0) + time.perf_counter() - begin

        return barrier

    def stalls(self) -> dict[str, float]:
        """Seconds each request's layerwise load held the last step's compute back (the part
        of its restore that did not overlap); cleared by the call."""
        out, self._stalls = self._stalls, {}
        return out

    def finish_layerwise(self, batch: SchedulerOutput) -> list[Event]:
        """Collect this step's layerwise loads (a failed one voids its sequence's step)."""
        events: list[Event] = []
        for s in batch.scheduled:
            if s.wait_ref is not None:
                events += self.tier.wait(s.wait_ref)
        return self._pool_events(events)

    def observe_prefill(self, batch: SchedulerOutput, seconds: float) -> None:
        """Score and refine the planner's recompute estimate on steps that are mostly prefill."""
        prefill = sum(s.num_new_tokens for s in batch.scheduled if s.num_new_tokens > 1)
        if prefill >= PREFILL_OBSERVE_TOKENS and prefill >= 0.9 * batch.num_batched_tokens:
            self.manager.observe_prefill(prefill, seconds)

    @property
    def busy(self) -> bool:
        return self.tier.busy

    def drain(self) -> list[Event]:
        """Submit what was decided and wait until no job is in flight; the events seen."""
        return self._pool_events(self.tier.drain())

    def write_down(self) -> list[Event]:
        """Before a clean exit with a disk or remote tier: every cached block still only on
        device or host goes down (two hops) and the disk is synced, so the next process (or
        another one sharing the Redis) finds it."""
        if not self.manager.below_host:
            return []
        events = self.drain()
        # What only host holds goes down first: the batches below evict it.
        events += self._pool_events(self.tier.write_down_host())
        batch = max(1, self.manager.host_slots // 2)  # a host smaller than the device
        for _ in range(-(-self.pool.num_blocks // batch)):  # bounded: stores may fail
            if not self.demote_all(batch):  # demoted blocks leave the device cache
                break
            events += self.drain()
            events += self._pool_events(self.tier.write_down_host())
        return events

    def close(self) -> None:
        self.tier.close()


class NullTier:
    """No tier: every question answers "nothing below the device"."""

    enabled = False
    lossy = False
    block_bytes = 0
    below_host = False
    busy = False
    demoted_blocks = 0

    def __init__(self, policy: OffloadPolicy) -> None:
        self.policy = policy

    def match(self, request_id: str, keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], preempted: bool, compute_ahead: int = 0,
              parent: BlockKey | None = None, tail: Sequence[int] = ()) -> Match | None:
        return NO_MATCH

    def prefetch(self, request_id: str, keys: Sequence[BlockKey],
                 tokens: Sequence[Sequence[int]], tenant: str = "") -> Prefetch:
        return Prefetch()  # no tier: nothing is kept anywhere to bring up

    def allocated(self, request_id: str, match: Match, blocks: Sequence[int],
                  layerwise: bool, swap_in: bool) -> int | None:
        return None

    def outcome(self, request_id: str) -> RequestOutcome:
        return RequestOutcome()

    def finished(self, request_id: str, swap_keys: Sequence[BlockKey] = ()) -> None:
        pass

    def purge(self, keys: Sequence[BlockKey]) -> tuple[Purged, list[Event]]:
        return Purged(), []  # no tier: nothing is kept anywhere

    def purge_tenant(self, tenant: str) -> tuple[Purged, list[BlockKey], list[Event]]:
        return Purged(), [], []

    def forget(self, keys: Sequence[BlockKey]) -> None:
        pass

    def swap_worth_it(self, tokens: int, num_blocks: int, mode: str) -> bool:
        return False

    def store(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], demote: bool = False,
              evict_first: bool = False, tenant: str = "", prefix: bool = False) -> bool:
        return False

    def answer(self, request_id: str, hints: KvHints, keys: Sequence[BlockKey],
               tokens: Sequence[Sequence[int]], parts: Mapping[int, BlockKey] | None = None
               ) -> HintReply:
        return HintReply.every(hints, Grant(refused=Refusal.DISABLED))  # no tier at all

    def stage_returns(self) -> None:
        pass

    def demote_idle(self, now: float) -> None:
        pass

    def demote_all(self, limit: int | None = None) -> int:
        return 0

    def write_back(self, watermark: int) -> None:
        pass

    def submit(self) -> None:
        pass

    def reap(self) -> list[Event]:
        return []

    def wait_any(self) -> list[Event]:
        return []

    def layer_barrier(self, batch: SchedulerOutput) -> Callable[[int], None] | None:
        return None

    def finish_layerwise(self, batch: SchedulerOutput) -> list[Event]:
        return []

    def stalls(self) -> dict[str, float]:
        return {}

    def observe_prefill(self, batch: SchedulerOutput, seconds: float) -> None:
        pass

    def drain(self) -> list[Event]:
        return []

    def write_down(self) -> list[Event]:
        return []

    def close(self) -> None:
        pass
