"""Continuous batching: which sequences run this step, with how many tokens each.

Primitives: `add(seq)`, `schedule() -> SchedulerOutput`, `update(output, sampled)`, `abort(id)`.
Policy (as in vLLM V1): running sequences first, in arrival order, each taking its remaining
prompt chunk or one decode token from a shared token budget; when the pool runs dry the most
recently arrived running sequence is preempted (its blocks freed, recomputed later); waiting
sequences are admitted FCFS only in a step that preempted nobody. Bookkeeping only: no tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvtier.cache.block import BlockKey
from kvtier.cache.block_pool import BlockPool
from kvtier.cache.kv_cache import KVCacheManager
from kvtier.config import SchedulerConfig
from kvtier.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work this step: compute tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token, so a token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0


class Scheduler:
    """Owns the waiting and running queues and drives the KV cache manager."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        block_size: int,
        namespace_of: dict[str, BlockKey] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self.kv = KVCacheManager(pool, block_size)
        self.block_size = block_size
        self.max_model_len = max_model_len or config.max_model_len or pool.num_blocks * block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.namespaces: dict[str, BlockKey] = namespace_of if namespace_of is not None else {}
        self.stats = SchedulerStats()

    def add(self, seq: Sequence, namespace: BlockKey) -> None:
        self.namespaces[seq.request_id] = namespace
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.stats.num_steps += 1
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = None
            if seq.num_computed_tokens == 0:
                prefix = self.kv.find_cached_prefix(self.namespaces[seq.request_id], seq.token_ids)
            start = prefix.num_tokens if prefix else seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if not self.kv.allocate_slots(seq.request_id, start + n, prefix):
                break
            self.waiting.popleft()
            if prefix is not None:
                seq.num_computed_tokens = start
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = start
            seq.status = SequenceStatus.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = time.perf_counter()
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        table = self.kv.tables[seq.request_id]
        return ScheduledSeq(seq, seq.num_computed_tokens, n, table.block_ids)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front of the line."""
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.stats.num_preemptions += 1

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance computed counts and publish newly full blocks; append sampled tokens."""
        for s in out.scheduled:
            seq = s.seq
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
        """Release finished sequences' blocks (they stay in the prefix cache until reused)."""
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            if seq in self.running:
                self.running.remove(seq)
            self.kv.free(seq.request_id)
            self.namespaces.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish_reason = "abort"
                    self.finish([seq])
                    return seq
        return None
