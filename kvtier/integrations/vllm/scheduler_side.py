"""The connector's scheduler half, over plain values (request ids, token ids, block ids), so
its bookkeeping is testable without vLLM: vLLM's hooks become calls on a `TierManager`.

  matched_tokens(request, tokens, salt, computed)  -> tokens the host tier can restore
                                                      (None: ask again next step)
  allocated(request, block_ids, external)          -> the load job, if vLLM took the match
  step(scheduled)                                  -> the jobs of this step: loads decided
                                                      above, stores of newly full blocks
  apply(results)                                   the worker's results (slots unpinned)
  finished(request)                                -> what the caller is told
  take_stats()                                     -> counters since the last call
Only whole blocks are keyed, never a request's last partial block; vLLM's null block 0 is
never one of ours (vLLM never hands it to a request).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.tier import (
    NO_MATCH,
    BlockKey,
    Job,
    LoadDone,
    Match,
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
    restored_tokens: int = 0
    restore_s: float = 0.0
    load_failed: bool = False


class SchedulerSide:
    """Per-request keys and block ids, joined to one `TierManager`."""

    def __init__(self, manager: TierManager, block_size: int,
                 namespace: Callable[[str], BlockKey]) -> None:
        self.manager = manager
        self.block_size = block_size
        self.namespace = namespace  # salt (cache_salt, LoRA) -> the chain's seed
        self.requests: dict[str, _Request] = {}
        self._counts: Counter[str] = Counter()  # since the last take_stats
        self._restoring: dict[int, int] = {}  # load job -> tokens it restores
        self._reported = asdict(manager.stats)

    def matched_tokens(self, request_id: str, tokens: Sequence[int], salt: str,
                       num_computed: int) -> int | None:
        """Tokens after vLLM's own `num_computed` that kvtier's host tier can restore."""
        st = self._state(request_id, tokens, salt)
        bs = self.block_size
        d = num_computed // bs
        last = (len(tokens) - 1) // bs  # at least one token is always computed
        if last <= d:
            st.match, st.local_blocks = NO_MATCH, d
            return 0
        keys = self._keys(st, last)
        chunks = [tokens[i * bs:(i + 1) * bs] for i in range(d, last)]
        match = self.manager.match(request_id, keys[d:last], chunks)
        if match is None:
            return None
        st.match, st.local_blocks = match, d
        self._counts["lookup_tokens"] += (last - d) * bs
        self._counts["declined_tokens"] += match.declined_tokens
        return match.restored_tokens if match.load_keys else 0

    def allocated(self, request_id: str, block_ids: Sequence[int], external: int) -> int | None:
        """vLLM allocated `block_ids`; `external` of its tokens are ours to load."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        match = st.match if external else NO_MATCH
        n = len(match.load_keys)
        d = st.local_blocks
        if external and external != match.restored_tokens:
            match, n = NO_MATCH, 0  # vLLM took less than offered: load nothing, recompute
        job = self.manager.allocated(request_id, match, list(block_ids[d:d + n]))
        if job is not None:
            self._restoring[job] = match.restored_tokens
        st.stored = max(st.stored, d + n)
        st.restored_tokens += match.restored_tokens if n else 0
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

    def apply(self, results: Sequence[Result]) -> None:
        for event in self.manager.apply(results):
            if isinstance(event, LoadDone):
                tokens = self._restoring.pop(event.job_id, 0)
                if event.success:
                    self._counts["restored_tokens"] += tokens
                    self._counts["restore_seconds"] += event.seconds
                st = self.requests.get(event.request_id)
                if st is not None:
                    st.restore_s += event.seconds
                    st.load_failed = st.load_failed or not event.success

    def take_stats(self) -> dict[str, float]:
        """What happened since the last call (vLLM sums the reports)."""
        now = asdict(self.manager.stats)
        delta = {key: now[key] - self._reported[key] for key in now}
        self._reported = now
        counts, self._counts = self._counts, Counter()
        out = {**counts, "restore_bytes": delta["loaded_bytes"],
               "failed_loads": delta["failed_loads"], "stored_blocks": delta["stored_blocks"],
               "stored_bytes": delta["stored_bytes"], "failed_stores": delta["failed_stores"],
               "store_refused": delta["store_refused"]}
        return {key: value for key, value in out.items() if value}

    def finished(self, request_id: str) -> dict[str, Any]:
        """Forget the request; what kvtier did for it (vLLM's kv_transfer_params)."""
        self.manager.finished(request_id)
        st = self.requests.pop(request_id, None)
        if st is None:
            return {}
        restored = 0 if st.load_failed else st.restored_tokens
        return {"kvtier_residency": "host" if restored else "none",
                "kvtier_restored_tokens": restored,
                "kvtier_restore_s": round(st.restore_s, 6)}

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
