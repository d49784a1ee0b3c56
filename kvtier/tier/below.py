"""The scheduler's side of the tiers below host memory: what goes down, what comes back up.

Deeper tiers (disk, a shared Redis) are staged through host memory, two hops each way:
  down  a block whose host store completed is written on to every deeper tier (`host_stored`);
        its host slot is pinned until the write lands, so the bytes cannot change under it
  up    a waiting request whose prefix continues below host fetches those blocks into fresh
        host slots (`fetch`); once they verify, the ordinary host -> device wake takes over
A fetched block is served only if its header (fingerprint, key, token ids) and payload
checksum verify on the I/O thread; anything else is a miss, dropped from its tier, counted
by reason and logged once, and those tokens are recomputed. Bookkeeping only: bytes move in
`worker/io.py` once the client submits the jobs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.tier.index.disk import DiskTier
from kvtier.tier.index.host import HostTier
from kvtier.tier.index.remote import RemoteTier
from kvtier.tier.jobs import SKIPPED, FetchDone, Job, Result
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import BelowReport

log = logging.getLogger(__name__)
DISK, REMOTE = Medium.DISK, Medium.REMOTE
PRESENCE_WAIT_S = 1.0


@dataclass
class BelowStats:
    written: Counter[str] = field(default_factory=Counter)  # blocks, per tier
    written_bytes: Counter[str] = field(default_factory=Counter)  # as stored (encoded)
    write_failures: Counter[str] = field(default_factory=Counter)
    fetched: Counter[str] = field(default_factory=Counter)
    fetched_bytes: Counter[str] = field(default_factory=Counter)
    fetch_seconds: Counter[str] = field(default_factory=Counter)  # the hop's I/O time
    misses: Counter[str] = field(default_factory=Counter)  # "tier:reason" -> blocks not served
    refused: int = 0  # writes or fetches the host or disk tier had no room for


@dataclass
class _Pending:
    job: Job
    request_id: str | None = None
    predicted_s: float | None = None


class BelowHost:
    """Coordinates the host tier's slots with the disk and remote tiers for the manager."""

    def __init__(self, host: HostTier, disk: DiskTier | None, remote: RemoteTier | None,
                 block_bytes: int, ids: Iterator[int], encoding: str = "") -> None:
        self.host, self.disk, self.remote = host, disk, remote
        self.block_bytes = block_bytes  # bytes of one block as the tiers below store it
        self.encoding = encoding  # "" exact, or the lossy encoding of every block below host
        self.jobs: dict[int, _Pending] = {}
        self.held: dict[str, list[BlockKey]] = {}  # request -> fetched keys pinned on host
        self._outbox: list[Job] = []
        self._ids = ids
        self._logged: set[tuple[bool, str]] = set()
        self.stats = BelowStats()
        if disk is not None:  # found on disk at start and refused: misses, by reason
            for reason, n in disk.unusable_at_start.items():
                self.stats.misses[f"{DISK.value}:{reason}"] += n

    def report(self) -> BelowReport:
        """A frozen snapshot of the traffic, misses and occupancy below host."""
        s = self.stats
        return BelowReport(
            written_blocks=dict(s.written), written_bytes=dict(s.written_bytes),
            write_failures=dict(s.write_failures), fetched_blocks=dict(s.fetched),
            fetched_bytes=dict(s.fetched_bytes), fetch_seconds=dict(s.fetch_seconds),
            misses=dict(s.misses), refused=s.refused,
            encoding=self.encoding,
            disk=self.disk.stats if self.disk is not None else None,
            remote=self.remote.stats if self.remote is not None else None,
            lookups_answered_absent=(self.remote.presence.errors if self.remote is not None
                                     else 0))

    def take_jobs(self) -> list[Job]:
        jobs, self._outbox = self._outbox, []
        return jobs

    def wait_presence(self, timeout: float = PRESENCE_WAIT_S) -> None:
        """Block until the remote store has answered what was asked (or `timeout`)."""
        if self.remote is not None:
            self.remote.presence.wait(timeout)

    @property
    def busy(self) -> bool:
        """A job decided or running, or a presence question asked and not yet answered."""
        return bool(self.jobs) or (self.remote is not None and self.remote.pending)

    # -- down ---------------------------------------------------------------------------

    def host_stored(self, keys: Sequence[BlockKey]) -> None:
        """Blocks that just became complete on host: write them on to every deeper tier."""
        if not keys:
            return
        tokens = [self.host.tokens_of(k) for k in keys]
        if self.disk is not None:
            prepared = self.disk.prepare_store(keys, tokens)
            if prepared is None:
                self.stats.refused += 1
            elif prepared.keys:
                where = dict(zip(keys, tokens))
                self._write(DISK, prepared.keys, [where[k] for k in prepared.keys],
                            prepared.slots)
        if self.remote is not None:
            new = self.remote.prepare_store(keys)
            if new:
                where = dict(zip(keys, tokens))
                self._write(REMOTE, new, [where[k] for k in new], [-1] * len(new))

    def _write(self, tier: Medium, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
               disk_slots: Sequence[int]) -> None:
        # The row must not change (or be evicted) while it is read; a hold, not a load.
        self.host.hold(keys)
        host_slots = [self.host.slot_of(k) for k in keys]
        self._add(_Pending(Job(next(self._ids), Medium.HOST, tier, tuple(host_slots),
                               keys=tuple(keys), tokens=tuple(tuple(t) for t in tokens),
                               media=(tier,) * len(keys), disk_slots=tuple(disk_slots))))

    def on_disk(self, key: BlockKey) -> bool:
        """Whether the disk tier holds `key` complete (a local answer; Redis is not asked)."""
        return self.disk is not None and self.disk.lookup([key]) == 1

    def write_down_host(self) -> None:
        """Every block complete on host that the disk tier lacks goes down (shutdown: so a
        restart finds it)."""
        if self.disk is None:
            return
        self.host_stored([k for k in self.host.complete_keys() if self.disk.lookup([k]) == 0])

    # -- up -----------------------------------------------------------------------------

    def hits(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]]
             ) -> list[Medium] | None:
        """The tier of each leading key found below host (disk first, then remote); None
        while the remote store's answer is still on its way (never blocks)."""
        found: list[Medium] = []
        if self.disk is not None:
            found += [DISK] * self.disk.lookup(keys, tokens)
        if self.remote is not None and len(found) < len(keys):
            remote = self.remote.lookup(keys[len(found):])
            if remote is None:
                return None
            found += [REMOTE] * remote
        return found

    def fetch(self, request_id: str, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
              tiers: Sequence[Medium], predict: Callable[[int], float] | None = None) -> bool:
        """Bring the leading `keys` up into host slots for `request_id`, as many as the host
        can make room for (the rest is recomputed); False (nothing changed) if none fit.
        `predict(n)`: the planner's seconds for the hop of the first n blocks (scored when
        the fetch lands whole)."""
        n = min(len(keys), self.host.room)
        keys, tokens, tiers = keys[:n], tokens[:n], tiers[:n]
        if not keys:
            self.stats.refused += 1
            return False
        prepared = self.host.prepare_store(keys, tokens)
        if prepared is None or len(prepared.keys) != len(keys):
            if prepared is not None:
                self.host.complete_store(prepared.keys, False)
            self.stats.refused += 1
            return False
        disk_keys = [k for k, t in zip(keys, tiers) if t == DISK]
        slots = dict(zip(disk_keys, self.disk.prepare_load(disk_keys))) if disk_keys else {}
        src = REMOTE if REMOTE in tiers else DISK
        job = Job(next(self._ids), src, Medium.HOST, tuple(prepared.slots), keys=tuple(keys),
                  tokens=tuple(tuple(t) for t in tokens), media=tuple(tiers),
                  disk_slots=tuple(slots.get(k, -1) for k in keys))
        self._add(_Pending(job, request_id, predict(len(keys)) if predict else None))
        return True

    def release(self, request_id: str) -> None:
        """The request was admitted (its load took pins of its own) or went away: its
        fetched blocks may be evicted again."""
        keys = self.held.pop(request_id, None)
        if keys:
            self.host.release(keys)

    def _add(self, pending: _Pending) -> None:
        self.jobs[pending.job.id] = pending
        self._outbox.append(pending.job)

    # -- results ------------------------------------------------------------------------

    def finish(self, outcome: Result) -> FetchDone | None:
        """Apply a finished job; a fetch returns what its request needs to know."""
        pending = self.jobs.pop(outcome.job_id)
        t = pending.job
        good = [k for k, ok in zip(t.keys, outcome.ok) if ok]
        bad = [k for k, ok in zip(t.keys, outcome.ok) if not ok]
        writing = t.src is Medium.HOST
        for tier, reason in zip(t.media, outcome.reasons):
            if reason and reason != SKIPPED:
                self._failed(tier, str(reason), writing)
        if writing:  # a failed write is a write failure, never also a miss
            self.host.release(t.keys)
            tier = t.dst
            if tier == DISK:
                assert self.disk is not None
                for keys, ok in ((good, True), (bad, False)):
                    if keys:
                        self.disk.complete_store(keys, ok)
            else:
                assert self.remote is not None
                self.remote.complete_store(good, True)
                self.remote.complete_store(bad, False)
            self.stats.written[tier.value] += len(good)
            self.stats.written_bytes[tier.value] += outcome.nbytes
            self.stats.write_failures[tier.value] += len(bad)
            return None
        # A fetch serves only its leading verified run: a prefix cannot skip a block.
        n = next((i for i, ok in enumerate(outcome.ok) if not ok), len(t.keys))
        if n:
            self.host.complete_store(t.keys[:n], True)
            assert pending.request_id is not None
            # Pinned until its request is admitted, while holds leave half the host to
            # stores and other fetches (requests waiting on device room must not starve it).
            if sum(map(len, self.held.values())) + n <= self.host.num_slots // 2:
                self.host.hold(t.keys[:n])
                self.held[pending.request_id] = list(t.keys[:n])
        if n < len(t.keys):
            self.host.complete_store(t.keys[n:], False)
        disk_keys = [k for k, tier in zip(t.keys, t.media) if tier == DISK]
        if disk_keys:
            assert self.disk is not None
            self.disk.complete_load(disk_keys, success=not bad)
            dropped = [k for k, tier, r in zip(t.keys, t.media, outcome.reasons)
                       if tier == DISK and r and r != SKIPPED]
            self.disk.remove(dropped)  # failed verification or I/O: never a hit again
        if self.remote is not None:
            remote_n = sum(1 for tier in t.media[:n] if tier == REMOTE)
            remote_bad = sum(1 for tier, r in zip(t.media, outcome.reasons)
                             if tier == REMOTE and r and r != SKIPPED)
            self.remote.complete_load(remote_n, remote_bad)
        for tier in t.media[:n]:
            self.stats.fetched[tier.value] += 1
        source = REMOTE if REMOTE in t.media[:n] else DISK if n else None
        if source is not None:
            self.stats.fetched_bytes[source.value] += outcome.nbytes  # as stored
            self.stats.fetch_seconds[source.value] += outcome.seconds
        assert pending.request_id is not None
        whole = n == len(t.keys)
        return FetchDone(pending.request_id, n, source, missed=len(t.keys) - n,
                         predicted_s=pending.predicted_s if whole else None)

    def _failed(self, tier: Medium, reason: str, writing: bool) -> None:
        """A block not written (counted in `written`'s failures by the caller) or not
        served (a miss, here), logged once per tier, direction and reason."""
        label = f"{tier.value}:{reason}"
        if not writing:
            self.stats.misses[label] += 1
        if (writing, label) not in self._logged:
            self._logged.add((writing, label))
            if writing:
                log.warning("kvtier: writing a block to the %s tier failed (%s); it is not "
                            "stored there (logged once per tier and reason)", tier, reason)
            else:
                log.warning("kvtier: a block fetched from the %s tier failed (%s); it is a "
                            "miss, never served, and its tokens are recomputed (logged once "
                            "per tier and reason)", tier, reason)
