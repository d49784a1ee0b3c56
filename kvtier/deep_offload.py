"""The scheduler's side of the tiers below host memory: what goes down, what comes back up.

Deeper tiers (disk, a shared Redis) are staged through host memory, two hops each way:
  down  a block whose host store completed is written on to every deeper tier (`host_stored`);
        its host slot is pinned until the write lands, so the bytes cannot change under it
  up    a waiting request whose prefix continues below host fetches those blocks into fresh
        host slots (`fetch`); once they verify, the ordinary host -> device wake takes over
A fetched block is served only if its header (fingerprint, key, token ids) and payload
checksum verify on the I/O thread; anything else is a miss, dropped from its tier, counted
by reason and logged once, and those tokens are recomputed. Bookkeeping only: bytes move in
`transfer/tier_io.py` once the engine submits the jobs.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.cache.block import BlockKey
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

DISK, REMOTE = "disk", "remote"
SKIPPED = "skipped"  # the I/O thread's reason for a block after a failed one: not its fault


@dataclass(frozen=True)
class TierTransfer:
    """A job for the tier I/O thread: host rows <-> a deeper tier, one entry per key."""

    ref: int
    kind: Literal["write", "fetch"]
    keys: tuple[BlockKey, ...]
    tokens: tuple[tuple[int, ...], ...]
    host_slots: tuple[int, ...]
    tiers: tuple[str, ...]  # per key: "disk" or "remote" (a write's destination)
    disk_slots: tuple[int, ...]  # per key: its disk slot, -1 where the tier is remote


@dataclass(frozen=True)
class TierOutcome:
    """What the I/O thread reports: per key, whether it landed (and verified), and why not."""

    ref: int
    ok: tuple[bool, ...]
    reasons: tuple[str, ...]  # "" where ok; e.g. "checksum", "tokens", "missing", "io"
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class FetchDone:
    request_id: str
    fetched: int  # leading blocks now complete on host
    source: str | None  # the deepest tier a fetched block came from
    missed: int = 0  # blocks asked for that did not come up (failed, or after a failure)


@dataclass
class DeepStats:
    written: Counter[str] = field(default_factory=Counter)  # blocks, per tier
    written_bytes: Counter[str] = field(default_factory=Counter)  # as stored (encoded)
    write_failures: Counter[str] = field(default_factory=Counter)
    fetched: Counter[str] = field(default_factory=Counter)
    fetched_bytes: Counter[str] = field(default_factory=Counter)
    misses: Counter[str] = field(default_factory=Counter)  # "tier:reason" -> blocks not served
    refused: int = 0  # writes or fetches the host or disk tier had no room for


@dataclass
class _Job:
    transfer: TierTransfer
    request_id: str | None = None
    predicted_s: float | None = None


class DeepOffload:
    """Coordinates the host tier's slots with the disk and remote tiers for the scheduler."""

    def __init__(self, host: HostTier, disk: DiskTier | None, remote: RemoteTier | None,
                 block_bytes: int, encoding: str = "") -> None:
        self.host, self.disk, self.remote = host, disk, remote
        self.block_bytes = block_bytes
        self.encoding = encoding  # "" exact, or the lossy encoding of every block below host
        self.jobs: dict[int, _Job] = {}
        self.held: dict[str, list[BlockKey]] = {}  # request -> fetched keys pinned on host
        self._outbox: list[TierTransfer] = []
        self._refs = itertools.count()
        self._logged: set[str] = set()
        self.stats = DeepStats()

    def take_jobs(self) -> list[TierTransfer]:
        jobs, self._outbox = self._outbox, []
        return jobs

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

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

    def _write(self, tier: str, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
               disk_slots: Sequence[int]) -> None:
        host_slots = self.host.prepare_load(keys)  # the row must not change while it is read
        self._add(_Job(TierTransfer(next(self._refs), "write", tuple(keys),
                                    tuple(tuple(t) for t in tokens), tuple(host_slots),
                                    (tier,) * len(keys), tuple(disk_slots))))

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

    def hits(self, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]]) -> list[str]:
        """The tier of each leading key found below host (disk first, then remote)."""
        found: list[str] = []
        if self.disk is not None:
            found += [DISK] * self.disk.lookup(keys, tokens)
        if self.remote is not None and len(found) < len(keys):
            found += [REMOTE] * self.remote.lookup(keys[len(found):])
        return found

    def fetch(self, request_id: str, keys: Sequence[BlockKey], tokens: Sequence[Sequence[int]],
              tiers: Sequence[str], predicted_s: float | None = None) -> bool:
        """Bring the leading `keys` up into host slots for `request_id`, as many as the host
        can make room for (the rest is recomputed); False (nothing changed) if none fit."""
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
        transfer = TierTransfer(next(self._refs), "fetch", tuple(keys),
                                tuple(tuple(t) for t in tokens), tuple(prepared.slots),
                                tuple(tiers), tuple(slots.get(k, -1) for k in keys))
        self._add(_Job(transfer, request_id, predicted_s))
        return True

    def release(self, request_id: str) -> None:
        """The request was admitted (its load took pins of its own) or went away: its
        fetched blocks may be evicted again."""
        keys = self.held.pop(request_id, None)
        if keys:
            self.host.release(keys)

    def _add(self, job: _Job) -> None:
        self.jobs[job.transfer.ref] = job
        self._outbox.append(job.transfer)

    # -- results ------------------------------------------------------------------------

    def finish(self, outcome: TierOutcome) -> FetchDone | None:
        """Apply a finished job; a fetch returns what its request needs to know."""
        job = self.jobs.pop(outcome.ref)
        t = job.transfer
        good = [k for k, ok in zip(t.keys, outcome.ok) if ok]
        bad = [k for k, ok in zip(t.keys, outcome.ok) if not ok]
        for tier, reason in zip(t.tiers, outcome.reasons):
            if reason:
                self._miss(tier, reason, t.kind)
        if t.kind == "write":
            self.host.complete_load(t.keys)
            tier = t.tiers[0]
            if tier == DISK:
                assert self.disk is not None
                for keys, ok in ((good, True), (bad, False)):
                    if keys:
                        self.disk.complete_store(keys, ok)
            else:
                assert self.remote is not None
                self.remote.complete_store(good, True)
                self.remote.complete_store(bad, False)
            self.stats.written[tier] += len(good)
            self.stats.written_bytes[tier] += outcome.nbytes
            self.stats.write_failures[tier] += len(bad)
            return None
        # A fetch serves only its leading verified run: a prefix cannot skip a block.
        n = next((i for i, ok in enumerate(outcome.ok) if not ok), len(t.keys))
        if n:
            self.host.complete_store(t.keys[:n], True)
            assert job.request_id is not None
            # Pinned until its request is admitted, while holds leave half the host to
            # stores and other fetches (requests waiting on device room must not starve it).
            if sum(map(len, self.held.values())) + n <= self.host.num_slots // 2:
                self.host.hold(t.keys[:n])
                self.held[job.request_id] = list(t.keys[:n])
        if n < len(t.keys):
            self.host.complete_store(t.keys[n:], False)
        disk_keys = [k for k, tier in zip(t.keys, t.tiers) if tier == DISK]
        if disk_keys:
            assert self.disk is not None
            self.disk.complete_load(disk_keys, success=not bad)
            dropped = [k for k, tier, r in zip(t.keys, t.tiers, outcome.reasons)
                       if tier == DISK and r and r != SKIPPED]
            self.disk.remove(dropped)  # failed verification or I/O: never a hit again
        if self.remote is not None:
            remote_n = sum(1 for tier in t.tiers[:n] if tier == REMOTE)
            remote_bad = sum(1 for tier, r in zip(t.tiers, outcome.reasons)
                             if tier == REMOTE and r and r != SKIPPED)
            self.remote.complete_load(remote_n, remote_bad)
        for tier in t.tiers[:n]:
            self.stats.fetched[tier] += 1
        source = REMOTE if REMOTE in t.tiers[:n] else DISK if n else None
        if source is not None:
            self.stats.fetched_bytes[source] += outcome.nbytes  # as stored: encoded if lossy
        assert job.request_id is not None
        return FetchDone(job.request_id, n, source, missed=len(t.keys) - n)

    def _miss(self, tier: str, reason: str, kind: str) -> None:
        if reason == SKIPPED:
            return
        label = f"{tier}:{reason}"
        self.stats.misses[label] += 1
        if label not in self._logged:
            self._logged.add(label)
            what = ("writing a block to" if kind == "write" else "a block fetched from")
            log.warning("kvtier: %s the %s tier failed (%s); it is a miss, never served, and "
                        "its tokens are recomputed (logged once per tier and reason)",
                        what, tier, reason)
