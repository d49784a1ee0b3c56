"""Bytes between host-pool rows and the tiers below host memory (`stores.SecondaryStore`s:
a disk file, Redis).

Primitives:
  submit(job)                  a write (host rows -> tier), a fetch (tier -> host rows), or a
                               renewal (a retention granted later reaches a store's TTLs)
  poll() -> [Result]           jobs finished since the last poll; never blocks
  wait_any()                   block until a job finishes
  wait_fetches(timeout)        block until no fetch is queued or running (an idle caller)
  close()                      stop the thread; unfinished jobs fail (and count as misses)
One I/O thread, fetches first (a request waits on them; a write yields to one between its
pieces). Every fetched block is checked on
this thread before its row is handed back: header, fingerprint, key, token ids and payload
checksum (`block_format.check`), and for Redis under a secret its MAC (`block_mac.py`). A
block that fails is invalidated where it lives (the disk slot's header is wiped, the Redis
key deleted) so it is never read again. After a failure nothing of that prefix is served
(a prefix cannot skip a block), but its remaining blocks are still verified (disk blocks
read, Redis blocks already in this job's MGETs: no extra round trip), so every bad one
leaves its tier in one fetch: a forged prefix is deleted whole, not a block per wake.
I/O errors and an unreachable Redis are failures of the job's keys, never exceptions out
of this thread. Every reason is a bounded `Reason`; the text of an error (strerror, an
exception) is logged once per tier and reason, never a label.

A fetch's deadline is its `Job.budget_s` from the moment `submit` receives it (time queued
behind a write counts): no read starts after it (a Redis reply is cut mid-value, its
connection retired), the leading blocks that landed and verify are served, and every block
not landed is a miss, Reason.DEADLINE, kept where it lives. The deadline also bounds the
I/O thread itself: a fetch still queued when its deadline passes (the thread held by a store
call that has not returned: a hung mount, a peer that never answers) is failed by the
caller's next poll or wait, every block DEADLINE, without the thread. Only the fetch whose
call hangs waits for it: its host rows are being written, and cannot be handed back early.

Only the remote tier carries a MAC. Whoever can write a shared Redis is another party; the
disk tier's slot file is 0600 in a 0700 directory owned by the serving user, so whoever can
write it is that user or root, who could equally replace the weights or the code. A MAC
there would stop no one new, and would cost the disk wake path a keyed hash at ~5 GB/s
instead of xxh3 at ~23 GB/s (benchmarks/block_mac.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.tier.faults import MAX_DELAY_S, BelowFault, DelayFault, no_below_fault, no_delay
from kvtier.tier.io.block_format import (
    BlockHeader,
    copy_into,
    payload_checksum,
    tensor_bytes,
)
from kvtier.tier.io.store import BlockReads, SecondaryStore, StoreMiss, batches
from kvtier.tier.io.verify import read_verified
from kvtier.tier.jobs import Job, Reason, Result
from kvtier.tier.keys import Medium
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.threads import use_one_thread

log = logging.getLogger(__name__)

_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
# A write goes down in pieces of about this many bytes; a fetch queued meanwhile runs
# between two pieces. On a 2-core machine a 5.9 MB block took ~10 ms to write beside compute,
# while a whole 16-block write-on held a wake for ~165 ms.
WRITE_PIECE_BYTES = 8 << 20
# After a fetch, writes wait this long (unless another fetch comes): the woken request's
# host -> device load and forward pass then run without a write-on beside them. Measured
# under vLLM (2 cores, a 94 MB disk wake): the load took 44 ms instead of 11 with the write
# running, the TTFT 238-325 ms instead of 179-195.
WAKE_QUIET_S = 0.25
READERS = 2  # threads that read and verify a fetch's blocks

class TierIO:
    """Runs tier jobs on one thread against its stores (none: no thread, and no job may
    come); `fault` fails chosen blocks (tests): a fetch with that `Reason`, a write as an
    OSError of that text; `delay` makes chosen blocks of a fetch slow to read (tests)."""

    def __init__(self, host: HostPool, namespace: bytes, stores: Sequence[SecondaryStore] = (),
                 fault: BelowFault = no_below_fault, delay: DelayFault = no_delay) -> None:
        self.host, self.namespace = host, namespace
        self.stores = {s.medium: s for s in stores}
        self.encoding = host.encoding  # a row's bytes go down as they are: encoded or not
        self.fault, self.delay = fault, delay
        self._deadlines: dict[int, float] = {}  # a fetch's job id -> its time.monotonic() end
        self._logged: set[tuple[Medium, Reason]] = set()  # touched by the I/O thread only
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._done: dict[int, Result] = {}
        self._order: dict[int, int] = {}  # job id -> submission order, for delivery
        self._submitted = 0
        self._fetches = 0  # fetches submitted and not finished
        self._closing = False
        self._yielded = 0.0  # I/O thread only: fetch seconds inside the job being timed
        self._quiet_until = 0.0  # I/O thread only: writes wait until then after a fetch
        # threads that read and verify one fetch's blocks side by side (an engine waiting on a
        # wake computes nothing meanwhile): a 94 MB disk fetch took 24 ms on one thread
        self._readers = ThreadPoolExecutor(READERS, "kvtier-tier-read", use_one_thread)
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-io", daemon=True)
        if self.stores:
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job` (its id is the caller's); fetches go ahead of background writes, and
        a fetch's deadline clock starts now."""
        received = time.monotonic()
        with self._cond:
            if self._closing:
                raise RuntimeError("tier I/O is closed")
            assert job.src in self.stores or job.dst in self.stores, f"no store for job {job.id}"
            self._order[job.id] = self._submitted
            self._submitted += 1
            if job.dst is Medium.HOST:  # a fetch: a request waits on it
                if job.budget_s is not None:
                    self._deadlines[job.id] = received + job.budget_s
                self._queue.appendleft(job)
                self._fetches += 1
            else:
                self._queue.append(job)
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        with self._cond:
            return bool(self._order)

    def poll(self) -> list[Result]:
        with self._cond:
            self._expire()
            done = sorted(self._done.values(), key=lambda r: self._order[r.job_id])
            for r in done:
                del self._order[r.job_id]
            self._done.clear()
            return done

    def wait_any(self, timeout: float | None = None) -> list[Result]:
        """Block until at least one job has finished (or `timeout`); deliver all finished."""
        self._wait(lambda: bool(self._done) or self._closing, timeout)
        return self.poll()

    def wait_fetches(self, timeout: float) -> list[Result]:
        """Block until every fetch submitted has finished (or `timeout`); deliver all
        finished. For a caller with nothing else to do: an engine step with no tokens."""
        self._wait(lambda: not self._fetches or self._closing, timeout)
        return self.poll()

    def _wait(self, ready: Callable[[], bool], timeout: float | None) -> None:
        """Wait until `ready()` or `timeout`, waking at each queued fetch's deadline to fail
        it (the I/O thread may be held by a store call that never returns)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._expire()
                if ready():
                    return
                now = time.monotonic()
                wake = min((self._deadlines[j.id] for j in self._queue
                            if j.id in self._deadlines), default=None)
                if end is not None:
                    if now >= end:
                        return
                    wake = end if wake is None else min(wake, end)
                self._cond.wait(None if wake is None else max(wake - now, 0.0) + 1e-3)

    def _expire(self) -> None:
        """Fail every queued fetch whose deadline has passed (the caller holds the lock):
        nothing of it was read, each block is a DEADLINE miss, kept where it lives."""
        now = time.monotonic()
        late = [j for j in self._queue if self._deadlines.get(j.id, now) < now]
        for job in late:
            self._queue.remove(job)
            del self._deadlines[job.id]
            n = len(job.keys)
            self._done[job.id] = Result(job.id, (False,) * n, (Reason.DEADLINE,) * n, 0, 0.0,
                                        time.perf_counter())
            self._fetches -= 1
        if late:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self.stores:
            self._thread.join(timeout=30)
        self._readers.shutdown(wait=True)
        with self._cond:  # whatever never ran fails: its keys become misses
            self._deadlines.clear()
            while self._queue:
                job = self._queue.popleft()
                n = len(job.keys)
                self._done[job.id] = Result(job.id, (False,) * n, (Reason.CLOSED,) * n, 0, 0)

    def _run(self) -> None:
        use_one_thread()  # compute keeps its OpenMP team to itself (threads.py)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and nothing left that a shutdown waits on
                    return
                job = self._queue.popleft()
            if job.src is Medium.HOST:
                self._yielded = 0.0
                self._fetches_first()  # a write waits out a wake's quiet time first
            self._execute(job)

    def _execute(self, job: Job) -> float:
        """Run `job` and hand its result over; the seconds it took, less any fetch it let
        go first."""
        start = time.perf_counter()
        self._yielded = 0.0
        with self._cond:
            deadline = self._deadlines.pop(job.id, None)
        try:
            ok, reasons, nbytes = (self._renew(job) if job.renew else
                                   self._erase(job) if job.erase else
                                   self._write(job) if job.src is Medium.HOST
                                   else self._fetch(job, deadline))
        except Exception as e:  # never let one job take the thread down
            n = len(job.keys)
            tier = job.src if job.dst is Medium.HOST else job.dst
            reason = self._note(tier, Reason.ERROR, f"{type(e).__name__}: {e}")
            ok, reasons, nbytes = [False] * n, [reason] * n, 0
        ended = time.perf_counter()
        seconds = ended - start - self._yielded
        if job.dst is Medium.HOST:  # a wake: its load and first token come next
            self._quiet_until = ended + WAKE_QUIET_S
        result = Result(job.id, tuple(ok), tuple(reasons), nbytes, seconds, ended)
        with self._cond:
            self._done[job.id] = result
            self._fetches -= job.dst is Medium.HOST
            self._cond.notify_all()
        return seconds + self._yielded

    def _fetches_first(self) -> None:
        """Between two pieces of a write: run every fetch queued meanwhile (a request waits
        on it; the write does not), so a wake waits one piece, not a whole write-on; after a
        fetch, the write waits out WAKE_QUIET_S while the woken request loads and computes."""
        while True:
            with self._cond:
                quiet = self._quiet_until - time.perf_counter()
                if quiet > 0 and not (self._queue and self._queue[0].dst is Medium.HOST):
                    waited = time.perf_counter()
                    self._cond.wait_for(lambda: self._closing or (
                        bool(self._queue) and self._queue[0].dst is Medium.HOST), quiet)
                    self._yielded += time.perf_counter() - waited
                if not self._queue or self._queue[0].dst is not Medium.HOST:
                    return
                fetch = self._queue.popleft()
            paused = self._yielded
            spent = self._execute(fetch)
            self._yielded = paused + spent

    def _note(self, tier: Medium, reason: Reason, detail: str) -> Reason:
        """`reason`, its `detail` logged the first time this tier fails this way (the label
        stays bounded; the text is still seen once)."""
        if (tier, reason) not in self._logged:
            self._logged.add((tier, reason))
            log.warning("kvtier %s tier: %s (%s); logged once per tier and reason",
                        tier.value, reason.value, detail)
        return reason

    def _os_error(self, tier: Medium, e: OSError) -> Reason:
        """A failed medium: full (ENOSPC, EDQUOT) or any other I/O error."""
        return self._note(tier, Reason.NO_SPACE if e.errno in _NO_SPACE else Reason.IO, str(e))

    def _failure(self, tier: Medium, e: OSError | StoreMiss) -> Reason:
        """The reason a store's error gives (an absent block is expected: not logged here)."""
        if isinstance(e, OSError):
            return self._os_error(tier, e)
        return e.reason if e.reason is Reason.MISSING else self._note(tier, e.reason, str(e))

    # -- writes -------------------------------------------------------------------------

    def _header(self, key: bytes, tokens: Sequence[int], payload: memoryview) -> BlockHeader:
        return BlockHeader(self.namespace, key, tuple(tokens), len(payload),
                           payload_checksum(payload), self.encoding)

    def _write(self, job: Job) -> tuple[list[bool], list[Reason], int]:
        store = self.stores[job.dst]
        rows = [tensor_bytes(self.host.tensor[s]) for s in job.host_slots]
        reasons = [Reason.OK] * len(rows)
        todo: list[int] = []
        for i in range(len(rows)):
            fault = self.fault(job, i)
            if fault is None:
                todo.append(i)
            else:
                reasons[i] = self._os_error(job.dst, OSError(str(fault)))
        for lo, hi in batches([len(rows[i]) for i in todo], WRITE_PIECE_BYTES):
            part = todo[lo:hi]
            keep = {"keep_until": [job.keep_until[i] for i in part]} if job.keep_until else {}
            errors = store.write([job.below_slots[i] for i in part],
                                 [self._header(job.keys[i], job.tokens[i], rows[i])
                                  for i in part],
                                 [rows[i] for i in part], **keep)
            for i, error in zip(part, errors):
                if error:
                    reasons[i] = self._failure(job.dst, error)
            if hi < len(todo):
                self._fetches_first()
        ok = [r is Reason.OK for r in reasons]
        return ok, reasons, sum(len(row) for row, good in zip(rows, ok) if good)

    def _renew(self, job: Job) -> tuple[list[bool], list[Reason], int]:
        """A retention granted after the blocks went down: the store keeps them that long."""
        errors = self.stores[job.dst].renew(job.keys, job.keep_until)
        reasons = [Reason.OK if e is None else self._failure(job.dst, e) for e in errors]
        return [r is Reason.OK for r in reasons], reasons, 0

    def _erase(self, job: Job) -> tuple[list[bool], list[Reason], int]:
        """A purge: each key's copy erased where it lives (absent ones are no-ops), then made
        durable; a store that fails leaves that key's bytes, said in its reason."""
        store = self.stores[job.dst]
        reasons = [Reason.OK] * len(job.keys)
        for i, (key, slot) in enumerate(zip(job.keys, job.below_slots)):
            try:
                store.discard(key, slot)
            except (OSError, StoreMiss) as e:
                reasons[i] = self._failure(job.dst, e)
        try:
            store.flush()
        except OSError as e:
            reasons = [self._failure(job.dst, e)] * len(job.keys)
        return [r is Reason.OK for r in reasons], reasons, 0

    # -- fetches ------------------------------------------------------------------------

    def _fetch(self, job: Job, deadline: float | None = None
               ) -> tuple[list[bool], list[Reason], int]:
        n = len(job.keys)
        ok, reasons = [False] * n, [Reason.SKIPPED] * n
        rows = [tensor_bytes(self.host.tensor[s]) for s in job.host_slots]
        reads = {m: self.stores[m].reads([k for k, t in zip(job.keys, job.media) if t is m],
                                         [r for r, t in zip(rows, job.media) if t is m],
                                         deadline)
                 for m in dict.fromkeys(job.media)}

        bad: list[tuple[SecondaryStore, bytes, int]] = []  # to discard once all are read

        def read(i: int) -> Reason:
            fault = self.fault(job, i)
            if fault is not None:
                return Reason(fault)
            delay = self.delay(job, i)
            if delay > 0 and (deadline is None or time.monotonic() < deadline):
                time.sleep(min(delay, MAX_DELAY_S))  # a slow medium (tests): one slow read
            tier = job.media[i]
            return self._read(self.stores[tier], reads[tier], job.keys[i], job.tokens[i],
                              job.below_slots[i], self.host.tensor[job.host_slots[i]],
                              rows[i], bad)

        # Blocks whose bytes are at hand are read and verified by the reader team at once
        # (every one is verified even after a failure, as below); the rest in order. Bad
        # blocks are discarded after all the reads: a discard on disk writes a header, which
        # on a cut file would put zeros where a block read beside it expected the file's end.
        early = [i for i in range(n) if self.stores[job.media[i]].parallel_reads
                 and reads[job.media[i]].ready(job.keys[i])]
        done = dict(zip(early, self._readers.map(read, early))) if len(early) > 1 else {}
        nbytes = 0
        failed = False  # after a failure no block counts (a prefix cannot skip a block)
        late = False  # the deadline cut the fetch: every block not landed says so
        for i, (key, tier) in enumerate(zip(job.keys, job.media)):
            if i not in done and failed and not reads[tier].ready(key):
                if late:  # its reads' own answer, no I/O: mostly DEADLINE
                    reasons[i] = read(i)
                continue  # not fetched (or absent): nothing of it to verify, SKIPPED
            reason = done[i] if i in done else read(i)
            if reason is not Reason.OK:
                reasons[i], failed = reason, True  # a bad block after it: its own reason
                late = late or reason is Reason.DEADLINE
            elif not failed:
                ok[i], reasons[i] = True, Reason.OK
                nbytes += self.host.slot_bytes  # as stored: a host row, 8-bit where it is
        # If even a discard fails, the block stays and is checked (and refused) again: the
        # disk index drops the slot anyway, a restart re-verifies it.
        for store, key, slot in bad:
            with contextlib.suppress(OSError, ValueError, StoreMiss):
                store.discard(key, slot)
        return ok, reasons, nbytes

    def _read(self, store: SecondaryStore, reads: BlockReads, key: bytes,
              tokens: Sequence[int], slot: int, row: torch.Tensor, out: memoryview,
              bad: list[tuple[SecondaryStore, bytes, int]]) -> Reason:
        """Read and verify one block into `row` (`out` its bytes): OK, or why not (a bad
        block goes on `bad`, to be discarded where it lives, so it is never read again; a
        failed medium keeps it)."""
        verdict = read_verified(store, reads, key, slot, out, self.namespace, tokens)
        if verdict.failure is not None:
            return self._failure(store.medium, verdict.failure)
        if verdict.bad:
            bad.append((store, key, slot))
        elif verdict.payload is not None and verdict.payload is not out:
            try:
                copy_into(row, verdict.payload)
            except ValueError:  # a view that does not fit its row
                bad.append((store, key, slot))
                return Reason.SIZE
        return verdict.reason
