"""Continuous batching: which sequences run this step, with how many tokens each.

Primitives: `add(seq)`, `schedule() -> SchedulerOutput`, `update(output, sampled)`,
`finish(seqs)`, `abort(id)`, `apply(events)` (the tier's LoadDone / FetchDone).
Policy (as in vLLM V1): running sequences first, in arrival order, each taking its remaining
prompt chunk or one decode token from a shared token budget; when the pool runs dry the most
recently arrived running sequence is preempted; waiting sequences are admitted FCFS only in
a step that preempted nobody. With a tier (`TierClient`; `NullTier` when off), admission
continues the prefix lookup past the device into host memory (and below) and restores what
the planner says is cheaper to load than to recompute; a preempted sequence is swapped out
whole (partial last block included) when restoring it beats recomputing it; finished
prefixes are written down. Bookkeeping only: no tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.block_pool import BlockPool
from kvtier.cache.kv_cache import KVCacheManager
from kvtier.config import LoadMode, SchedulerConfig, WritePolicy
from kvtier.engine.admission import AdmissionPlan, plan_admission
from kvtier.engine.batch import ScheduledSeq, SchedulerOutput
from kvtier.sequence import Phase, Sequence, SequenceStatus, SwapState
from kvtier.tier import BlockKey, Event, FetchDone, LoadDone, Residency, hash_block, swap_key

if TYPE_CHECKING:  # the tier client imports this module's ScheduledSeq
    from kvtier.engine.engine_tier import EngineTier


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swaps: int = 0  # preemptions whose KV went to host
    num_recompute_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    """Owns the waiting and running queues and drives the KV cache manager and the tier."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        tier: EngineTier,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(pool, block_size)
        self.block_size = block_size
        self.max_model_len = max_model_len or config.max_model_len or pool.num_blocks * block_size
        self.tier = tier
        self.policy = tier.policy  # how this engine uses the tier
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}  # request id -> sequence whose load is in flight
        self.fetching: dict[str, Sequence] = {}  # request id -> sequence waiting on a fetch
        self._restore_plan: dict[str, AdmissionPlan] = {}
        self.namespaces: dict[str, BlockKey] = {}
        self.stats = SchedulerStats()

    def add(self, seq: Sequence, namespace: BlockKey) -> None:
        self.namespaces[seq.request_id] = namespace
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.fetching)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.stats.num_steps += 1
        self.tier.demote_idle(time.monotonic())
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.loading is not None:  # its blocks are still arriving (async load)
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, seq.num_computed_tokens + n, out):
                break
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        self.tier.write_back(self.config.max_num_batched_tokens // self.block_size + 1)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate `seq`'s slots, preempting from the back; False if `seq` cannot run now."""
        while not self.kv.allocate_slots(seq.request_id, num_tokens):
            victims = [s for s in self.running if s.loading is None]
            victim = victims[-1]  # `seq` itself is always a candidate
            self.running.remove(victim)
            swapped = self._preempt(victim, out)
            if victim is seq or swapped:
                # A swapped victim's blocks come free when its store completes: next step.
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            ahead = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                        for r in self.running)
            plan = plan_admission(seq, self.kv, self.namespaces[seq.request_id], self.tier,
                                  self.block_size, ahead)
            if plan is None:  # a deeper tier's answer is on its way: ask again next step
                seq.timings.enter(Phase.TIER, time.perf_counter())
                break
            if plan.match.fetching:
                self._fetching(seq)
                continue
            layerwise = self.policy.load_mode is LoadMode.LAYERWISE
            waits = bool(plan.load_keys) and not layerwise
            n = 0 if waits else min(seq.num_tokens - plan.start, budget)
            now = time.perf_counter()
            if not self.kv.allocate_slots(seq.request_id, plan.start + n, plan.prefix,
                                          contiguous=bool(plan.load_keys)):
                seq.timings.enter(Phase.QUEUE, now)  # waits for device blocks
                break
            self.waiting.popleft()
            self._apply(seq, plan, layerwise)
            seq.status = SequenceStatus.RUNNING
            t = seq.timings
            if t.first_scheduled is None:
                t.first_scheduled = now
            t.state_tokens = max(t.state_tokens, plan.start + plan.declined_tokens)
            rebuilding = waits or t.state_tokens > seq.num_computed_tokens
            t.enter(Phase.TIER if rebuilding else Phase.COMPUTE, now)
            self.running.append(seq)
            if n:
                out.scheduled.append(self._scheduled(seq, n))
                budget -= n

    def _apply(self, seq: Sequence, plan: AdmissionPlan, layerwise: bool) -> None:
        """Record the plan on the sequence and its table; start its load if there is one."""
        first = seq.timings.first_token is None and seq.num_preemptions == 0
        if first:
            seq.num_cached_tokens = plan.prefix.num_tokens
            seq.residency = plan.residency
        seq.num_computed_tokens = plan.start
        seq.num_recomputed_tokens += plan.declined_tokens
        table = self.kv.tables[seq.request_id]
        d = len(plan.prefix.block_ids)
        blocks = table.block_ids[d : d + len(plan.load_keys)]
        # After a preemption, what comes back is its own state: a swap-in, not a restore.
        job = self.tier.allocated(seq.request_id, plan.match, blocks, layerwise,
                                  swap_in=seq.num_preemptions > 0)
        if job is not None:
            self._start_load(seq, plan, job)
        if plan.swap_state_done and seq.swapped is not None:
            self.tier.forget(seq.swapped.keys)  # pinned (loading) keys are kept
            seq.swapped = None

    def _start_load(self, seq: Sequence, plan: AdmissionPlan, job: int) -> None:
        table = self.kv.tables[seq.request_id]
        table.keys.extend(plan.content_keys)
        seq.loading = job
        self._outcome(seq)
        self.loading[seq.request_id] = seq
        self._restore_plan[seq.request_id] = plan

    def _fetching(self, seq: Sequence) -> None:
        """The tier is bringing `seq`'s prefix up from below host: it waits out of the queue
        meanwhile and is planned again (as a host wake) when the fetch lands."""
        self.waiting.popleft()
        self.fetching[seq.request_id] = seq
        seq.timings.enter(Phase.TIER, time.perf_counter())

    def _outcome(self, seq: Sequence) -> None:
        """What the tier says it restored for `seq` (its own count: swap-ins apart, a failed
        load taken off), as the sequence's output reports it."""
        o = self.tier.outcome(seq.request_id)
        seq.num_restored_tokens, seq.num_swapped_in_tokens = o.restored_tokens, o.swapped_in_tokens
        seq.restore_bytes, seq.restore_s, seq.lossy = o.nbytes, o.seconds, o.lossy

    def apply(self, events: Seq[Event]) -> set[str]:
        """The tier's finished loads and fetches; returns the request ids whose load failed
        (a layerwise step that read it must be discarded)."""
        failed: set[str] = set()
        for event in events:
            if isinstance(event, LoadDone):
                if not self._load_done(event):
                    failed.add(event.request_id)
            elif isinstance(event, FetchDone):
                self._fetch_done(event)
        return failed

    def _fetch_done(self, done: FetchDone) -> None:
        """A fetch landed (or failed): the request goes back to the head of the queue, its
        fetched blocks held on host until it is admitted."""
        seq = self.fetching.pop(done.request_id, None)
        if seq is None:  # aborted meanwhile: the fetched blocks just stay cached on host
            self.tier.finished(done.request_id)
            return
        self.waiting.appendleft(seq)
        seq.timings.enter(Phase.QUEUE, time.perf_counter())

    def _load_done(self, done: LoadDone) -> bool:
        """Apply a finished load; returns False if it failed (the tokens will be recomputed)."""
        seq = self.loading.pop(done.request_id)
        plan = self._restore_plan.pop(done.request_id)
        seq.loading = None
        table = self.kv.tables.get(seq.request_id)
        d = len(plan.prefix.block_ids)
        if table is None or seq.is_finished:  # aborted while loading: release now
            self.tier.finished(seq.request_id)
            self.kv.free(seq.request_id)
            self.namespaces.pop(seq.request_id, None)
            return done.success
        self._outcome(seq)
        t = seq.timings
        if not done.success:  # what the load was to bring back is computed again: tier time
            t.state_tokens = max(t.state_tokens, plan.start)
        rebuilding = t.state_tokens > (plan.start if done.success else plan.prefix.num_tokens)
        now = time.perf_counter()
        if 0 < done.finished_at <= now:  # landed mid-step: it waited for the engine since
            t.enter(Phase.QUEUE, done.finished_at)
        t.enter(Phase.TIER if rebuilding else Phase.COMPUTE, now)
        if done.success:
            return True
        # A failed load is a miss, never a load: recompute from the end of the device prefix.
        del table.keys[d:]
        table.num_registered = min(table.num_registered, d)
        seq.num_computed_tokens = plan.prefix.num_tokens
        seq.num_recomputed_tokens += plan.restored_tokens
        if seq.residency.restored and seq.num_restored_tokens == 0:
            seq.residency = Residency.RECOMPUTED
        return False

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        table = self.kv.tables[seq.request_id]
        wait = seq.loading if seq.loading is not None else None
        return ScheduledSeq(seq, seq.num_computed_tokens, n, table.block_ids, wait)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Free a running sequence's blocks; swap its KV to host first when that is cheaper
        than recomputing it. Returns whether it was swapped."""
        swapped = self._swap_out(seq)
        self.kv.free(seq.request_id)
        t = seq.timings
        if swapped:
            self.stats.num_swaps += 1
        else:
            seq.num_recomputed_tokens += seq.num_computed_tokens
            t.state_tokens = max(t.state_tokens, seq.num_computed_tokens)
            self.stats.num_recompute_preemptions += 1
        t.enter(Phase.QUEUE, time.perf_counter())
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.stats.num_preemptions += 1
        return swapped

    def _swap_out(self, seq: Sequence) -> bool:
        computed = seq.num_computed_tokens
        if not self.tier.enabled or computed == 0:
            return False
        cap = self.policy.max_offload_tokens
        if cap is not None and computed > cap:
            return False
        bs = self.block_size
        table = self.kv.tables[seq.request_id]
        nfull, nblocks = computed // bs, -(-computed // bs)
        if not self.tier.swap_worth_it(computed, nblocks, self.policy.preemption_mode):
            return False
        keys = list(table.keys[:nfull])
        tokens = [seq.tokens(i * bs, (i + 1) * bs) for i in range(nfull)]
        if computed % bs:
            keys.append(swap_key(seq.request_id, nfull))
            tokens.append(seq.tokens(nfull * bs, computed))
        if len(keys) != nblocks or not self.tier.store(table.block_ids[:nblocks], keys, tokens,
                                                       prefix=True):
            return False
        seq.swapped = SwapState(keys, tokens, computed)
        return True

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        void: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Advance computed counts and publish newly full blocks; append sampled tokens.
        Sequences in `void` (their layerwise load failed) keep nothing from this step."""
        for s in out.scheduled:
            seq = s.seq
            if seq.request_id in void:
                continue
            seq.num_computed_tokens = s.start + s.num_new_tokens
            token = sampled.get(seq.request_id)
            if token is not None:
                seq.output_token_ids.append(token)
            self.kv.register_full_blocks(
                seq.request_id,
                self.namespaces[seq.request_id],
                seq.token_ids,
                seq.num_computed_tokens,
            )

    def finish(self, seqs: Seq[Sequence]) -> None:
        """Release finished sequences' blocks (they stay in the prefix cache until reused),
        writing their full blocks down to host first under `write_through`."""
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            if seq in self.running:
                self.running.remove(seq)
            if seq.request_id in self.loading:
                continue  # its blocks are being written: released when the load lands
            # what it published in the prefix cache beyond what it read: usage's writes
            published = self.kv.published_tokens(seq.request_id, len(seq.prompt_token_ids))
            self._write_through(seq)
            published = max(published, *seq.exact_breakpoints, 0)
            seq.num_cache_write_tokens = max(0, published - seq.num_cached_tokens
                                             - seq.num_restored_tokens)
            self.tier.finished(seq.request_id, seq.swapped.keys if seq.swapped else ())
            self.kv.free(seq.request_id)
            self.namespaces.pop(seq.request_id, None)

    def _write_through(self, seq: Sequence) -> None:
        """Under `write_through`, or for a request that asked for retention, its full blocks
        go down to host (its tenant's), and what its hints ask is asked of them."""
        table = self.kv.tables.get(seq.request_id)
        hints = seq.hints
        if table is None:
            return
        bs = self.block_size
        full = min(len(table.keys), seq.num_computed_tokens // bs)
        cap = self.policy.max_offload_tokens
        if cap is not None:
            full = min(full, cap // bs)
        keys = table.keys[:full]
        tokens = [seq.tokens(i * bs, (i + 1) * bs) for i in range(full)]
        if self.policy.kv_write_policy is WritePolicy.WRITE_THROUGH or hints.stores:
            self.tier.store(table.block_ids[:full], keys, tokens, tenant=hints.tenant,
                            prefix=True)
        parts = self._store_parts(seq, keys)
        seq.exact_breakpoints = tuple(sorted(parts))
        seq.hint_reply = self.tier.answer(seq.request_id, hints, keys, tokens, parts)

    def _store_parts(self, seq: Sequence, keys: Seq[BlockKey]) -> dict[int, BlockKey]:
        """Each cache breakpoint inside a block keeps the tokens before it: that block goes
        down to host under the key of its leading part (what a later request loads into a
        block of its own, so its match ends exactly there). Returns breakpoint -> key, for
        the parts the host took."""
        table = self.kv.tables[seq.request_id]
        bs = self.block_size
        parts: dict[int, BlockKey] = {}
        for end in sorted({p.tokens for p in seq.hints.prefixes if p.tokens % bs}):
            index = end // bs
            if end > seq.num_computed_tokens or index > len(keys) or \
                    index >= len(table.block_ids):
                continue  # not computed, or its full blocks were not all handed down
            parent = keys[index - 1] if index else self.namespaces[seq.request_id]
            part = seq.tokens(index * bs, end)
            key = hash_block(parent, part)
            if self.tier.store([table.block_ids[index]], [key], [part],
                               tenant=seq.hints.tenant):
                parts[end] = key
        return parts

    def abort(self, request_id: str) -> Sequence | None:
        fetching = self.fetching.pop(request_id, None)
        if fetching is not None:  # its fetch lands later; the tier forgets it then
            fetching.finish_reason = "abort"
            fetching.status = SequenceStatus.FINISHED
            self.namespaces.pop(request_id, None)
            return fetching
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish_reason = "abort"
                    self.finish([seq])
                    return seq
        return None
