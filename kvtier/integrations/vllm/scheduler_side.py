"""The connector's scheduler half, over plain values (request ids, token ids, block ids), so
its bookkeeping is testable without vLLM: vLLM's hooks become calls on a `TierManager`.

  matched_tokens(request, tokens, salt, computed, prompt_len, handoff)
                                                   -> tokens kvtier can restore (None: ask
                                                      again next step: a Redis presence
                                                      answer or a fetch to host is pending,
                                                      or another engine's handoff not there)
  loads_async(request)                             -> whether that match's load runs beside
                                                      the others' steps (`async_loading.py`)
  allocated(request, block_ids, external)          -> the load job, if vLLM took the match
  take_async() -> [(job, request)], take_received() -> [request]
                                                   the loads vLLM waits on apart, and the
                                                   requests it waits on with nothing to load
  step(scheduled)                                  -> the jobs of this step: loads decided
                                                      above, stores of newly full blocks
  apply(results)                                   the worker's results (slots unpinned)
  answer(request, asks)                            -> its asks (retention, expect-return:
                                                      `kv_hints.py`) answered;
  handed_tokens(request)                           -> its leading tokens stored (what it
                                                      hands off: `handoff.py`); then:
  finished(request)                                -> what the caller is told
  take_stats()                                     -> counters since the last call
  reset()                                          vLLM forgot its cache (new weights?):
                                                   host blocks dropped, live requests stale
  busy                                             jobs decided or running (vLLM keeps
                                                   stepping until the writes below host land)
A prefix below host (disk, Redis) is fetched into host slots and verified before any token
is promised to vLLM, so a corrupt or vanished block is a miss, never a load error.
Only whole blocks are keyed, never a request's last partial block; vLLM's null block 0 is
never stored or loaded.

Several KV cache groups (vLLM's hybrid allocator: full-attention and sliding-window layers
in groups of their own, each with its own block table over one shared pool) share one token
chain; each group's blocks are keyed apart (`group_key`), since each holds other layers' bytes.
A full-attention group needs every block of a hit; a sliding-window group (`Window`) only those
the next token still reads, `[first_needed(n), n)` of a hit of n blocks, vLLM's null block
before them. Per request kvtier stores a window group's window before the prompt's own hit
boundary, and at the request's end the window before its final boundary (`finish_windows`:
vLLM holds those blocks until the next step has copied them): bounded by the window, not the
prompt. It offers the longest hit every group can serve whole. An allocation that disagrees
with that rule has its blocks reported as load errors (`take_invalid`): vLLM recomputes them.
Each request's wake is timed mark by mark (`wake_timeline.py`, in its kv_transfer_params).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.integrations.kit.async_loading import AsyncLoading, StepPeriod, loads_async
from kvtier.integrations.kit.counters import Count, Reported, nest, tier_counters
from kvtier.integrations.kit.events import UNPUBLISHED, BlockRecorder
from kvtier.integrations.kit.groups import Window, where_expected
from kvtier.integrations.kit.kv_hints import HintAnswers
from kvtier.integrations.kit.request_state import RequestState, Scheduled, group_key
from kvtier.integrations.kit.wake_timeline import WakeTimeline
from kvtier.tier import (
    CACHE_RESETS,
    DECLINED_TOKENS,
    LOOKUP_TOKENS,
    LOSSY_RESTORED_TOKENS,
    NO_MATCH,
    RESET_DROPPED_HOST_BLOCKS,
    RESTORE_SECONDS,
    RESTORED_BLOCKS,
    RESTORED_TOKENS,
    BlockKey,
    Decline,
    FetchDone,
    Handoff,
    Job,
    LoadDone,
    Match,
    Residency,
    Result,
    TierManager,
    declines,
    hash_blocks,
)


class SchedulerSide:
    """Per-request keys and block ids, joined to one `TierManager`."""

    def __init__(self, manager: TierManager, block_size: int,
                 namespace: Callable[[str], BlockKey], world_size: int = 1,
                 windows: Sequence[Window | None] = (None,),
                 recorder: BlockRecorder = UNPUBLISHED,
                 async_loading: AsyncLoading = AsyncLoading.AUTO,
                 loads: bool = True, stores: bool = True) -> None:
        """`recorder`: told which blocks go to the tier (vLLM's KV events, `events.py`);
        `async_loading`: which loads run beside the others' steps; `loads`, `stores`: what
        vLLM's kv_role lets this engine do (a producer never loads, a consumer never
        stores)."""
        self.manager = manager
        self.loads, self.stores = loads, stores
        self.recorder = recorder
        self.block_size = block_size
        self.namespace = namespace  # salt (cache_salt, LoRA) -> the chain's seed
        # tensor-parallel ranks: the tier reckons in one rank's slice of a block, vLLM's
        # metrics in bytes moved by all ranks
        self.world_size = world_size
        self.windows = tuple(windows)  # per KV cache group: its window (None: every block)
        self.tags = [b"" if len(windows) == 1 else f"group={g}".encode()
                     for g in range(len(windows))]
        self._invalid: set[int] = set()  # device blocks vLLM must recompute (take_invalid)
        self._sending: list[str] = []  # finished requests whose blocks vLLM holds for us
        self.requests: dict[str, RequestState] = {}
        self._counts: Counter[Count] = Counter()  # since the last take_stats
        # load job -> its request, the tokens it spares vLLM, its blocks per group
        self._restoring: dict[int, tuple[str, int, Counter[int]]] = {}
        self.async_loading = async_loading
        self.period = StepPeriod()
        self._async: list[tuple[int, str]] = []  # this step's loads vLLM waits on apart
        self._received: list[str] = []  # requests vLLM waits on that have nothing to load
        self._reported = Reported()  # what the tier knew at start is news too
        self.hints = HintAnswers(manager)  # retention and expect-return asks

    def matched_tokens(self, request_id: str, tokens: Sequence[int], salt: str,
                       num_computed: int, prompt_len: int | None = None,
                       tenant: str = "", handoff: Handoff | None = None) -> int | None:
        """Tokens after vLLM's own `num_computed` kvtier can restore; it stores as `tenant`.
        `handoff`: another engine prefilled the prompt and writes its blocks to a shared
        store (P/D): waited for, bounded (None until they are there or the wait ends)."""
        st = self._state(request_id, tokens, salt, prompt_len)
        st.tenant = tenant
        bs = self.block_size
        d = num_computed // bs
        last = (len(tokens) - 1) // bs  # at least one token is always computed
        st.match, st.local_blocks, st.looked_up, st.offered, st.need = NO_MATCH, d, 0, 0, []
        if last <= d or st.stale or st.load_failed or not self.loads:
            return 0
        self._keys(st, last)
        end = last if self._partial_ok else self._whole_end(st, d, last)
        need = self._needed(d, end)
        match = self.manager.match(request_id, [st.group_keys[g][i] for g, i in need],
                                   [self._chunk(st, i) for _, i in need],
                                   compute_ahead=self._compute_ahead(),
                                   handoff=handoff.after(d * bs) if handoff else None)
        if match is None or match.fetching:  # a presence answer or a fetch is on its way
            if match is not None:
                self.recorder.fetching(request_id, need, st.group_keys)
                if st.timeline.fetch_started is None:
                    st.timeline.fetch_started = WakeTimeline.now()
            return None
        st.timeline.answered = WakeTimeline.now()
        st.looked_up = (last - d) * bs
        if not match.load_keys:
            st.match = match
            return 0
        if len(match.load_keys) < len(need) and not self._partial_ok:
            # every group needs all of its blocks: part of a hit is recomputing all of it
            st.match = Match(declined_by=declines(match.declined_by,
                                                  (Decline.LAYOUT, match.restored_tokens)))
            return 0  # a fetch's pins are released when vLLM admits the request
        st.match, st.need = match, need[:len(match.load_keys)]
        st.offered = (max(i for _, i in st.need) + 1 - d) * bs
        others = sum(1 for rid, o in self.requests.items() if o.counted and rid != request_id)
        st.load_async = loads_async(self.async_loading, match.decision.restore_s
                                    if match.decision is not None else 0.0,
                                    self.period.seconds, others)
        return st.offered

    def loads_async(self, request_id: str) -> bool:
        """Whether the load `matched_tokens` just offered runs beside the others' steps
        (vLLM then holds the request until the worker says it landed)."""
        st = self.requests.get(request_id)
        return st is not None and st.offered > 0 and st.load_async

    def _compute_ahead(self) -> int:
        """Prompt tokens of the requests vLLM admitted that it has not computed yet: the
        prefill a recompute would queue behind."""
        return sum(max(0, st.prompt_len - st.computed) for st in self.requests.values()
                   if st.counted)

    @property
    def _partial_ok(self) -> bool:
        """One full-attention group: any leading run of a hit is a hit of its own."""
        return self.windows == (None,)

    def _needed(self, d: int, end: int) -> list[tuple[int, int]]:
        """(group, block) of every block a hit of `end` blocks loads after vLLM's `d`."""
        need = []
        for g, w in enumerate(self.windows):
            first = d if w is None else max(d, w.first_needed(end))
            need += [(g, i) for i in range(first, end)]
        return need

    def _whole_end(self, st: RequestState, d: int, last: int) -> int:
        """The longest hit every group's blocks of which the host or the local disk holds
        whole (probed without side effects: `match` then verifies them, and fetches what is
        on disk); `last` when none: the lookup then asks every tier below host for it."""
        known: dict[tuple[int, int], bool] = {}

        def held(g: int, i: int) -> bool:
            if (g, i) not in known:
                known[g, i] = self.manager.holds(st.group_keys[g][i])
            return known[g, i]

        top = last  # full-attention groups bound the hit by their leading held run
        for g, w in enumerate(self.windows):
            if w is None:
                run = d
                while run < top and held(g, run):
                    run += 1
                top = run
        for end in range(top, d, -1):  # each window group needs only its window before end
            if all(held(g, i) for g, w in enumerate(self.windows) if w is not None
                   for i in range(max(d, w.first_needed(end)), end)):
                return end
        return last

    def allocated(self, request_id: str, block_ids: Sequence[Sequence[int]],
                  external: int) -> int | None:
        """vLLM allocated `block_ids` (one list per group); `external` tokens are ours to load."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        self.recorder.settled(request_id)  # a fetch lands before vLLM admits the request
        st.timeline.allocated = WakeTimeline.now()
        if not st.counted:  # the lookup vLLM acted on: retries while it waited do not count
            st.counted = True
            self._counts[LOOKUP_TOKENS, ()] += st.looked_up
            self._counts[DECLINED_TOKENS, ()] += st.match.declined_tokens
        st.computed = st.local_blocks * self.block_size + external
        match, need = st.match, st.need
        if external != st.offered:  # vLLM took less than offered: load nothing, recompute
            match, need = Match(declined_by=match.declined_by), []
        targets = [block_ids[g][i] for g, i in need]
        if need and not where_expected(block_ids, st.local_blocks, need):
            # vLLM's nulls are not where the window rule puts them: load nothing, and have
            # vLLM recompute every block it thinks restored
            d, end = st.local_blocks, st.local_blocks + st.offered // self.block_size
            self._invalid.update(b for ids in block_ids for b in ids[d:end] if b)
            match, need, targets = Match(declined_by=match.declined_by), [], []
        job = self.manager.allocated(request_id, match, targets)
        if st.load_async and external:  # vLLM waits for the worker to say it landed
            if job is not None:
                self._async.append((job, request_id))
            else:  # nothing to load after all (its blocks are reported invalid): said now
                self._received.append(request_id)
        st.load_async = False
        if job is not None:
            self._restoring[job] = (request_id, st.offered, Counter(g for g, _ in need))
            # counted now: a request whose load lands in its last step is finished before
            # vLLM hands back that step's results (a failed load is undone in `apply`, and
            # its request is never finished in that step: vLLM recomputes its blocks first)
            st.restored += st.offered
        if need:
            st.stored = max(st.stored, max(i for _, i in need) + 1)
        st.match, st.need, st.offered = NO_MATCH, [], 0
        return job

    def finish_windows(self, request_id: str, block_ids: Sequence[Sequence[int]],
                       computed: int) -> bool:
        """A finished request's window blocks before its final boundary (filled during
        decode, so a follow-up that carries the output hits there too): stored in the next
        step, so vLLM must keep them until then (True; `take_sending` names the request)."""
        st = self.requests.get(request_id)
        if st is None or st.stale or self._partial_ok or not self.stores:
            return False
        bs = self.block_size
        end = min(computed, len(st.tokens)) // bs
        prompt_end = (st.prompt_len - 1) // bs
        if end <= prompt_end:
            return False
        self._keys(st, end)
        kept = [(g, i) for g, w in enumerate(self.windows) if w is not None
                for i in range(w.first_needed(end), end)
                if i < len(block_ids[g]) and block_ids[g][i]
                and not self._kept(st, g, i)]
        if not kept:
            return False
        blocks = self._store(request_id, st, block_ids, kept)
        if not blocks:  # on host already, or no room: nothing to wait for
            return False
        self._sending.append(request_id)
        return True

    def _store(self, request_id: str, st: RequestState, block_ids: Sequence[Sequence[int]],
               kept: list[tuple[int, int]]) -> tuple[int, ...] | None:
        """The `kept` (group, block) to the host tier (told the recorder): the device blocks
        its job reads, or None if it had no room."""
        blocks = self.manager.store([block_ids[g][i] for g, i in kept],
                                    [st.group_keys[g][i] for g, i in kept],
                                    [self._chunk(st, i) for _, i in kept], tenant=st.tenant,
                                    parents=[st.group_keys[g][i - 1] if i else None
                                             for g, i in kept])
        if blocks is not None:
            self.recorder.storing(request_id, kept, st.group_keys)
        return blocks

    def take_async(self) -> list[tuple[int, str]]:
        """The loads decided since the last call that vLLM waits on apart: (job, request)."""
        loads, self._async = self._async, []
        return loads

    def take_received(self) -> list[str]:
        """Requests vLLM waits on whose load was dropped: the worker reports them at once."""
        received, self._received = self._received, []
        return received

    def take_sending(self) -> list[str]:
        """Requests whose final window stores are among the jobs `step` returns next: the
        worker reports them finished once those copies are done (vLLM frees the blocks)."""
        sending, self._sending = self._sending, []
        return sending

    def take_invalid(self) -> set[int]:
        """Device blocks vLLM believes restored but kvtier did not load (see module doc)."""
        invalid, self._invalid = self._invalid, set()
        return invalid

    def step(self, scheduled: Sequence[Scheduled]) -> list[Job]:
        """Stores for every block that is full once this step has run (the worker copies
        them after the forward pass, before vLLM can reuse them), and all decided jobs."""
        bs = self.block_size
        self.period.stepped(bool(scheduled))
        self.manager.stage_returns()  # sessions due back soon: up into host now
        for s in scheduled:
            st = self.requests.get(s.request_id)
            if st is None:
                continue
            st.computed = s.computed_after
            if st.stale or not self.stores:
                continue
            allocated = min(len(ids) for ids in s.block_ids)
            full = min(s.computed_after, len(st.tokens), allocated * bs) // bs
            if full <= st.stored:
                continue
            self._keys(st, full)
            kept = [(g, i) for g, ids in enumerate(s.block_ids)
                    for i in range(st.stored, full) if ids[i] and self._kept(st, g, i)]
            if kept:
                self._store(s.request_id, st, s.block_ids, kept)
            st.stored = full  # a store the host refused is not retried: it is a future miss
        return self.manager.take_jobs()

    @property
    def busy(self) -> bool:  # a hint not yet due is not: vLLM would spin its loop for it
        return self.manager.busy

    def apply(self, results: Sequence[Result]) -> None:
        for event in self.manager.apply(results):
            if isinstance(event, FetchDone):
                if event.request_id in self.requests:
                    self.requests[event.request_id].timeline.fetched(event.finished_at,
                                                                     event.seconds)
            elif isinstance(event, LoadDone):
                request_id, tokens, groups = self._restoring.pop(event.job_id,
                                                                 ("", 0, Counter()))
                st = self.requests.get(request_id)
                if st is not None:
                    st.timeline.loaded(event.finished_at, event.seconds)
                if event.success:
                    self._counts[RESTORED_TOKENS, ()] += tokens
                    self._counts[RESTORE_SECONDS, ()] += event.seconds
                    if self.manager.lossy:  # host slots hold 8-bit encodings
                        self._counts[LOSSY_RESTORED_TOKENS, ()] += tokens
                    for g, n in groups.items():
                        self._counts[RESTORED_BLOCKS, (self._group_label(g),)] += n
                elif st is not None:
                    st.restored -= tokens
                    st.load_failed = True

    def reset(self) -> int:
        """vLLM reset its prefix cache (see the module doc); how many host blocks were
        dropped (those a job in flight pins stay until it lands, and are never asked for)."""
        for st in self.requests.values():
            st.stale = True
            st.match, st.need, st.offered = NO_MATCH, [], 0
        dropped = self.manager.reset()
        self._counts[CACHE_RESETS, ()] += 1
        self._counts[RESET_DROPPED_HOST_BLOCKS, ()] += dropped
        return dropped

    def take_stats(self) -> dict[str, Any]:
        """What happened since the last call (vLLM sums the reports), nested as `counters.py`
        says: {"fetched_blocks": {"disk": 7}, "miss_blocks": {"disk": {"checksum": 1}}}."""
        delta = self._reported.take(tier_counters(self.manager.report(), self.world_size))
        counts, self._counts = self._counts, Counter()
        counts.update(delta)
        return nest(counts)

    def answer(self, request_id: str, asks: Mapping[str, Any] | None,
               envelope: Any = None) -> dict[str, Any]:
        """A finishing request's asks (`kv_hints.py`) and its KV hints envelope's actions
        over its full blocks: vLLM finishes it in its last step's update, after `step`
        stored them (retention finds storing ones)."""
        st = self.requests.get(request_id)
        if st is None or st.stale:
            return self.hints.answer(request_id, asks, st.tenant if st else "", [], [],
                                     envelope, st.prompt_len if st else 0)
        blocks = [(g, i) for g, keys in enumerate(st.group_keys)
                  for i in range(min(st.stored, len(keys))) if self._kept(st, g, i)]
        keys, chunks = [st.group_keys[g][i] for g, i in blocks], [self._chunk(st, i)
                                                                  for _, i in blocks]
        read = st.local_blocks * self.block_size + (0 if st.load_failed else st.restored)
        return self.hints.answer(request_id, asks, st.tenant, keys, chunks, envelope,
                                 st.prompt_len, max(1, len(st.group_keys)), read)

    def handed_tokens(self, request_id: str) -> int:
        """The leading tokens whose blocks this engine stored for the request, prompt and
        output (what it hands off: they are on their way to every store below host)."""
        st = self.requests.get(request_id)
        if st is None or st.stale or not self.stores:
            return 0
        return st.stored * self.block_size

    def finished(self, request_id: str) -> dict[str, Any]:
        """Forget the request; what the tier did for it (vLLM's kv_transfer_params)."""
        outcome = self.manager.outcome(request_id)
        self.manager.finished(request_id)
        self.recorder.settled(request_id)
        st = self.requests.pop(request_id, None)
        if st is None:
            return {}
        st.timeline.finished = WakeTimeline.now()
        # tokens vLLM did not compute thanks to kvtier (a window group loads fewer: its
        # bytes are in the counters)
        restored = 0 if outcome.failed else st.restored
        # "none": kvtier restored nothing (vLLM's own prefix cache or its compute served it)
        residency = (Residency.from_medium(outcome.source).value
                     if restored and outcome.source else "none")
        return {"kvtier_residency": residency,
                "kvtier_restored_tokens": restored,
                "kvtier_restore_s": round(outcome.seconds, 6),
                # waiting for blocks still being written (another engine's handoff)
                "kvtier_waited_s": round(outcome.waited_s, 6),
                # restored from 8-bit blocks (kv_offload_dtype): close to, not exactly, the KV
                "kvtier_lossy": bool(restored and outcome.lossy),
                # when each step of its wake happened (wake_timeline.py)
                "kvtier_timeline": st.timeline.as_params()}

    def _group_label(self, g: int) -> str:
        w = self.windows[g]
        return f"{g}:full" if w is None else f"{g}:window={w.tokens}"

    def _kept(self, st: RequestState, g: int, i: int) -> bool:
        """Whether block `i` of group `g` is worth storing: every block of full attention;
        of a window, those a re-sent prompt's hit reads (the window before its boundary)."""
        w = self.windows[g]
        if w is None:
            return True
        end = (st.prompt_len - 1) // self.block_size
        return w.first_needed(end) <= i < end

    def _chunk(self, st: RequestState, i: int) -> Sequence[int]:
        return st.tokens[i * self.block_size:(i + 1) * self.block_size]

    def _state(self, request_id: str, tokens: Sequence[int], salt: str,
               prompt_len: int | None = None) -> RequestState:
        st = self.requests.get(request_id)
        if st is None:
            st = self.requests[request_id] = RequestState(
                tokens, self.namespace(salt),
                len(tokens) if prompt_len is None else prompt_len)
        return st

    def _keys(self, st: RequestState, full: int) -> None:
        """The chain over the first `full` blocks and each group's keys (extended, not redone)."""
        have = len(st.keys)
        if full > have:
            parent = st.keys[-1] if st.keys else None
            st.keys += hash_blocks(st.namespace, st.tokens[:full * self.block_size],
                                   self.block_size, start=have, parent=parent)
        if not st.group_keys:
            st.group_keys = [[] for _ in self.windows]
        for tag, keys in zip(self.tags, st.group_keys):
            keys += [group_key(k, tag) for k in st.keys[len(keys):]]
