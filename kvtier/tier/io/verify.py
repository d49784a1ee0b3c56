"""One way to read a block from a store and decide whether it may be served, for every
reader: the I/O thread's fetches into host rows (`thread.py`) and SGLang's pages
(`pages.py`). A block is served only if its header, fingerprint, key, tokens, checksum and
the store's MAC all check; a block that fails is bad (discard it where it lives, never read
it again), a store that fails keeps the block (it may be fine next time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tier.io.block_format import Buffer, CorruptBlock, check
from kvtier.tier.io.store import BlockReads, SecondaryStore, StoreMiss
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey


@dataclass(frozen=True)
class Verdict:
    """What one read gave: `reason` OK with its `payload` (the row itself, or a view to copy
    once verified), a bad block's reason (`bad`), or the store's own `failure` (the block
    kept)."""

    reason: Reason
    payload: Buffer | None = None
    bad: bool = False
    failure: OSError | StoreMiss | None = None

    @property
    def ok(self) -> bool:
        return self.reason is Reason.OK


def read_verified(store: SecondaryStore, reads: BlockReads, key: BlockKey, slot: int,
                  out: memoryview, namespace: bytes, tokens: Sequence[int]) -> Verdict:
    """Read `key` (at `slot` where the store has slots) into `out` and check it."""
    try:
        header, payload = reads.read(key, slot, out)
        reason = check(header, namespace=namespace, key=key, tokens=tokens, payload=payload,
                       mac=store.mac)
    except CorruptBlock as e:
        return Verdict(e.reason, bad=True)
    except StoreMiss as e:
        return Verdict(e.reason, failure=e)
    except OSError as e:
        return Verdict(Reason.IO, failure=e)
    except ValueError:  # a payload of the wrong size for its row
        return Verdict(Reason.SIZE, bad=True)
    if reason is not None:
        return Verdict(reason, bad=True)
    return Verdict(Reason.OK, payload)
