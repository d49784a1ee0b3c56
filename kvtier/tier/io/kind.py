"""What a store below host registers: its name and medium, the knobs it parses, and how each
half opens. The builder loops over the registered kinds; a new store is one folder holding
one of these, and one line in `registry.py` (or a module named in `kv_stores`). A kind
imports its bytes half when it opens it: checking knobs never loads torch.

Halves, by who runs them:
  open_both(site, knobs)   one process keeps the books and moves the bytes (kvtier's engine)
  open_books(site, knobs)  the scheduler of a two-process engine (vLLM): the index, never the bytes
  open_bytes(site, knobs)  its worker: the bytes, never the books
Each returns what it opened; whatever it must close it registers on `site.undo`, so a later
failure of the build closes it again.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from kvtier.tier import registry
from kvtier.tier.books.presence import ExistsFn, SharedBooks, SharedPresence
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.config import TierConfig
from kvtier.tier.keys import Medium

if TYPE_CHECKING:  # the bytes side (torch) only where a store opens it
    from kvtier.tier.books.residency_log import ResidencyLog
    from kvtier.tier.books.tenancy import Tenancy
    from kvtier.tier.io.block_mac import BlockMac
    from kvtier.tier.io.store import SecondaryStore


@dataclass(frozen=True)
class StoreSite:
    """Everything a store opens with, made once by the builder."""

    config: TierConfig
    namespace: bytes  # the fingerprint every block carries: another model's is never served
    block_size: int  # tokens per block
    slot_bytes: int  # bytes of one host row, the payload of one stored block
    encoding: str  # the host rows' encoding ("" exact, or the 8-bit codec's name)
    mac: BlockMac | None  # the deployment's MAC (its secret), for stores other instances share
    undo: ExitStack  # what was opened, closed again if the build fails later
    changes: ResidencyLog | None = None  # where a local index tells its residency changes
    tenancy: Tenancy | None = None  # owners and retention, shared by the manager's slot tiers

    def presence_books(self, exists: ExistsFn, medium: Medium, expires: bool = False
                       ) -> SharedBooks:
        """The books of a store other instances write: presence asked of it (`exists`) on a
        thread of its own, stopped by `undo` if the build fails later; `expires`: the store
        drops blocks by itself (a TTL)."""
        books = SharedBooks(SharedPresence(exists), medium, expires)
        self.undo.callback(books.close)
        return books


@dataclass(frozen=True)
class Opened:
    """A store opened in one process: its bytes, its books, and its read rate (GB/s) for the
    planner's start."""

    store: SecondaryStore
    index: SecondaryIndex
    read_gbps: float


class StoreKind(Protocol):
    """One store below host, as the builder sees it (`registry.Registered`, and its halves);
    `knobs` is what its `parse` returned."""

    @property
    def name(self) -> str:
        """How users name it (its `kv_stores` key, its tier's label)."""
        ...

    @property
    def medium(self) -> Medium: ...

    @property
    def shared(self) -> bool:
        """Whether other instances read its blocks (they are MAC-signed under a secret)."""
        ...

    def open_both(self, site: StoreSite, knobs: Any) -> Opened: ...

    def open_books(self, site: StoreSite, knobs: Any) -> tuple[SecondaryIndex, float]:
        """The index and the read rate, for a process that never moves the bytes."""
        ...

    def open_bytes(self, site: StoreSite, knobs: Any) -> SecondaryStore: ...


def configured_stores(config: TierConfig) -> list[tuple[StoreKind, Any]]:
    """(kind, knobs) of each store `config` asks for (`registry.py`), nearest to host first,
    its knobs parsed, as the builder opens them."""
    return [(cast(StoreKind, store.kind), store.knobs) for store in registry.configured(config)]
