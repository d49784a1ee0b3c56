"""The connector's scheduler half, over plain values (request ids, token ids, block ids), so
its bookkeeping is testable without vLLM: vLLM's hooks become calls on a `TierManager`.

  matched_tokens(request, tokens, salt, computed)  -> tokens kvtier can restore (None: ask
                                                      again next step: a Redis presence
                                                      answer or a fetch to host is pending)
  allocated(request, block_ids, external)          -> the load job, if vLLM took the match
  step(scheduled)                                  -> the jobs of this step: loads decided
                                                      above, stores of newly full blocks
  apply(results)                                   the worker's results (slots unpinned)
  finished(request)                                -> what the caller is told
  take_stats()                                     -> counters since the last call
  busy                                             jobs decided or running (vLLM keeps
                                                   stepping until the writes below host land)
A prefix below host (disk, Redis) is fetched into host slots and verified before any token
is promised to vLLM, so a corrupt or vanished block is a miss, never a load error.
Only whole blocks are keyed, never a request's last partial block; vLLM's null block 0 is
never one of ours (vLLM never hands it to a request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tier import (
    NO_MATCH,
    BlockKey,
    Job,
    LoadDone,
    Match,
    Residency,
    Result,
    TierManager,
    hash_blocks,
)


@dataclass(frozen=True)
class Scheduled:
    """One request in this step: its blocks so far and tokens computed once it has run."""

    request_id: str
    block_ids: Sequence[int]
    computed_after: int


@dataclass
class _Request:
    tokens: Sequence[int]  # the live token ids (prompt and output so far)
    namespace: BlockKey
    keys: list[BlockKey] = field(default_factory=list)
    stored: int = 0  # leading full blocks handed to the tier (stored, or loaded from it)
    match: Match = NO_MATCH
    local_blocks: int = 0  # vLLM's own prefix hit when `match` was made
    looked_up: int = 0  # tokens after vLLM's own prefix hit that the last lookup asked for
    counted: bool = False  # its lookup is in the counters (once, however often vLLM asks)


class SchedulerSide:
    """Per-request keys and block ids, joined to one `TierManager`."""

    def __init__(self, manager: TierManager, block_size: int,
                 namespace: Callable[[str], BlockKey], world_size: int = 1) -> None:
        self.manager = manager
        self.block_size = block_size
        self.namespace = namespace  # salt (cache_salt, LoRA) -> the chain's seed
        # tensor-parallel ranks: the tier reckons in one rank's slice of a block, vLLM's
        # metrics in bytes moved by all ranks
        self.world_size = world_size
        self.requests: dict[str, _Request] = {}
        self._counts: Counter[str] = Counter()  # since the last take_stats
        self._restoring: dict[int, int] = {}  # load job -> tokens it restores
        self._reported: dict[str, float] = {}  # what the tier knew at start is news too

    def matched_tokens(self, request_id: str, tokens: Sequence[int], salt: str,
                       num_computed: int) -> int | None:
        """Tokens after vLLM's own `num_computed` that kvtier can restore from host."""
        st = self._state(request_id, tokens, salt)
        bs = self.block_size
        d = num_computed // bs
        last = (len(tokens) - 1) // bs  # at least one token is always computed
        if last <= d:
            st.match, st.local_blocks, st.looked_up = NO_MATCH, d, 0
            return 0
        keys = self._keys(st, last)
        chunks = [tokens[i * bs:(i + 1) * bs] for i in range(d, last)]
        match = self.manager.match(request_id, keys[d:last], chunks)
        if match is None or match.fetching:  # a presence answer or a fetch is on its way
            return None
        st.match, st.local_blocks, st.looked_up = match, d, (last - d) * bs
        return match.restored_tokens if match.load_keys else 0

    def allocated(self, request_id: str, block_ids: Sequence[int], external: int) -> int | None:
        """vLLM allocated `block_ids`; `external` of its tokens are ours to load."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        if not st.counted:  # the lookup vLLM acted on: retries while it waited do not count
            st.counted = True
            self._counts["lookup_tokens"] += st.looked_up
            self._counts["declined_tokens"] += st.match.declined_tokens
        match = st.match if external else NO_MATCH
        n = len(match.load_keys)
        d = st.local_blocks
        if external and external != match.restored_tokens:
            match, n = NO_MATCH, 0  # vLLM took less than offered: load nothing, recompute
        job = self.manager.allocated(request_id, match, list(block_ids[d:d + n]))
        if job is not None:
            self._restoring[job] = match.restored_tokens
        st.stored = max(st.stored, d + n)
        st.match = NO_MATCH
        return job

    def step(self, scheduled: Sequence[Scheduled]) -> list[Job]:
        """Stores for every block that is full once this step has run (the worker copies
        them after the forward pass, before vLLM can reuse them), and all decided jobs."""
        bs = self.block_size
        for s in scheduled:
            st = self.requests.get(s.request_id)
            if st is None:
                continue
            full = min(s.computed_after, len(st.tokens), len(s.block_ids) * bs) // bs
            if full <= st.stored:
                continue
            keys = self._keys(st, full)
            lo = st.stored
            chunks = [st.tokens[i * bs:(i + 1) * bs] for i in range(lo, full)]
            self.manager.store(list(s.block_ids[lo:full]), keys[lo:full], chunks)
            st.stored = full  # a store the host refused is not retried: it is a future miss
        return self.manager.take_jobs()

    @property
    def busy(self) -> bool:
        return self.manager.busy

    def apply(self, results: Sequence[Result]) -> None:
        for event in self.manager.apply(results):
            if isinstance(event, LoadDone):
                tokens = self._restoring.pop(event.job_id, 0)
                if event.success:
                    self._counts["restored_tokens"] += tokens
                    self._counts["restore_seconds"] += event.seconds

    def take_stats(self) -> dict[str, float]:
        """What happened since the last call (vLLM sums the reports). Keys with a tier (and a
        reason) carry them after '|': `fetched_blocks|disk`, `miss_blocks|disk|checksum`."""
        now = self._totals()
        delta = {key: value - self._reported.get(key, 0) for key, value in now.items()}
        self._reported = now
        counts, self._counts = self._counts, Counter()
        return {key: value for key, value in {**counts, **delta}.items() if value}

    def _totals(self) -> dict[str, float]:
        """The tier's monotonic counters (its report), by the names vLLM's metrics carry."""
        report = self.manager.report()
        s = report.transfers
        out: dict[str, float] = {
            "restore_bytes": s.loaded_bytes, "failed_loads": s.failed_loads,
            "stored_blocks": s.stored_blocks, "stored_bytes": s.stored_bytes,
            "failed_stores": s.failed_stores, "store_refused": s.store_refused}
        b = report.below
        if b is not None:
            for name, counter in (("written_blocks", b.written_blocks),
                                  ("written_bytes", b.written_bytes),
                                  ("write_failures", b.write_failures),
                                  ("fetched_blocks", b.fetched_blocks),
                                  ("fetched_bytes", b.fetched_bytes)):
                out.update({f"{name}|{tier}": n for tier, n in counter.items()})
            for label, n in b.misses.items():  # "tier:reason"
                tier, _, reason = label.partition(":")
                out[f"miss_blocks|{tier}|{reason}"] = n
        return {key: value * self.world_size if key.partition("|")[0].endswith("_bytes")
                else value for key, value in out.items()}

    def finished(self, request_id: str) -> dict[str, Any]:
        """Forget the request; what kvtier did for it (vLLM's kv_transfer_params), as the
        tier's own outcome for it says."""
        outcome = self.manager.outcome(request_id)
        self.manager.finished(request_id)
        if self.requests.pop(request_id, None) is None:
            return {}
        restored = 0 if outcome.failed else outcome.restored_tokens
        # "none": kvtier restored nothing (vLLM's own prefix cache or its compute served it)
        residency = (Residency.from_medium(outcome.source).value
                     if restored and outcome.source else "none")
        return {"kvtier_residency": residency,
                "kvtier_restored_tokens": restored,
                "kvtier_restore_s": round(outcome.seconds, 6)}

    def _state(self, request_id: str, tokens: Sequence[int], salt: str) -> _Request:
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = _Request(tokens, self.namespace(salt))
        return st

    def _keys(self, st: _Request, full: int) -> list[BlockKey]:
        """The chain over the first `full` blocks (extended, never recomputed)."""
        have = len(st.keys)
        if full > have:
            parent = st.keys[-1] if st.keys else None
            st.keys += hash_blocks(st.namespace, st.tokens[:full * self.block_size],
                                   self.block_size, start=have, parent=parent)
        return st.keys
