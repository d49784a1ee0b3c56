"""The disk tier reopened: its slot file, and its index rebuilt from the headers on it.

  open_disk(path, size, ...)        the file (opened, locked) and its index; slots it cannot
                                    take are invalidated
  read_disk_index(path, size, ...)  that index alone, read only (the file is another's)
  disk_geometry(size, ...)          (slots, header bytes): the same in every process
A block of another fingerprint, encoding or size is never adopted, only counted by reason.
"""

from __future__ import annotations

import logging
from collections import Counter

from kvtier.errors import ConfigError
from kvtier.tier.books.residency_log import ResidencyLog
from kvtier.tier.books.tenancy import Tenancy
from kvtier.tier.config import GIB
from kvtier.tier.io.block_format import BlockHeader, max_header_nbytes
from kvtier.tier.jobs import Reason
from kvtier.tier.stores.disk.file import DiskStore, read_headers, round_up
from kvtier.tier.stores.disk.index import DiskTier

log = logging.getLogger(__name__)


def open_disk(path: str, size_gib: float, policy: str, slot_bytes: int, encoding: str,
              namespace: bytes, block_size: int, residency: ResidencyLog | None = None,
              tenancy: Tenancy | None = None) -> tuple[DiskStore, DiskTier]:
    """The slot file, and its index rebuilt from the blocks a previous process left there
    (of `slot_bytes` and `encoding`, the host rows'; other blocks are invalidated)."""
    num_slots, header = disk_geometry(size_gib, slot_bytes, block_size)
    store = DiskStore(path, num_slots, slot_bytes, header)
    try:
        unusable: Counter[str] = Counter()
        found = store.scan(unusable)
        tier, rejected = _adopt(path, policy, found, unusable, num_slots, namespace,
                                slot_bytes, encoding, residency, tenancy)
        for slot in rejected:
            store.invalidate(slot)
    except BaseException:
        store.close()
        raise
    adopted = len(tier.complete_keys())
    if adopted:
        log.info("kvtier: disk tier %s: %d blocks from an earlier process", store.path, adopted)
    return store, tier


def read_disk_index(path: str, size_gib: float, policy: str, slot_bytes: int, encoding: str,
                    namespace: bytes, block_size: int, residency: ResidencyLog | None = None,
                    tenancy: Tenancy | None = None) -> DiskTier:
    """The disk tier's index from its file, read only: for the process that keeps the index
    while another owns the file (`open_disk` there adopts, and invalidates, the same slots).
    `residency`: where the index tells its residency changes (None: nowhere); `tenancy`:
    the owners and retention its blocks get back (a previous process's, saved)."""
    num_slots, header = disk_geometry(size_gib, slot_bytes, block_size)
    unusable: Counter[str] = Counter()
    found = read_headers(path, num_slots, slot_bytes, header, unusable)
    return _adopt(path, policy, found, unusable, num_slots, namespace, slot_bytes, encoding,
                  residency, tenancy)[0]


def disk_geometry(size_gib: float, slot_bytes: int, block_size: int) -> tuple[int, int]:
    """(slots, header bytes) of the disk tier's file: the same in every process."""
    header = max_header_nbytes(block_size)
    probe_slot = round_up(header) + round_up(slot_bytes)
    num_slots = int(size_gib * GIB // probe_slot)
    if num_slots < 1:
        raise ConfigError(
            f"disk_kv_size={size_gib} GiB holds no block of {probe_slot:,} bytes; "
            "raise it")
    return num_slots, header


def _adopt(path: str, policy: str, found: list[tuple[int, BlockHeader]],
           unusable: Counter[str], num_slots: int, namespace: bytes, slot_bytes: int,
           encoding: str, residency: ResidencyLog | None = None,
           tenancy: Tenancy | None = None) -> tuple[DiskTier, list[int]]:
    """An index of the blocks of this namespace and shape; the slots it could not take.
    Blocks of another fingerprint (the weights changed, say) or shape are counted."""
    ours = []
    for slot, h in found:
        if h.namespace != namespace or h.encoding != encoding:
            unusable[Reason.FINGERPRINT.value] += 1
        elif h.payload_nbytes != slot_bytes:
            unusable[Reason.SIZE.value] += 1
        else:
            ours.append((slot, h.key, h.tokens))
    tier = DiskTier(num_slots, policy, unusable, residency, tenancy)
    if unusable:
        log.warning("kvtier: disk tier %s holds blocks this process will not serve (%s): "
                    "written under another model, configuration or format, or damaged",
                    path, ", ".join(f"{n} {r}" for r, n in unusable.items()))
    return tier, tier.adopt(ours)
