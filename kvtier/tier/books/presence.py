"""The books of a store shared by several processes (Redis, a shared filesystem), so
presence is asked of it.

Nothing here is authoritative: another process may write or expire a key at any time, so
`lookup` asks the store and a hit is only a hint until the fetched header, tokens and
checksum verify. The question goes to `SharedPresence`, a thread of its own: a scheduling
step waits at most `INLINE_WAIT_S` on the network when it first asks (a local store answers
by then: no extra engine step), and otherwise gets None ("ask again") until the answer is in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from kvtier.tier.books.protocol import PrepareStoreResult
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.report import IndexStats

log = logging.getLogger(__name__)

# keys -> one presence flag each, None where the store could not say (a cluster's dead
# shard); may raise: an unreachable store then answers all False
ExistsFn = Callable[[Sequence[BlockKey]], Sequence[bool | None]]
MAX_ANSWERS = 1024  # answers nobody came back for (an aborted request) are dropped oldest first
# How long a new question waits for its answer before the caller is told to ask again: a
# local Redis answers 16 EXISTS in well under this. Once a wait runs out, none is waited for
# SLOW_BACKOFF_S: a slow store costs the scheduler one such wait a second, however many
# requests arrive meanwhile.
INLINE_WAIT_S = 0.003
SLOW_BACKOFF_S = 1.0


class SharedPresence:
    """Asks `exists` off the caller's thread; `ask` returns the answer once it is in."""

    def __init__(self, exists: ExistsFn, inline_wait_s: float = INLINE_WAIT_S) -> None:
        self._exists = exists
        self.inline_wait_s = inline_wait_s
        self._no_wait_until = 0.0  # after a wait ran out: ask again without waiting
        self._cond = threading.Condition()
        self._questions: OrderedDict[tuple[BlockKey, ...], None] = OrderedDict()
        self._answers: OrderedDict[tuple[BlockKey, ...], list[bool | None]] = OrderedDict()
        self._closing = False
        self.errors = 0  # questions answered "absent" because the store failed
        self._thread = threading.Thread(target=self._run, name="kvtier-presence", daemon=True)
        self._thread.start()

    def ask(self, keys: Sequence[BlockKey]) -> list[bool | None] | None:
        """The store's answer for exactly these keys if it is in (consumed), else None
        (the question is queued once, and waited for `inline_wait_s`; ask again later)."""
        question = tuple(keys)
        with self._cond:
            answer = self._answers.pop(question, None)
            if answer is not None:
                return answer
            if question not in self._questions and not self._closing:
                self._questions[question] = None
                self._cond.notify_all()
                if time.monotonic() >= self._no_wait_until:
                    if self._cond.wait_for(lambda: question in self._answers,
                                           self.inline_wait_s):
                        return self._answers.pop(question)
                    self._no_wait_until = time.monotonic() + SLOW_BACKOFF_S
            return None

    @property
    def pending(self) -> bool:
        with self._cond:
            return bool(self._questions)

    def wait(self, timeout: float) -> None:
        """Block until no question is outstanding (or `timeout`)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._questions or self._closing, timeout)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._questions.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._questions) or self._closing)
                if self._closing:
                    return
                question = next(iter(self._questions))
            answer: list[bool | None]
            try:
                answer = list(self._exists(question))
            except Exception as e:  # unreachable, or credentials revoked since start: a miss
                log.debug("kvtier: remote presence query failed: %s", e)
                answer = [False] * len(question)
                with self._cond:
                    self.errors += 1
            with self._cond:
                self._questions.pop(question, None)
                self._answers[question] = answer
                while len(self._answers) > MAX_ANSWERS:
                    self._answers.popitem(last=False)
                self._cond.notify_all()


class SharedBooks:
    """Counters and in-flight writes of a shared store on `medium`; presence comes from
    `presence`; `expires`: the store drops blocks by itself (a TTL)."""

    local = False  # presence is the store's to say
    unusable_at_start: Mapping[str, int] = MappingProxyType({})  # nothing scanned at start

    def __init__(self, presence: SharedPresence, medium: Medium = Medium.REDIS,
                 expires: bool = False) -> None:
        self.presence, self.medium, self.expires = presence, medium, expires
        self._writing: set[BlockKey] = set()
        self._counts = IndexStats()
        self._cut_short = 0  # lookups whose run stopped at a key the store could not answer

    @property
    def stats(self) -> IndexStats:
        s = self._counts
        return IndexStats(s.lookups, s.hits, s.stores, s.store_failures, s.loads,
                          s.load_failures, 0, s.collisions, 0, 0, len(self._writing),
                          self.answered_absent)

    @property
    def pending(self) -> bool:
        return self.presence.pending

    @property
    def answered_absent(self) -> int:
        """Questions the store failed whole, and lookups cut short by one of its shards."""
        return self.presence.errors + self._cut_short

    def wait(self, timeout: float) -> None:
        self.presence.wait(timeout)

    def close(self) -> None:
        """Stop asking: the presence thread ends (a question in flight is dropped)."""
        self.presence.close()

    def lookup(self, keys: Sequence[BlockKey],
               token_chunks: Sequence[Sequence[int]] | None = None) -> int | None:
        """How many leading keys the store says it holds (tokens are checked on fetch);
        None until the store has answered."""
        if not keys:
            return 0
        present = self.presence.ask(keys)
        if present is None:
            return None
        hits = 0
        for flag in present:
            if not flag:
                self._cut_short += flag is None
                break
            hits += 1
        self._counts.lookups += min(len(keys), hits + 1)
        self._counts.hits += hits
        return hits

    def prepare_store(self, keys: Sequence[BlockKey],
                      token_chunks: Sequence[Sequence[int]] | None = None
                      ) -> PrepareStoreResult:
        """The keys not already being written by this process, marked in flight (the store
        has no slots, and evicts by itself)."""
        new = [k for k in dict.fromkeys(keys) if k not in self._writing]
        self._writing.update(new)
        return PrepareStoreResult(new, [-1] * len(new), [])

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        return [-1] * len(keys)

    def complete_store(self, keys: Sequence[BlockKey], success: bool) -> None:
        for key in keys:
            self._writing.discard(key)
        if success:
            self._counts.stores += len(keys)
        else:
            self._counts.store_failures += len(keys)

    def complete_fetch(self, keys: Sequence[BlockKey], served: int,
                       dropped: Sequence[BlockKey], success: bool) -> None:
        """Counted only: the fetch path already deleted what failed verification."""
        self._counts.loads += served
        self._counts.load_failures += len(dropped)
