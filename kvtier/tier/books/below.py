"""The scheduler's side of the tiers below host memory: what goes down, what comes back up.

Deeper tiers (disk, a shared Redis, any `SecondaryIndex`) are a list, walked in order (the
nearest first), and staged through host memory, two hops each way:
  down  a block whose host store completed is written on to every deeper tier (`host_stored`);
        its host slot is pinned until the write lands, so the bytes cannot change under it
  up    a waiting request whose prefix continues below host fetches those blocks into fresh
        host slots (`fetch`); once they verify, the ordinary host -> device wake takes over
A fetched block is served only if its header (fingerprint, key, token ids) and payload
checksum verify on the I/O thread; anything else is a miss, dropped from its tier, counted
by reason and logged once, and those tokens are recomputed. Every fetch carries a deadline
(`deadline.py`): a block that had not landed by then is a miss too (reason "deadline"), but
kept where it lives, and the tier that was still reading is reported slow to the planner. A
write that failed is counted per tier and reason, and logged at most once a minute per tier
with the counts so far. Bookkeeping only: bytes move in `io/thread.py` once the client
submits the jobs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.tier.books.host import HostTier
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.books.slots import SlotTier
from kvtier.tier.deadline import FETCH_DEADLINE_S, fetch_budget_s
from kvtier.tier.jobs import SKIPPED, FetchDone, Job, Miss, Reason, Result
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import BelowReport

log = logging.getLogger(__name__)
PRESENCE_WAIT_S = 1.0
WRITE_LOG_S = 60.0  # failed writes are logged at most this often per tier (with the counts)


@dataclass
class BelowStats:
    written: Counter[str] = field(default_factory=Counter)  # blocks, per tier
    written_bytes: Counter[str] = field(default_factory=Counter)  # as stored (encoded)
    write_failures: Counter[str] = field(default_factory=Counter)
    write_failure_reasons: Counter[Miss] = field(default_factory=Counter)
    fetched: Counter[str] = field(default_factory=Counter)
    fetched_bytes: Counter[str] = field(default_factory=Counter)
    # the hop's I/O time
    fetch_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    misses: Counter[Miss] = field(default_factory=Counter)  # blocks not served
    refused: int = 0  # writes or fetches the host or disk tier had no room for
    renewed: Counter[str] = field(default_factory=Counter)  # blocks a later retention kept
    renew_failures: Counter[str] = field(default_factory=Counter)
    erased: Counter[str] = field(default_factory=Counter)  # blocks a purge erased
    erase_failures: Counter[str] = field(default_factory=Counter)


@dataclass
class _Pending:
    job: Job
    request_id: str = ""  # a fetch's request ("" for a write)
    predicted_s: float | None = None
    # The request left (finished, aborted, preempted, timed out) while its fetch was in
    # flight: what lands is kept as ordinary, unpinned host blocks.
    left: bool = False


class BelowHost:
    """Coordinates the host tier's slots with the tiers below it for the manager; with no
    tier below, every question has the empty answer (a null case, not a None)."""

    def __init__(self, host: HostTier, tiers: Sequence[SecondaryIndex], block_bytes: int,
                 ids: Iterator[int], encoding: str = "") -> None:
        self.host = host
        self.tiers = tuple(tiers)  # nearest first: lookups and fetches walk them in order
        self._by_medium = {t.medium: t for t in self.tiers}
        assert len(self._by_medium) == len(self.tiers), "one tier per medium"
        self.block_bytes = block_bytes  # bytes of one block as the tiers below store it
        self.encoding = encoding  # "" exact, or the lossy encoding of every block below host
        self.jobs: dict[int, _Pending] = {}
        # purged while a job held their copy on a local tier (a write on its way, a fetch
        # reading it): erased there once the job lets go
        self._erase_when_free: set[BlockKey] = set()
        self.held: dict[str, list[BlockKey]] = {}  # request -> fetched keys pinned on host
        self._outbox: list[Job] = []
        self._ids = ids
        self._logged: set[Miss] = set()  # the misses logged
        self._write_logged_at: dict[Medium, float] = {}  # a tier's last write-failure line
        self.stats = BelowStats()
        for tier in self.tiers:  # found at start and refused: misses, by reason
            for reason, n in tier.unusable_at_start.items():
                self.stats.misses[Miss(tier.medium, Reason(reason))] += n

    def __bool__(self) -> bool:
        """Whether any tier is configured below host memory."""
        return bool(self.tiers)

    def tier(self, medium: Medium) -> SecondaryIndex:
        """The tier below host of this medium (KeyError if there is none)."""
        return self._by_medium[medium]

    def deepest(self, media: Sequence[Medium]) -> Medium:
        """Of the media a job touches, the one furthest from host (what it waits on)."""
        return next(t.medium for t in reversed(self.tiers) if t.medium in media)

    def report(self) -> BelowReport:
        """A frozen snapshot of the traffic, misses and occupancy below host."""
        s = self.stats
        return BelowReport(
            written_blocks=dict(s.written), written_bytes=dict(s.written_bytes),
            write_failures=dict(s.write_failures),
            write_failure_reasons=dict(s.write_failure_reasons), fetched_blocks=dict(s.fetched),
            fetched_bytes=dict(s.fetched_bytes), fetch_seconds=dict(s.fetch_seconds),
            misses=dict(s.misses), refused=s.refused,
            encoding=self.encoding,
            stores={t.medium.value: t.stats for t in self.tiers},
            lookups_answered_absent=sum(t.answered_absent for t in self.tiers),
            renewed_blocks=dict(s.renewed), renew_failures=dict(s.renew_failures),
            erased_blocks=dict(s.erased), erase_failures=dict(s.erase_failures))

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def take_jobs(self) -> list[Job]:
        jobs, self._outbox = self._outbox, []
        return jobs

    def wait_presence(self, timeout: float = PRESENCE_WAIT_S) -> None:
        """Block until every store has answered what was asked (or `timeout` each)."""
        for tier in self.tiers:
            tier.wait(timeout)

    @property
    def busy(self) -> bool:
        """A job decided or running, or a presence question asked and not yet answered."""
        return bool(self.jobs) or any(t.pending for t in self.tiers)

    # -- down ---------------------------------------------------------------------------

    def host_stored(self, keys: Sequence[BlockKey]) -> None:
        """Blocks that just became complete on host: write them on to every deeper tier."""
        if not keys:
            return
        tokens = [self.host.tokens_of(k) for k in keys]
        parents = [self.host.parent_of(k) for k in keys]  # a slot tier drops a prefix tail first
        where = dict(zip(keys, tokens))
        for tier in self.tiers:
            if isinstance(tier, SlotTier):
                prepared = tier.prepare_store(keys, tokens, parents=parents)
                room = tier.room() if prepared is None else 0
                if room:  # too few slots for all: the leading ones, a prefix's head
                    prepared = tier.prepare_store(keys[:room], tokens[:room],
                                                  parents=parents[:room])
            else:
                prepared = tier.prepare_store(keys, tokens)
            if prepared is None:
                self.stats.refused += 1
            elif prepared.keys:
                self._write(tier.medium, prepared.keys, [where[k] for k in prepared.keys],
                            prepared.slots)

    def _write(self, tier: Medium, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
               slots: Sequence[int]) -> None:
        # The row must not change (or be evicted) while it is read; a hold, not a load.
        self.host.hold(keys)
        host_slots = [self.host.slot_of(k) for k in keys]
        keep = tuple(self.host.tenancy.deadline(k) for k in keys)
        self._add(_Pending(Job(next(self._ids), Medium.HOST, tier, tuple(host_slots),
                               keys=tuple(keys), tokens=tuple(tuple(t) for t in tokens),
                               media=(tier,) * len(keys), below_slots=tuple(slots),
                               keep_until=keep if any(keep) else ())))

    def renew(self, keys: Sequence[BlockKey], until: Sequence[float]) -> None:
        """A retention granted now: every store that expires blocks by itself (a TTL) keeps
        its copies of `keys` at least until `until[i]` (those it lacks stay absent; those
        still being written carry the deadline already)."""
        if not keys:
            return
        for tier in self.tiers:
            if tier.expires:
                self._add(_Pending(Job(next(self._ids), Medium.HOST, tier.medium, (),
                                       keys=tuple(keys), media=(tier.medium,) * len(keys),
                                       keep_until=tuple(until), renew=True)))

    def purge(self, keys: Sequence[BlockKey]) -> dict[Medium, int]:
        """Erase `keys` from every tier below host. A local tier's copies no job pins leave
        its books now and an erase job overwrites their slots (queued ahead of any write
        that could reuse one); a shared store is asked to delete every key (it holds what
        others wrote too). Per medium: the copies dropped, or for a shared store the keys
        asked."""
        keys = list(dict.fromkeys(keys))
        out: dict[Medium, int] = {}
        for tier in self.tiers:
            if isinstance(tier, SlotTier):
                out[tier.medium] = self._erase_slots(tier, keys)
                self._erase_when_free.update(k for k in keys
                                             if tier.storing(k) or tier.present(k))
            else:
                out[tier.medium] = len(keys)
                self._erase(tier.medium, keys, [-1] * len(keys))
        return out

    def _erase_slots(self, tier: SlotTier, keys: Sequence[BlockKey]) -> int:
        """`keys`' copies on a local tier leave its books and their slots are erased (a
        pinned one stays); how many."""
        held = {k: tier.slot_of(k) for k in keys if tier.lookup([k]) == 1}
        tier.remove(list(held))
        gone = [k for k in held if tier.lookup([k]) == 0]
        self._erase(tier.medium, gone, [held[k] for k in gone])
        return len(gone)

    def _erase(self, medium: Medium, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """The erase job of `keys` on `medium` (their slots, or -1 for a store's keys)."""
        if keys:
            self._add(_Pending(Job(next(self._ids), Medium.HOST, medium, (), keys=tuple(keys),
                                   media=(medium,) * len(keys), below_slots=tuple(slots),
                                   erase=True)))

    def holds(self, key: BlockKey) -> bool:
        """Whether a local tier below host (disk) holds `key` complete (Redis is not asked)."""
        return any(t.local and t.lookup([key]) == 1 for t in self.tiers)

    @property
    def shared(self) -> bool:
        """Whether a store other engines read too (Redis, a shared directory) is below host."""
        return any(not t.local for t in self.tiers)

    def local_copy(self, key: BlockKey, tokens: Sequence[int]) -> Medium | None:
        """The nearest local tier holding `key` complete with these token ids, or None: a
        probe among a breakpoint's candidate parts of a block, not counted as a lookup."""
        for t in self.tiers:
            if t.local and isinstance(t, SlotTier) and t.has(key, tokens):
                return t.medium
        return None

    def keeps(self, key: BlockKey) -> bool:
        """Whether a local tier below host holds `key` and keeps it as its retention says
        (`holds`, and where `key` is retained, its retention holds there: a disk whose
        retained share or the owner's quota was full when it arrived holds it as an ordinary
        block). Only then may the host let a retained block go."""
        tenancy = self.host.tenancy
        retained = tenancy.retained(key)
        return any(t.local and t.lookup([key]) == 1 and (
            not retained or tenancy.kept_on(t.medium, key)) for t in self.tiers)

    def write_down_host(self) -> None:
        """Every block complete on host that a local tier lacks goes down (shutdown: so a
        restart finds it)."""
        local = [t for t in self.tiers if t.local]
        if local:
            self.host_stored([k for k in self.host.complete_keys()
                              if any(t.lookup([k]) == 0 for t in local)])

    # -- up -----------------------------------------------------------------------------

    def hits(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
             skip: Collection[str] = ()) -> list[Medium] | None:
        """The tier of each leading key found below host, walking the tiers in order (each
        continues where the one before it stopped); None while a store's answer is still
        on its way (never blocks). Tiers named in `skip` (medium values: the planner's slow
        ones) are not asked: nothing is read from them anyway."""
        found: list[Medium] = []
        for tier in self.tiers:
            if len(found) == len(keys):
                break
            if tier.medium.value in skip:
                continue
            n = tier.lookup(keys[len(found):], tokens[len(found):])
            if n is None:
                return None
            found += [tier.medium] * n
        return found

    def fetch(self, request_id: str, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
              tiers: Sequence[Medium], predict: Callable[[int], float] | None = None,
              cap_s: float = FETCH_DEADLINE_S) -> bool:
        """Bring the leading `keys` up into host slots for `request_id`, as many as the host
        can make room for (the rest is recomputed); False (nothing changed) if none fit.
        `predict(n)`: the planner's seconds for the hop of the first n blocks (scored when
        the fetch lands whole, and the base of its deadline, which `cap_s` caps)."""
        # A retained prefix coming back may push its owner's other retained blocks down to
        # disk (they stay there, retained), as that tenant's stores may; nothing else's.
        tenancy = self.host.tenancy
        owner = tenancy.owner(keys[0]) if keys and tenancy.retained(keys[0]) else ""
        spill = self.keeps if owner else None
        n = min(len(keys), self.host.room(owner, spill))
        keys, tokens, tiers = keys[:n], tokens[:n], tiers[:n]
        if not keys:
            self.stats.refused += 1
            return False
        # the keys are a prefix's run: each one's parent is the one before it
        first = self._by_medium[tiers[0]]
        parents = [first.parent_of(keys[0]) if isinstance(first, SlotTier) else None,
                   *keys[:-1]]
        prepared = self.host.prepare_store(keys, tokens, owner, spill, parents)
        if prepared is None or len(prepared.keys) != len(keys):
            if prepared is not None:
                self.host.complete_store(prepared.keys, False)
            self.stats.refused += 1
            return False
        slots: dict[BlockKey, int] = {}
        for tier in self.tiers:
            mine = [k for k, m in zip(keys, tiers) if m is tier.medium]
            if mine:
                slots.update(zip(mine, tier.prepare_load(mine)))
        predicted = predict(len(keys)) if predict else None
        job = Job(next(self._ids), self.deepest(tiers), Medium.HOST, tuple(prepared.slots),
                  keys=tuple(keys), tokens=tuple(tuple(t) for t in tokens), media=tuple(tiers),
                  below_slots=tuple(slots[k] for k in keys),
                  budget_s=fetch_budget_s(predicted, cap_s))
        self._add(_Pending(job, request_id, predicted))
        return True

    def release(self, request_id: str) -> None:
        """The request was admitted (its load took pins of its own) or went away: its
        fetched blocks may be evicted again, and a fetch of its still in flight pins nothing
        when it lands (nobody is left to release it)."""
        keys = self.held.pop(request_id, None)
        if keys:
            self.host.release(keys)
        for pending in self.jobs.values():
            if pending.request_id == request_id:
                pending.left = True

    @property
    def pinned_for_requests(self) -> int:
        """Host blocks pinned for requests whose fetch landed and that were not admitted yet."""
        return sum(map(len, self.held.values()))

    def _add(self, pending: _Pending) -> None:
        self.jobs[pending.job.id] = pending
        self._outbox.append(pending.job)

    # -- results ------------------------------------------------------------------------

    def owns(self, job_id: int) -> bool:
        return job_id in self.jobs

    def finish(self, outcome: Result) -> FetchDone | None:
        """Apply a finished job; a fetch returns what its request needs to know."""
        done = self._finish(outcome)
        if self._erase_when_free:
            self._erase_freed()
        return done

    def _erase_freed(self) -> None:
        """Erase the purged copies on local tiers that no job holds any more."""
        for key in list(self._erase_when_free):
            held = False
            for tier in self.tiers:
                if isinstance(tier, SlotTier) and (tier.storing(key) or (
                        tier.present(key) and self._erase_slots(tier, [key]) == 0)):
                    held = True
            if not held:
                self._erase_when_free.discard(key)

    def _finish(self, outcome: Result) -> FetchDone | None:
        pending = self.jobs.pop(outcome.job_id)
        t = pending.job
        if t.renew:  # nothing held, nothing stored; a failure was logged where it happened
            kept = sum(outcome.ok)
            self.stats.renewed[t.dst.value] += kept
            if kept < len(t.keys):
                self.stats.renew_failures[t.dst.value] += len(t.keys) - kept
            return None
        if t.erase:  # nothing held; what a store failed to erase is counted and logged
            erased = sum(outcome.ok)
            self.stats.erased[t.dst.value] += erased
            if erased < len(t.keys):
                self.stats.erase_failures[t.dst.value] += len(t.keys) - erased
                log.warning("kvtier: %d blocks could not be erased from the %s tier (%s); "
                            "they stay there", len(t.keys) - erased, t.dst,
                            next(r for r in outcome.reasons if r))
            return None
        failed = [bool(r) and r != SKIPPED for r in outcome.reasons]  # not SKIPPED, not OK
        for medium, reason, bad in zip(t.media, outcome.reasons, failed):
            if bad:
                self._failed(medium, Reason(reason), t.src is Medium.HOST)
        if t.src is Medium.HOST:  # a write; a failed one is a write failure, never a miss
            self.host.release(t.keys)
            good = [k for k, ok in zip(t.keys, outcome.ok) if ok]
            bad_keys = [k for k, ok in zip(t.keys, outcome.ok) if not ok]
            tier = self.tier(t.dst)
            for keys, ok in ((good, True), (bad_keys, False)):
                if keys:
                    tier.complete_store(keys, ok)
            self.stats.written[t.dst.value] += len(good)
            self.stats.written_bytes[t.dst.value] += outcome.nbytes
            self.stats.write_failures[t.dst.value] += len(bad_keys)
            if bad_keys:
                self._log_write_failures(t.dst)
            return None
        # A fetch serves only its leading verified run: a prefix cannot skip a block.
        n = next((i for i, ok in enumerate(outcome.ok) if not ok), len(t.keys))
        if n:
            self.host.complete_store(t.keys[:n], True)
            # Pinned until its request is admitted, while holds leave half the host to
            # stores and other fetches (requests waiting on device room must not starve it).
            # A request that left meanwhile gets no pin: the blocks stay as ordinary ones.
            if not pending.left and \
                    self.pinned_for_requests + n <= self.host.num_slots // 2:
                self.host.hold(t.keys[:n])
                self.held[pending.request_id] = list(t.keys[:n])
        if n < len(t.keys):
            self.host.complete_store(t.keys[n:], False)
        whole_ok = all(outcome.ok)
        late = [r == Reason.DEADLINE for r in outcome.reasons]  # slow, not bad: kept below
        for tier in self.tiers:
            mine = [i for i, m in enumerate(t.media) if m is tier.medium]
            if mine:
                tier.complete_fetch([t.keys[i] for i in mine], sum(1 for i in mine if i < n),
                                    [t.keys[i] for i in mine if failed[i] and not late[i]],
                                    whole_ok)
        for medium in t.media[:n]:
            self.stats.fetched[medium.value] += 1
        source = self.deepest(t.media[:n]) if n else None
        if source is not None:
            self.stats.fetched_bytes[source.value] += outcome.nbytes  # as stored
            self.stats.fetch_seconds[source.value] += outcome.seconds
        whole = n == len(t.keys)
        # The tier still reading when the deadline passed is slow, unless the fetch spent
        # most of its budget queued behind other I/O (then no tier is to blame).
        slow = next((m for m, lost in zip(t.media, late) if lost), None)
        if slow is not None and outcome.seconds < (t.budget_s or 0.0) / 2:
            slow = None
        return FetchDone(pending.request_id, n, source, missed=len(t.keys) - n,
                         predicted_s=pending.predicted_s if whole else None, slow=slow,
                         seconds=outcome.seconds, finished_at=outcome.finished_at)

    def _failed(self, tier: Medium, reason: Reason, writing: bool) -> None:
        """A block not written (counted by reason here; `_log_write_failures` tells) or not
        served (a miss, here), a miss logged once per tier and reason."""
        miss = Miss(tier, reason)
        if writing:
            self.stats.write_failure_reasons[miss] += 1
            return
        self.stats.misses[miss] += 1
        if miss not in self._logged:
            self._logged.add(miss)
            log.warning("kvtier: a block fetched from the %s tier failed (%s); it is a "
                        "miss, never served, and its tokens are recomputed (logged once "
                        "per tier and reason)", tier, reason)

    def _log_write_failures(self, tier: Medium) -> None:
        """Writes to `tier` failed: say so with the counts so far, at most once per
        WRITE_LOG_S per tier (a store that keeps failing is heard from again)."""
        now = time.monotonic()
        last = self._write_logged_at.get(tier)
        if last is not None and now - last < WRITE_LOG_S:
            return
        self._write_logged_at[tier] = now
        counts = {m.reason.value: n for m, n in self.stats.write_failure_reasons.items()
                  if m.medium is tier}
        hint = ("; a store that times out may be starved of CPU: raise remote_write_timeout_s"
                if Reason.TIMEOUT.value in counts else "")
        log.warning("kvtier: %d block(s) failed to be written to the %s tier so far (%s); they "
                    "are not stored there and a later wake recomputes them%s (logged at most "
                    "every %gs per tier)", self.stats.write_failures[tier.value], tier,
                    ", ".join(f"{r}: {n}" for r, n in sorted(counts.items())), hint,
                    WRITE_LOG_S)
