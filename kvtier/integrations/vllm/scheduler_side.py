"""The connector's scheduler half, over plain values (request ids, token ids, block ids), so
its bookkeeping is testable without vLLM: vLLM's hooks become calls on a `TierManager`.

  matched_tokens(request, tokens, salt, computed, prompt_len)
                                                   -> tokens kvtier can restore (None: ask
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
never stored or loaded.

A sliding-window group (`Window`) keeps only the blocks the next token still reads: kvtier
stores, per request, the window before the prompt's own hit boundary (so stored blocks per
request are bounded by the window, not the prompt), and a hit of n blocks loads only
`[first_needed(n), n)`: vLLM hands the request its null block before that. Should vLLM's
allocation ever disagree with that rule, the request's blocks are reported as load errors
(`take_invalid`), so vLLM recomputes them: never a block read that was not loaded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.groups import Window
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
    prompt_len: int = 0  # a window group stores the window before the prompt's hit boundary
    first: int = 0  # the first block `match` loads (a window group's hit skips the rest)
    offered: int = 0  # tokens `match` let vLLM skip computing (from its own hit on)


class SchedulerSide:
    """Per-request keys and block ids, joined to one `TierManager`."""

    def __init__(self, manager: TierManager, block_size: int,
                 namespace: Callable[[str], BlockKey], world_size: int = 1,
                 window: Window | None = None) -> None:
        self.manager = manager
        self.block_size = block_size
        self.namespace = namespace  # salt (cache_salt, LoRA) -> the chain's seed
        # tensor-parallel ranks: the tier reckons in one rank's slice of a block, vLLM's
        # metrics in bytes moved by all ranks
        self.world_size = world_size
        self.window = window  # a sliding-window group (None: every block is kept)
        self._invalid: set[int] = set()  # device blocks vLLM must recompute (take_invalid)
        self.requests: dict[str, _Request] = {}
        self._counts: Counter[str] = Counter()  # since the last take_stats
        self._restoring: dict[int, int] = {}  # load job -> tokens it restores
        self._reported: dict[str, float] = {}  # what the tier knew at start is news too

    def matched_tokens(self, request_id: str, tokens: Sequence[int], salt: str,
                       num_computed: int, prompt_len: int | None = None) -> int | None:
        """Tokens after vLLM's own `num_computed` that kvtier can restore from host."""
        st = self._state(request_id, tokens, salt, prompt_len)
        bs = self.block_size
        d = num_computed // bs
        last = (len(tokens) - 1) // bs  # at least one token is always computed
        st.match, st.local_blocks, st.looked_up, st.offered = NO_MATCH, d, 0, 0
        if last <= d:
            return 0
        keys = self._keys(st, last)
        end = last if self.window is None else self._window_end(st, keys, d, last)
        first = d if self.window is None else max(d, self.window.first_needed(end))
        chunks = [tokens[i * bs:(i + 1) * bs] for i in range(first, end)]
        match = self.manager.match(request_id, keys[first:end], chunks)
        if match is None or match.fetching:  # a presence answer or a fetch is on its way
            return None
        st.looked_up, st.first = (last - d) * bs, first
        if not match.load_keys:
            st.match = match
            return 0
        if self.window is not None and len(match.load_keys) < end - first:
            # a window needs all of its blocks: part of it is recomputing all of it
            st.match = Match(declined_tokens=match.restored_tokens + match.declined_tokens)
            return 0  # a fetch's pins are released when vLLM admits the request
        st.match = match
        st.offered = (first - d) * bs + match.restored_tokens
        return st.offered

    def _window_end(self, st: _Request, keys: list[BlockKey], d: int, last: int) -> int:
        """The longest hit whose window the host holds whole (probed without side effects);
        `last` when none does: the lookup then asks the tiers below host for that window."""
        assert self.window is not None
        bs = self.block_size
        for end in range(last, d, -1):
            first = max(d, self.window.first_needed(end))
            chunks = [st.tokens[i * bs:(i + 1) * bs] for i in range(first, end)]
            if self.manager.host_hits(keys[first:end], chunks) == end - first:
                return end
        return last

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
        d, first = st.local_blocks, st.first
        if external and external != st.offered:
            match, n = NO_MATCH, 0  # vLLM took less than offered: load nothing, recompute
        targets = list(block_ids[first:first + n])
        if n and (0 in targets or any(block_ids[d:first])):
            # vLLM's nulls are not where the window rule puts them: load nothing, and have
            # vLLM recompute every block it thinks restored
            self._invalid.update(b for b in block_ids[d:first + n] if b)
            match, n, targets = NO_MATCH, 0, []
        job = self.manager.allocated(request_id, match, targets)
        if job is not None:
            self._restoring[job] = match.restored_tokens
        st.stored = max(st.stored, first + n)
        st.match, st.offered = NO_MATCH, 0
        return job

    def take_invalid(self) -> set[int]:
        """Device blocks vLLM believes restored but kvtier did not load (see module doc)."""
        invalid, self._invalid = self._invalid, set()
        return invalid

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
            kept = [i for i in range(st.stored, full) if s.block_ids[i] and self._kept(st, i)]
            if kept:
                self.manager.store([s.block_ids[i] for i in kept], [keys[i] for i in kept],
                                   [st.tokens[i * bs:(i + 1) * bs] for i in kept])
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

    def _kept(self, st: _Request, i: int) -> bool:
        """Whether block `i` is worth storing: every block of full attention; of a window,
        those a re-sent prompt's hit reads (the window before its hit boundary)."""
        if self.window is None:
            return True
        end = (st.prompt_len - 1) // self.block_size
        return self.window.first_needed(end) <= i < end

    def _state(self, request_id: str, tokens: Sequence[int], salt: str,
               prompt_len: int | None = None) -> _Request:
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = _Request(
                tokens, self.namespace(salt),
                prompt_len=len(tokens) if prompt_len is None else prompt_len)
        return st

    def _keys(self, st: _Request, full: int) -> list[BlockKey]:
        """The chain over the first `full` blocks (extended, never recomputed)."""
        have = len(st.keys)
        if full > have:
            parent = st.keys[-1] if st.keys else None
            st.keys += hash_blocks(st.namespace, st.tokens[:full * self.block_size],
                                   self.block_size, start=have, parent=parent)
        return st.keys
