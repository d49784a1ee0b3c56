"""TierManager: the scheduler side of the tier. Bookkeeping only: no tensors, no device pool.

Primitives, in the order a client calls them:
  match(request, keys, tokens)      leading blocks the host holds (to load), with the
                                    planner's verdict; a prefix that goes on below host is
                                    fetched up first (FETCHING until it lands); None = a
                                    remote presence answer is pending, ask again next step
  allocated(request, match, blocks) device blocks are ready: start the host -> device load
  outcome(request)                  what was restored, from where, in how long, lossy, failed
  store(blocks, keys, tokens)       device blocks -> host slots (the client holds an extra
                                    reference on each device block until its StoreDone)
  finished(request)                 the request is gone: its per-request state is dropped
  prefetch(id, keys, tokens)        a prefix expected back soon: fetched up into host now
                                    (a FetchDone under `id`, then `finished(id)`)
  answer(request_id, hints, ...)    what a finished request's hints ask (-> HintReply)
  retain(keys, tenant, seconds)     keep a stored prefix until a deadline (-> Grant)
  expect(id, keys, tokens, after_s) the session comes back then: watched, and what of it
                                    goes below host is fetched back up by
  stage_returns()                   on every step (`returns.py`; its fetches are the
                                    manager's own, no event reaches the client)
  reset()                           the client's keys move to a new identity (its engine's
                                    weights may have changed): drop every unpinned host block
  purge(keys) -> Purged             a client's purge: out of host now (a copy a job holds
                                    once it lets go), erased below host by jobs (a disk slot
                                    overwritten, a file or key deleted)
  purge_tenant(tenant)              the same for every block a tenant owns (-> Purged, keys)
  take_jobs() -> [Job]              jobs decided since the last call, for the worker
  apply([Result]) -> [Event]        LoadDone / FetchDone / StoreDone
and what a client may ask besides: report() -> TierStats, decide(tokens, bytes, mode),
observe_prefill(tokens, seconds), below_host, hands_off, host_slots, wait_presence(), busy,
close(), take_residency_changes() -> [ResidencyChange] (which blocks became resident on host
or disk, or stopped being, since the last call: recorded only for a manager built to keep
them).
Between a job's creation and its result, its host slots are pinned in the host index (and
a deeper tier's slots in theirs): neither is evicted nor handed out again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.fetch_up import FetchUp
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.prefetch_budget import PrefetchBudget
from kvtier.tier.books.residency_log import ResidencyChange, ResidencyLog
from kvtier.tier.books.returns import ExpectedReturns
from kvtier.tier.books.state import PendingTransfer, RequestBooks
from kvtier.tier.books.tenancy import Grant, Refusal
from kvtier.tier.config import TierConfig
from kvtier.tier.handoff import Handoff, Wait
from kvtier.tier.hints import Hint, HintReply, KvHints, Purged
from kvtier.tier.jobs import Event, FetchDone, Job, LoadDone, Result, StoreDone
from kvtier.tier.keys import BlockKey, Medium, is_swap_key, partial_keys
from kvtier.tier.load_policy import Ahead, Decline, LoadPolicy
from kvtier.tier.match import FETCHING, NO_MATCH, Match, Prefetch, declines
from kvtier.tier.outcome import RequestOutcome, landed
from kvtier.tier.planner import Decision, Planner
from kvtier.tier.report import TierStats, TransferCounts

log = logging.getLogger(__name__)
HANDOFF_POLL_S = 0.005  # a handoff's store asked at most this often while a request waits


class TierManager:
    """Coordinates the host index, the tiers below it and the planner for one client."""

    def __init__(self, config: TierConfig, block_size: int, host: HostTier, planner: Planner,
                 block_bytes: int, below: BelowHost, ids: Iterator[int],
                 residency: ResidencyLog | None = None) -> None:
        """`residency`: the log the host and disk indexes record into (None: none kept)."""
        self.config = config
        self.block_size = block_size
        self.host = host
        self.planner = planner
        self.block_bytes = block_bytes  # bytes of one block across the host link
        self.below = below  # the tiers below host; empty (and false) when there are none
        self.lossy = bool(config.kv_offload_dtype)  # host slots hold 8-bit encodings
        self.load_policy = LoadPolicy.parse(config.load_policy)  # restore or recompute
        self.stats = TransferCounts()
        self.declined: Counter[Decline] = Counter()  # admitted requests per reason declined
        self.waited: Counter[Wait] = Counter()  # requests that waited, per what for
        self.wait_seconds: dict[Wait, float] = {}  # and how long
        self._ids = ids
        self._pending: dict[int, PendingTransfer] = {}
        self._outbox: list[Job] = []
        self._requests: dict[str, RequestBooks] = {}
        # purged while a job held them (landing, or read by a load or a write below):
        # dropped from host as soon as it lets go, never written below
        self._purge_when_free: set[BlockKey] = set()
        self._residency = residency if residency is not None else ResidencyLog(enabled=False)
        self.returns = ExpectedReturns()  # sessions a client said come back (expect)
        self.fetch_up = FetchUp(config, planner, below, self.load_policy, block_size,
                                block_bytes, PrefetchBudget(host.num_slots))

    # -- queries ------------------------------------------------------------------------

    def host_hits(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]]) -> int:
        return self.host.lookup(keys, tokens) if keys else 0

    def holds(self, key: BlockKey) -> bool:
        """Whether a tier below the device already keeps `key` (host, or the local disk)."""
        return self.host.lookup([key]) == 1 or self.below.holds(key)

    @property
    def busy(self) -> bool:
        """A job decided or running, or a presence answer awaited."""
        return bool(self._pending) or self.below.busy

    @property
    def loads_in_flight(self) -> int:
        """Host -> device loads and fetches up to host decided and not landed."""
        loads = sum(1 for p in self._pending.values() if p.job.dst is Medium.DEVICE)
        return loads + sum(1 for p in self.below.jobs.values() if p.job.dst is Medium.HOST)

    def _ahead(self, compute_tokens: int, via: str | None = None) -> Ahead:
        """What a new load would queue behind: loads in flight, fetches queued on `via`."""
        link = sum(p.job.num_blocks for p in self._pending.values()
                   if p.job.dst is Medium.DEVICE) * self.block_bytes
        queued = sum(p.job.num_blocks for p in self.below.jobs.values()
                     if via is not None and p.job.dst is Medium.HOST and p.job.src.value == via)
        fetch_s = (queued * self.below.block_bytes / (self.planner.tier_gbps(via) * 1e9)
                   if via is not None else 0.0)
        return Ahead(self.loads_in_flight, link, fetch_s, compute_tokens)

    @property
    def below_host(self) -> bool:
        """Whether a tier below host memory (disk, Redis) is configured."""
        return bool(self.below)

    @property
    def host_slots(self) -> int:
        return self.host.num_slots

    @property
    def hands_off(self) -> bool:
        """Whether what is stored here reaches a store other engines read (a handoff to
        another engine can go through it)."""
        return self.below.shared

    def wait_presence(self) -> None:
        """Block until the remote store has answered what was asked (or a short timeout)."""
        self.below.wait_presence()

    def decide(self, tokens: int, nbytes: int, mode: str = "auto", via: str | None = None
               ) -> Decision:
        """The planner's restore-or-recompute verdict for `tokens` whose KV is `nbytes`
        (first fetched up from the tier `via`, if given)."""
        return self.planner.decide(tokens, nbytes, mode, via)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill of `tokens`: scores and refines the recompute estimate."""
        self.planner.observe_prefill(tokens, seconds, self.planner.recompute_s(tokens))

    def close(self) -> None:
        """Stop the tiers' own threads (a remote presence thread); the worker is closed apart."""
        self.below.close()

    def take_residency_changes(self) -> list[ResidencyChange]:
        """Blocks that became resident on host or disk, or stopped being, since the last
        call, in order (empty unless the manager was built to keep them)."""
        return self._residency.take()

    def report(self) -> TierStats:
        """A frozen snapshot of everything the scheduler side counts (see report.py)."""
        return TierStats(
            host=self.host.stats, transfers=replace(self.stats),
            calibration={**vars(self.planner.calibration),  # a slow tier's rate while slow
                         "tier_gbps": {t: self.planner.tier_gbps(t)
                                       for t in self.planner.calibration.tier_gbps}},
            prediction_error=self.planner.error_report(),
            below=self.below.report() if self.below else None,
            declined={reason.value: n for reason, n in self.declined.items()},
            waited={wait.value: n for wait, n in self.waited.items()},
            wait_seconds={wait.value: s for wait, s in self.wait_seconds.items()},
            tenants=self.host.tenancy.report(self.config.kv_tenant_labels),
            slot_bytes=self.below.block_bytes)

    # -- match and load -----------------------------------------------------------------

    def match(self, request_id: str, keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], preempted: bool = False,
              compute_ahead: int = 0, parent: BlockKey | None = None,
              tail: Sequence[int] = (), handoff: Handoff | None = None) -> Match | None:
        """The blocks after the device prefix (`keys[i]` covers `tokens[i]`; a preempted
        sequence's partial last block included) that are worth restoring rather than
        recomputing, `compute_ahead` prefill tokens being admitted before it and not yet
        computed. None: a deeper tier's answer is pending, ask again next step. Where
        the prefix goes on below host and reading it up beats recomputing it, the fetch
        starts here and the answer is FETCHING (not yet) until it lands.

        `parent` (the key before `keys[0]`) asks for a part of a block too: where the chain
        stops on host, the longest leading part of the next block (of `tail`, the tokens
        after the last of `tokens` that may be loaded, past the chain's end) that a cache
        breakpoint kept under its own key is loaded with it, so the match ends exactly at
        that breakpoint.

        `handoff`: another engine is writing the prompt's blocks to a shared store (its
        prefill ran there); while fewer than it names are there, the request waits for them
        (`_waits`), then fetches what came and recomputes the rest."""
        if self.returns.arriving(keys):  # its prefix is being staged up: not yet
            return None
        state = self._requests.setdefault(request_id, RequestBooks())
        if state.fetching:
            return FETCHING
        hits = self.host_hits(keys, tokens)
        if not preempted and self._waits_for_landing(state, keys, hits):
            return None  # the next blocks are still landing on host (a turn just ended)
        cap = self.config.max_load_tokens
        if cap is not None:
            hits = min(hits, cap // self.block_size)
        media: list[Medium] = []
        if not preempted and not state.checked_below and hits < len(keys) and self.below:
            if handoff is not None and not self._asks_again(state):
                return None  # a handoff's store is asked at most every HANDOFF_POLL_S
            # A tier in a slow cool-down is asked too: the planner weighs it at the rate it
            # showed, and what that rules out is counted declined, never skipped unsaid.
            found = self.below.hits(keys[hits:], tokens[hits:])
            if found is None:
                return None
            if handoff is not None and self._waits(
                    state, Wait.HANDOFF,
                    handoff.blocks(len(keys), self.block_size) - hits - len(found),
                    handoff.wait_s):
                return None  # another engine's write has not landed yet: asked again
            state.checked_below = True
            media = found if cap is None else found[: max(0, cap // self.block_size - hits)]
            end = hits + len(media)  # where the chain stops below host too
            below = (self._part_below(keys, tokens, end, parent, tail)
                     if parent is not None and len(media) == len(found) else None)
            if below is not None:  # a breakpoint's part, on a local tier: fetched with it
                keys, tokens = [*keys[:end], below[0]], [*tokens[:end], below[1]]
                media = [*media, below[2]]
        part = (self._part(keys, tokens, hits, parent, tail, cap)
                if parent is not None and not media and not preempted else None)
        if part is not None:
            keys, tokens, hits = [*keys[:hits], part[0]], [*tokens[:hits], part[1]], hits + 1
        restored = sum(len(t) for t in tokens[:hits])

        def ahead(via: str | None) -> Ahead:
            return self._ahead(compute_ahead, via)

        plan = self.fetch_up.plan(hits, restored, media, ahead, preempted)
        for reason, n in plan.declined:
            state.declined[reason] += n
        if plan.fetch:
            n = plan.fetch
            if self.fetch_up.start(request_id, keys[hits:hits + n], tokens[hits:hits + n],
                                   media[:n]):
                state.fetching = True
                return FETCHING
            state.declined[Decline.NO_ROOM] += n * self.block_size
            plan = self.fetch_up.plan(hits, restored, (), ahead, preempted)  # host's alone
        if hits == 0:
            return Match(declined_by=declines(state.declined)) if state.declined else NO_MATCH
        if not plan.load:
            assert plan.load_declined is not None
            return Match(decision=plan.decision,
                         declined_by=declines(state.declined, (plan.load_declined, restored)))
        return Match(tuple(keys[:hits]), restored, plan.decision, state.fetched_from,
                     declined_by=declines(state.declined), partial=part is not None)

    def _waits_for_landing(self, state: RequestBooks, keys: Sequence[BlockKey],
                           hits: int) -> bool:
        """Whether the blocks after the host's `hits` are still being copied into host (the
        previous turn's write, not landed when its follow-up came) and the request waits for
        them (`_waits`)."""
        run = 0
        while hits + run < len(keys) and self.host.storing(keys[hits + run]):
            run += 1
        return self._waits(state, Wait.LANDING, run, None)

    def _waits(self, state: RequestBooks, wait: Wait, missing: int,
               bound_s: float | None) -> bool:
        """Whether the request goes on waiting (asks again next step) for `missing` blocks
        still being written: from its first ask, at most `bound_s` (None: the time the
        planner says recomputing them takes, past which waiting costs more than computing);
        then they are recomputed, declined `deadline` once. Its wait is counted when it
        stops."""
        if wait in state.gave_up:
            return False
        now = time.monotonic()
        if missing > 0:
            since = state.waiting.setdefault(wait, now)
            bound = (self.planner.recompute_s(missing * self.block_size) if bound_s is None
                     else bound_s)
            if now - since < bound:
                return True
            state.gave_up.add(wait)
            state.declined[Decline.DEADLINE] += missing * self.block_size
        self._stop_waiting(state, wait, now)
        return False

    def _stop_waiting(self, state: RequestBooks, wait: Wait, now: float) -> None:
        since = state.waiting.pop(wait, None)
        if since is not None:
            self.waited[wait] += 1
            self.wait_seconds[wait] = self.wait_seconds.get(wait, 0.0) + now - since
            state.outcome = replace(state.outcome, waited_s=state.outcome.waited_s + now - since)

    def _asks_again(self, state: RequestBooks) -> bool:
        """Whether a request waiting for a handoff asks the store again now: an engine
        waiting on one request steps in a loop, and a question a step would flood it."""
        now = time.monotonic()
        if now - state.asked_at < HANDOFF_POLL_S:
            return False
        state.asked_at = now
        return True

    def _part_below(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
                    at: int, parent: BlockKey, tail: Sequence[int]
                    ) -> tuple[BlockKey, Sequence[int], Medium] | None:
        """The longest leading part of block `at` that a local tier below host keeps under
        its own key (shared stores are not probed: their presence answers come later)."""
        chunk = tokens[at] if at < len(tokens) else tail
        for key, part in partial_keys(keys[at - 1] if at else parent, chunk, self.block_size):
            if self.host.has(key, part):
                return None  # host memory's copy is the one: matched once the rest is up
            medium = self.below.local_copy(key, part)
            if medium is not None:
                return key, part, medium
        return None

    def _part(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]], hits: int,
              parent: BlockKey, tail: Sequence[int], cap: int | None
              ) -> tuple[BlockKey, Sequence[int]] | None:
        """The longest leading part of the block after the host's `hits` blocks that host
        memory keeps under its own key (a breakpoint's), within the load cap; None if none."""
        chunk = tokens[hits] if hits < len(tokens) else tail
        room = self.block_size - 1 if cap is None else min(self.block_size - 1,
                                                            cap - hits * self.block_size)
        if not chunk or room < 1:
            return None
        for key, part in partial_keys(keys[hits - 1] if hits else parent, chunk[:room],
                                      self.block_size):
            if self.host.has(key, part):
                self.host.lookup([key], [part])  # the one probe that hits, counted
                return key, part
        return None

    def prefetch(self, request_id: str, keys: Sequence[BlockKey],
                 tokens: Sequence[Sequence[int]], tenant: str = "") -> Prefetch | None:
        """A client's hint that this prefix comes back soon: bring what lies below host up
        into host now, bounded like any fetch by the host's room and the deadline's cap, and
        by `tenant`'s prefetch budget (`prefetch_budget.py`). None: a store's answer is
        pending."""
        return self.fetch_up.prefetch(request_id, keys, tokens, self.host_hits(keys, tokens),
                                      tenant)

    def answer(self, request_id: str, hints: KvHints, keys: Sequence[BlockKey],
               tokens: Sequence[Sequence[int]], parts: Mapping[int, BlockKey] | None = None
               ) -> HintReply:
        """What a finished request's hints ask of its full blocks `keys` (covering `tokens`,
        handed to the tier already: stored, or still storing), each asked hint answered.
        `parts`: a breakpoint inside a block (its tokens) -> the key its part of that block
        was stored under, kept with the breakpoint's full blocks."""
        parts = parts or {}
        retention = expect = None
        if hints.asks(Hint.RETENTION):  # an invalid value is counted with the refusals
            retention = self.retain(keys, hints.tenant, None if Hint.RETENTION in hints.invalid
                                    else hints.retention_s)
        if hints.asks(Hint.EXPECT_RETURN):
            after = hints.expect_return_s
            expect = (Grant(refused=Refusal.INVALID)
                      if after is None or Hint.EXPECT_RETURN in hints.invalid
                      else self.expect(request_id, keys, tokens, after, hints.tenant))
        prefixes = tuple(self.retain([*keys[:p.tokens // self.block_size],
                                      *([parts[p.tokens]] if p.tokens in parts else [])],
                                     hints.tenant, p.seconds) for p in hints.prefixes)
        return HintReply(retention, expect, prefixes)

    def retain(self, keys: Sequence[BlockKey], tenant: str, seconds: float | None) -> Grant:
        """Pin the blocks of `keys` that a tier holds (or is storing) for `seconds`, counted
        against `tenant`'s quota: granted whole, or refused with the reason (None: a value
        no client means, refused as invalid)."""
        tenancy = self.host.tenancy
        grant = tenancy.retain(keys, tenant, seconds)
        if grant.refused is None:  # copies already below host outlive the deadline too
            kept = {k: t for k in dict.fromkeys(keys) if (t := tenancy.deadline(k))}
            self.below.renew(list(kept), list(kept.values()))
        return grant

    def expect(self, request_id: str, keys: Sequence[BlockKey],
               tokens: Sequence[Sequence[int]], after_s: float, tenant: str = "") -> Grant:
        """The session of `keys` (its full blocks, `tenant`'s) comes back `after_s` from
        now: from shortly before then, what of it went below host is fetched back up."""
        return self.returns.expect(request_id, keys, tokens, after_s, time.monotonic(),
                                   tenant)

    def stage_returns(self) -> list[BlockKey]:
        """Every step: fetch up what went below host of the sessions due back soon, and
        erase from host and every tier below the blocks whose retention expired where the
        deployment asks (kv_retention_erase), their hashes out of the retention file too.
        Returns the keys erased: the device's copies are the engine's to drop."""
        if self.returns:
            self.returns.stage(time.monotonic(), self.prefetch)
        tenancy = self.host.tenancy
        expired = tenancy.take_expired() if tenancy.erase_expired else []
        if expired:
            self.purge(expired)
            tenancy.save()
        return expired

    def allocated(self, request_id: str, match: Match, device_blocks: Sequence[int],
                  layerwise: bool = False, exclusive: bool = False, swap_in: bool = False
                  ) -> int | None:
        """The request is admitted with `device_blocks` for `match.load_keys`: start the
        load and return its job id (None when there is nothing to load). `exclusive`: once
        loaded, the device copy is the one that counts and the host slots are freed (a
        client that writes blocks back when it evicts them); `swap_in`: the request's own
        state after a preemption, counted apart from its prompt's restore."""
        state = self._requests.setdefault(request_id, RequestBooks())
        state.declined.clear()  # counted once, by this admission
        self.declined.update(reason for reason, _ in match.declined_by)
        self.below.release(request_id)  # the load takes pins of its own
        if not match.load_keys:
            return None
        o, n = state.outcome, match.restored_tokens
        o = replace(o, nbytes=o.nbytes + len(match.load_keys) * self.block_bytes,
                    lossy=o.lossy or self.lossy)
        state.outcome = (replace(o, swapped_in_tokens=o.swapped_in_tokens + n) if swap_in else
                         replace(o, restored_tokens=o.restored_tokens + n,
                                 source=match.source))
        keys = list(match.load_keys)
        slots = self.host.prepare_load(keys)
        self.host.touch(keys)
        self.host.tenancy.hit(keys)
        job = Job(next(self._ids), Medium.HOST, Medium.DEVICE, tuple(slots),
                  device_blocks=tuple(device_blocks), layerwise=layerwise)
        predicted = match.decision.restore_s if match.decision is not None else None
        self._add(PendingTransfer(job, keys, request_id, predicted, match.restored_tokens,
                           swap_in, exclusive=exclusive))
        return job.id

    def outcome(self, request_id: str) -> RequestOutcome:
        """What the tier did for the request so far (nothing, for one it does not know)."""
        state = self._requests.get(request_id)
        return state.outcome if state is not None else RequestOutcome()

    def finished(self, request_id: str, swap_keys: Sequence[BlockKey] = ()) -> None:
        """The request finished or was aborted: forget its state and its swap entries."""
        state = self._requests.pop(request_id, None)
        if state is not None:  # a wait it never ended (aborted while waiting) counts too
            for wait in list(state.waiting):
                self._stop_waiting(state, wait, time.monotonic())
        self.below.release(request_id)
        self.forget(swap_keys)
        if self._purge_when_free:  # its fetched blocks were held for it
            self._drop_purged()

    def reset(self) -> int:
        """Drop every host block no job pins (no key of the old identity is asked for again,
        so their room is better given back now); how many were dropped. Blocks below host
        stay, a process on the weights they were computed with may still find them, but no
        longer retained: no request here can ask for them, so they pin nothing."""
        self.host.tenancy.release_all()
        return self.host.remove(self.host.complete_keys())

    def purge(self, keys: Sequence[BlockKey]) -> Purged:
        """Remove `keys` from host and every tier below it (a client's purge): the host's
        copies no job pins are dropped now, the copies below are erased by jobs (a disk slot
        overwritten whole, a file or a key deleted) that run before any later write."""
        keys = list(dict.fromkeys(keys))
        present = [k for k in keys if self.host.lookup([k]) == 1]
        dropped = self.host.remove(present)
        # a copy a job holds (still landing, or being read) goes as soon as the job is done
        busy = [k for k in keys if self.host.storing(k) or self.host.present(k)]
        self._purge_when_free.update(busy)
        return Purged(host_blocks=dropped, host_in_use=len(busy),
                      below=self.below.purge(keys))

    def purge_tenant(self, tenant: str) -> tuple[Purged, list[BlockKey]]:
        """Every block `tenant` owns, removed as `purge` removes a prompt's: the keys a
        tier here holds for it, and those it wrote that only a shared store may still hold
        (as far as the tier remembers their owner). Returns the keys too (the device's
        copies are the engine's to drop)."""
        tenancy = self.host.tenancy
        keys = tenancy.keys_of(tenant)
        purged = self.purge(keys)
        tenancy.forget_owners(keys)
        return purged, keys

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Drop a request's swap entries (pinned ones, still loading, are kept)."""
        swap = [k for k in keys if is_swap_key(k)]
        if swap:
            self.host.remove(swap)

    # -- store --------------------------------------------------------------------------

    def store(self, block_ids: Sequence[int], keys: Sequence[BlockKey],
              tokens: Sequence[Sequence[int]], demote: bool = False,
              evict_first: bool = False, tenant: str = "",
              parents: Sequence[BlockKey | None] | None = None) -> tuple[int, ...] | None:
        """Copy the blocks the host lacks (new ones are `tenant`'s); returns the device
        blocks the job reads (the client must keep each one alive until its StoreDone), or
        None if the host could not make room (nothing changes). `parents[i]`: the key before
        `keys[i]` in its prefix (None: its first block), so the tiers drop prefixes from the
        tail; `chain_parents(keys)` where the keys are a prefix from its first block."""
        if not keys:
            return ()
        prepared = self.host.prepare_store(keys, tokens, tenant, self.below.keeps, parents)
        if prepared is None:
            self.stats.store_refused += 1
            return None
        if not prepared.keys:
            return ()
        where = dict(zip(keys, block_ids))
        blocks = tuple(where[k] for k in prepared.keys)
        job = Job(next(self._ids), Medium.DEVICE, Medium.HOST, tuple(prepared.slots),
                  device_blocks=blocks)
        self._add(PendingTransfer(job, list(prepared.keys), demote=demote, evict_first=evict_first))
        return blocks

    def write_down_host(self) -> None:
        """Every block complete on host that the disk lacks goes down (before a restart),
        and the retention deadlines are saved beside it."""
        self.below.write_down_host()
        self.host.tenancy.save()

    # -- jobs and results ---------------------------------------------------------------

    def _add(self, pending: PendingTransfer) -> None:
        self._pending[pending.job.id] = pending
        self._outbox.append(pending.job)

    def take_jobs(self) -> list[Job]:
        jobs, self._outbox = self._outbox, []
        return jobs + self.below.take_jobs()

    def apply(self, results: Sequence[Result]) -> list[Event]:
        """Apply finished jobs, in order; the events for the client."""
        events: list[Event] = []
        for result in results:
            if result.job_id in self._pending:
                events.append(self._finish(self._pending.pop(result.job_id), result))
                continue
            assert self.below.owns(result.job_id), f"result of unknown job {result.job_id}"
            done = self.below.finish(result)
            if done:
                self._fetched(done, result)
                if self.returns.landed(done.request_id):  # a staging: the tier's own
                    self.finished(done.request_id)
                    continue
                events.append(done)
        if self._purge_when_free:
            self._drop_purged()
        return events

    def _drop_purged(self) -> None:
        """Drop the purged copies the jobs holding them let go of."""
        for key in list(self._purge_when_free):
            if self.host.storing(key) or (self.host.present(key) and
                                          self.host.remove([key]) == 0):
                continue  # still held
            self._purge_when_free.discard(key)

    def _fetched(self, done: FetchDone, result: Result) -> None:
        state = self._requests.get(done.request_id)
        if state is not None:
            state.fetching = False  # asked again: the host holds what verified
            state.fetched_from = done.source if done.fetched else None
            state.declined[Decline.LOST] += done.missed * self.block_size
        if done.slow is not None:  # one late fetch: that tier is planned slow for a while
            tier = done.slow.value
            self.planner.observe_slow(tier, result.nbytes, result.seconds)
            slow = self.planner.slowdowns[tier]
            log.warning("kvtier: a fetch from the %s tier missed its deadline (%d of %d "
                        "blocks in %.2f s): its wakes are planned at %.3g MB/s for %.0f s, "
                        "then one fetch probes it", tier, done.fetched,
                        done.fetched + done.missed, result.seconds, slow.gbps * 1e3,
                        slow.window_s)
        elif done.source is not None and result.nbytes:
            tier = done.source.value
            was_slow = tier in self.planner.slowdowns
            self.planner.observe_tier(tier, result.nbytes, result.seconds, done.predicted_s)
            if was_slow:
                log.warning("kvtier: a fetch from the %s tier met its deadline: planned at "
                            "its measured rate again", tier)

    def _finish(self, pending: PendingTransfer, result: Result) -> Event:
        job, ok = pending.job, result.success
        nbytes = job.num_blocks * self.block_bytes
        if job.dst is Medium.HOST:
            self.host.complete_store(pending.keys, ok)
            if ok:
                self.stats.stored_blocks += len(pending.keys)
                self.stats.stored_bytes += nbytes
                # The second hop: host -> each tier below (none: nothing happens).
                self.below.host_stored([k for k in pending.keys if not is_swap_key(k)
                                        and k not in self._purge_when_free])
            else:
                self.stats.failed_stores += 1
            return StoreDone(job.id, job.device_blocks, ok, pending.demote, pending.evict_first)
        self.host.complete_load(pending.keys, ok)
        swap = [k for k in pending.keys if is_swap_key(k)]
        if swap:
            self.host.remove(swap)  # a preempted sequence's own blocks serve it once
        if ok and pending.exclusive:
            # Exclusive tiers: the device copy is now the one that counts and is written back
            # when evicted, so the host slot is freed and the two pools add up in capacity.
            self.host.remove(pending.keys)
        if ok:
            self.stats.loaded_blocks += len(pending.keys)
            self.stats.loaded_bytes += nbytes
            waited = result.finished_at - pending.decided_at if result.finished_at else 0.0
            self.planner.observe_transfer(nbytes, result.seconds, pending.predicted_s, waited)
        else:
            self.stats.failed_loads += 1
        assert pending.request_id is not None
        state = self._requests.get(pending.request_id)
        if state is not None:
            state.outcome = landed(state.outcome, pending.swap, pending.tokens, ok,
                                   result.seconds, nbytes)
        return LoadDone(pending.request_id, job.id, ok, len(pending.keys), nbytes,
                        result.seconds, result.finished_at)


def job_ids() -> Iterator[int]:
    """The one id counter a manager and its deeper tiers share."""
    return itertools.count()
