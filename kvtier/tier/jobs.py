"""One job type for every hop the tier makes, one result type, and the events a client gets.

A `Job` names its source and destination medium; the worker routes it by that pair:
    DEVICE -> HOST   store: device blocks into host slots
    HOST -> DEVICE   load: host slots into freshly allocated device blocks (maybe layerwise)
    HOST -> a store below  write: host rows down to a deeper tier, one header per block (or
                           no bytes: a renewal of its TTLs, an erase of its copies)
    a store below -> HOST  fetch: blocks up into host rows, verified before they count
Ids are assigned by the manager (one counter for every hop), so a client maps nothing.
Events are what `TierManager.apply` hands back: `LoadDone` and `FetchDone` for the request
that waits, `StoreDone` for whoever owns the device blocks (free or uncache them now).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.tier.keys import BlockKey, Medium


class Reason(str, enum.Enum):
    """Why a block below host was not written or not served: a bounded set, so every value
    can be a metric label. The block's own bytes (FINGERPRINT ... FIELD: dropped from its
    tier), the medium (MISSING ... DEADLINE: kept), or SKIPPED (not read after an earlier
    block of the same prefix failed: not its fault)."""

    OK = ""
    SKIPPED = "skipped"
    FINGERPRINT = "fingerprint"  # another model, layout or tenant wrote it
    KEY = "key"
    TOKENS = "tokens"
    SIZE = "size"
    CHECKSUM = "checksum"  # payload bytes changed
    MAC = "mac"  # no valid MAC under this deployment's secret: forged, or another secret's
    MAGIC = "magic"  # CorruptBlock's reasons: the header itself is unusable
    VERSION = "version"
    TRUNCATED = "truncated"
    HEADER_CHECKSUM = "header-checksum"
    FIELD = "field"
    MISSING = "missing"  # expired, evicted or deleted since the lookup
    UNAVAILABLE = "unavailable"  # the store did not answer (down, breaker open)
    IO = "io"  # the medium failed (an OSError); its text is logged, never a label
    NO_SPACE = "no-space"  # ENOSPC / EDQUOT: the medium is full
    ERROR = "error"  # an unexpected exception on the I/O thread (logged)
    CLOSED = "closed"  # the tier shut down before the job ran
    TIMEOUT = "timeout"  # a write the store did not acknowledge in time (a slow store)
    DEADLINE = "deadline"  # a fetch's deadline passed before it landed (never dropped)

    def __str__(self) -> str:
        return self.value

    @property
    def bad_block(self) -> bool:
        """The block's bytes are wrong (drop it where it lives), not the medium."""
        return self in _BAD_BLOCK


_BAD_BLOCK = frozenset({Reason.FINGERPRINT, Reason.KEY, Reason.TOKENS, Reason.SIZE,
                        Reason.CHECKSUM, Reason.MAC, Reason.MAGIC, Reason.VERSION,
                        Reason.TRUNCATED, Reason.HEADER_CHECKSUM, Reason.FIELD})


@dataclass(frozen=True)
class Miss:
    """A block below host not served, or not written, by store and reason: what the miss
    counters are keyed by; "medium:reason" only where a user reads it."""

    medium: Medium
    reason: Reason

    def __str__(self) -> str:  # "disk:checksum"
        return f"{self.medium.value}:{self.reason.value}"


@dataclass(frozen=True)
class Job:
    """Copy block i between `host_slots[i]` and the other side (a device block or a deeper
    tier's copy of `keys[i]`), in the direction `src -> dst`."""

    id: int
    src: Medium
    dst: Medium
    host_slots: tuple[int, ...]
    device_blocks: tuple[int, ...] = ()  # DEVICE <-> HOST: block i <-> host_slots[i]
    layerwise: bool = False  # HOST -> DEVICE: layer 0 of every block first, then layer 1...
    keys: tuple[BlockKey, ...] = ()  # below host: the key each block's header carries
    tokens: tuple[tuple[int, ...], ...] = ()  # below host: its token ids (verified on fetch)
    media: tuple[Medium, ...] = ()  # below host, per key: the deeper tier it lives on
    below_slots: tuple[int, ...] = ()  # below host, per key: its slot there, -1 if slotless
    # a fetch: seconds it may take from the moment the worker's I/O receives it (queueing
    # included); what has not landed by then is a miss (Reason.DEADLINE). None: no deadline
    budget_s: float | None = None
    # a write, per key: the retention deadline (Unix time, 0: none) a store that expires its
    # blocks must keep it to (Redis: a TTL that long at least); () when no key is retained
    keep_until: tuple[float, ...] = ()
    # a write of no bytes (host_slots empty): the stored `keys` are kept at least until
    # `keep_until` (a retention granted after they went down to a store that expires them)
    renew: bool = False
    # a write of no bytes: the stored `keys` (at `below_slots`) are erased where they live,
    # a disk slot overwritten whole, a file or a key deleted (a purge)
    erase: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.host_slots)

    @property
    def below_host(self) -> bool:
        return Medium.DEVICE not in (self.src, self.dst)


@dataclass(frozen=True)
class Result:
    """How a job ended, per block: `ok[i]`, and `reasons[i]` ("" where ok) otherwise.

    Below host, reasons are `Reason` members (the labels metrics carry); a device <-> host
    copy's error is its text. A failed block is a miss, never a load: its partial bytes are
    the caller's to discard."""

    job_id: int
    ok: tuple[bool, ...]
    reasons: tuple[str, ...]
    nbytes: int
    seconds: float
    finished_at: float = 0.0  # time.perf_counter() when the job ended (0: unknown)

    @property
    def success(self) -> bool:
        return all(self.ok)

    @classmethod
    def whole(cls, job_id: int, num_blocks: int, success: bool, nbytes: int, seconds: float,
              error: str | None = None, finished_at: float = 0.0) -> Result:
        """A job that succeeds or fails as one (a device <-> host copy)."""
        reason = "" if success else (error or "failed")
        return cls(job_id, (success,) * num_blocks, (reason,) * num_blocks, nbytes, seconds,
                   finished_at)


SKIPPED = Reason.SKIPPED  # a block after a failed one in the same job: not its fault


@dataclass(frozen=True)
class LoadDone:
    """A host -> device load finished; on failure its tokens are recomputed."""

    request_id: str
    job_id: int
    success: bool
    num_blocks: int
    nbytes: int
    seconds: float
    finished_at: float = 0.0  # time.perf_counter() when it ended: the state was ready then


@dataclass(frozen=True)
class FetchDone:
    """A fetch up to host finished: its leading `fetched` blocks are on host now."""

    request_id: str
    fetched: int
    source: Medium | None  # the deepest tier a fetched block came from
    missed: int = 0  # blocks asked for that did not come up (failed, or after a failure)
    predicted_s: float | None = None  # the hop's predicted seconds, for a whole fetch only
    # the tier that was still reading when the fetch's deadline passed (None: it met it, or
    # it waited most of its budget in the worker's queue: no tier's fault)
    slow: Medium | None = None
    seconds: float = 0.0  # the I/O thread's time on it (a write's pieces it waited out apart)
    finished_at: float = 0.0  # time.perf_counter() when it ended (0: unknown)


@dataclass(frozen=True)
class StoreDone:
    """A device -> host store finished: the device blocks' extra reference can go now.

    `evict_first`: they were taken from the eviction end (write-back, demotion) and go back
    there; `demote`: on success their device copy should be forgotten (idle demotion)."""

    job_id: int
    device_blocks: tuple[int, ...]
    success: bool
    demote: bool = False
    evict_first: bool = False


Event = LoadDone | FetchDone | StoreDone
