"""kvtier's stores below host for an engine that owns its host memory (SGLang's HiCache): pages
go down from rows the engine gives and come back into rows it gives, verified on the way up.

The same stores, block format, fingerprint and MAC as the tier's own; only the host pool is
the engine's. A page is one block: its bytes, a key the engine chose (SGLang chains its page
hashes itself), no token ids (the engine does not hand them over, so the key and the
namespace carry the identity). Calls are synchronous: the engine calls from its own storage
threads.
  PageStore.open(config, namespace, page_nbytes)   every configured store, opened and probed
  put(keys, pages) -> [bool]    written to every store; a page already there is not rewritten
  exists(keys) -> int           the leading pages some store holds
  get(keys, pages) -> [bool]    read into `pages`, each verified; the first miss ends the run,
                                and a page that fails verification is removed where it lives
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.builder import shared_mac
from kvtier.tier.config import TierConfig
from kvtier.tier.io.block_format import (
    MAX_KEY_NBYTES,
    BlockHeader,
    as_bytes,
    payload_checksum,
)
from kvtier.tier.io.kind import StoreSite, configured_stores
from kvtier.tier.io.store import SecondaryStore, StoreMiss
from kvtier.tier.io.verify import read_verified
from kvtier.tier.jobs import Miss, Reason
from kvtier.tier.keys import BlockKey, Medium

log = logging.getLogger(__name__)
PRESENCE_WAIT_S = 2.0  # the longest `exists` waits for a shared store's answer


@dataclass
class PageCounts:
    """Pages in and out, and every page refused on the way up, by reason."""

    written: int = 0
    write_failures: int = 0
    read: int = 0
    misses: dict[Miss, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Store:
    name: str
    index: SecondaryIndex
    blocks: SecondaryStore


class PageStore:
    """The configured stores below host, nearest first, over pages of `page_nbytes`."""

    def __init__(self, stores: Sequence[_Store], namespace: bytes, page_nbytes: int,
                 resources: ExitStack) -> None:
        self._stores, self.namespace, self.page_nbytes = list(stores), namespace, page_nbytes
        self._resources = resources
        self.counts = PageCounts()

    @classmethod
    def open(cls, config: TierConfig, namespace: bytes, page_nbytes: int) -> PageStore:
        """Every store `config` names (ConfigError naming the knob); at least one."""
        config.validate()
        configured = configured_stores(config)
        if not configured:
            raise ConfigError("no store below host is configured: name one in kv_stores (or "
                              "by its flat knobs)")
        with ExitStack() as undo:
            site = StoreSite(config, namespace, 0, page_nbytes, "", shared_mac(config), undo)
            stores = []
            for kind, knobs in configured:
                opened = kind.open_both(site, knobs)
                stores.append(_Store(kind.name, opened.index, opened.store))
            return cls(stores, namespace, page_nbytes, undo.pop_all())

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._stores]

    def put(self, keys: Sequence[BlockKey], pages: Sequence[memoryview]) -> list[bool]:
        """Each page written to every store (or already there); True where one store has it."""
        self._check(keys, pages)
        done = [False] * len(keys)
        where = {k: i for i, k in enumerate(keys)}
        for s in self._stores:
            # a shared store holds what others wrote: its leading pages are not written again
            held = 0 if s.index.local else self._lookup(s, keys)
            prepared = s.index.prepare_store(list(keys[held:]), [()] * (len(keys) - held))
            if prepared is None:  # no room it could make
                continue
            new = set(prepared.keys)
            for i, k in enumerate(keys):
                done[i] = done[i] or k not in new  # already there
            if not prepared.keys:
                continue
            rows = [as_bytes(pages[where[k]]) for k in prepared.keys]
            headers = [BlockHeader(self.namespace, k, (), len(r), payload_checksum(r))
                       for k, r in zip(prepared.keys, rows)]
            errors = s.blocks.write(prepared.slots, headers, rows)
            good = [k for k, e in zip(prepared.keys, errors) if e is None]
            bad = [k for k, e in zip(prepared.keys, errors) if e is not None]
            if good:
                s.index.complete_store(good, True)
            if bad:
                s.index.complete_store(bad, False)
            self.counts.written += len(good)
            self.counts.write_failures += len(bad)
            for k in good:
                done[where[k]] = True
        return done

    def exists(self, keys: Sequence[BlockKey]) -> int:
        """The leading pages one store holds (a shared store is asked, at most
        PRESENCE_WAIT_S)."""
        best = 0
        for s in self._stores:
            best = max(best, self._lookup(s, keys))
            if best == len(keys):
                break
        return best

    def get(self, keys: Sequence[BlockKey], pages: Sequence[memoryview]) -> list[bool]:
        """The leading pages read into `pages`, each verified; False from the first miss on."""
        self._check(keys, pages)
        got = [False] * len(keys)
        start = 0
        for s in self._stores:
            if start == len(keys):
                break
            want = list(keys[start:])
            n = self._lookup(s, want)
            if n:
                start += self._read(s, want[:n], [as_bytes(p) for p in pages[start:start + n]])
                got[:start] = [True] * start
        return got

    def stats(self) -> dict[str, Any]:
        return {"stores": self.names, "written": self.counts.written,
                "write_failures": self.counts.write_failures, "read": self.counts.read,
                "misses": {str(m): n for m, n in self.counts.misses.items()}}

    def close(self) -> None:
        for s in self._stores:
            s.blocks.flush()
            s.index.close()
        self._resources.close()

    def _lookup(self, s: _Store, keys: Sequence[BlockKey]) -> int:
        deadline = time.monotonic() + PRESENCE_WAIT_S
        while True:
            n = s.index.lookup(list(keys))
            if n is not None:
                return n
            if time.monotonic() >= deadline:
                return 0
            s.index.wait(max(deadline - time.monotonic(), 0.0))

    def _read(self, s: _Store, keys: list[BlockKey], rows: list[memoryview]) -> int:
        """Read and verify `keys` from one store into `rows`; how many lead unbroken."""
        slots = s.index.prepare_load(keys)
        reads = s.blocks.reads(keys, rows)
        served, dropped = 0, []
        for key, slot, row in zip(keys, slots, rows):
            verdict = read_verified(s.blocks, reads, key, slot, row, self.namespace, ())
            if verdict.failure is not None:  # the store failed: the page is kept there
                self._miss(s.blocks.medium, verdict.reason)
                break
            if verdict.bad:
                self._miss(s.blocks.medium, verdict.reason)
                with suppress(OSError, ValueError, StoreMiss):  # it stays: checked again
                    s.blocks.discard(key, slot)
                dropped.append(key)
                break
            if verdict.payload is not None and verdict.payload is not row:
                row[:] = as_bytes(verdict.payload)  # a view to copy once verified
            served += 1
        s.index.complete_fetch(keys, served, dropped, served == len(keys))
        self.counts.read += served
        return served

    def _miss(self, medium: Medium, reason: Reason) -> None:
        miss = Miss(medium, reason)
        self.counts.misses[miss] = self.counts.misses.get(miss, 0) + 1

    def _check(self, keys: Sequence[BlockKey], pages: Sequence[memoryview]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        if len(set(keys)) != len(keys):
            raise ValueError("a page key given twice in one call")
        for k, p in zip(keys, pages):
            if not isinstance(k, bytes) or not 1 <= len(k) <= MAX_KEY_NBYTES:
                raise ValueError(f"a page key is 1..{MAX_KEY_NBYTES} bytes, not {k!r}")
            if len(as_bytes(p)) != self.page_nbytes:
                raise ValueError(f"a page of {len(as_bytes(p))} bytes where the store holds "
                                 f"{self.page_nbytes}")
