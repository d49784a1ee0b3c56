"""The local disk store as the builder sees it: `kv_stores={"disk": {"path": DIR, "size":
GiB}}` (or the flat `disk_kv_path` and `disk_kv_size`), one slot file per process, its index
rebuilt from the file at start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.keys import Medium
from kvtier.tier.knobs import check_bounds, parse_store_knobs, store_entry
from kvtier.tier.stores.disk.probe import measure_disk_gbps

if TYPE_CHECKING:
    from kvtier.tier.stores.disk.blocks import DiskBlocks

MAX_GIB = 2.0**24  # 16 PiB of disk: past it a size is a typo
MAX_GBPS = 1e6


@dataclass(frozen=True)
class DiskKnobs:
    """The disk store's knobs."""

    path: str | None = None  # directory of the slot file (created 0700)
    size: float = 0.0  # GiB of disk; 0 = no disk tier
    # Cap on its I/O (GB/s), to leave a shared disk to its other users (and to see how a
    # slower device would serve); None: as fast as the disk goes.
    max_gbps: float | None = None
    # The planner's starting read rate (GB/s); None: measured at start (a few blocks, cold).
    read_gbps: float | None = None


class DiskKind:
    """A local disk tier: never shared (its file is locked by one process)."""

    name = "disk"
    medium = Medium.DISK
    shared = False
    knobs_type = DiskKnobs
    aliases: Mapping[str, str] = {"disk_kv_path": "path", "disk_kv_size": "size",
                                  "disk_kv_max_gbps": "max_gbps",
                                  "disk_kv_read_gbps": "read_gbps"}

    def parse(self, raw: Mapping[str, Any]) -> DiskKnobs | None:
        knobs, named = parse_store_knobs(DiskKnobs, self.name, raw, self.aliases)
        if knobs.size < 0:
            raise ConfigError(f"{named('size')}={knobs.size} GiB must be >= 0 (0 = off)")
        if knobs.size > 0 and not knobs.path:
            raise ConfigError(f"{named('size')} is set but {named('path')} is not; name a "
                              "directory")
        if knobs.path and knobs.size == 0:
            raise ConfigError(f"{named('path')} is set but {named('size')} is 0; give its "
                              "size in GiB")
        for knob in ("max_gbps", "read_gbps"):
            value = getattr(knobs, knob)
            if value is not None and not value > 0:
                raise ConfigError(f"{named(knob)}={value} must be > 0 (or unset)")
        check_bounds(knobs, {"size": (0.0, MAX_GIB), "max_gbps": (0.0, MAX_GBPS),
                             "read_gbps": (0.0, MAX_GBPS)}, named)
        return knobs if knobs.size > 0 else None

    def state_dir(self, knobs: DiskKnobs) -> str | None:
        return knobs.path

    def rank_share(self, knobs: DiskKnobs, rank: int, world_size: int) -> Mapping[str, Any]:
        """1/world of the size, and a directory of the rank's own (its file is locked)."""
        return {**store_entry(knobs), "size": knobs.size / world_size,
                "path": os.path.join(str(knobs.path), f"rank{rank}")}

    def open_both(self, site: StoreSite, knobs: DiskKnobs) -> Opened:
        blocks, index = self._open(site, knobs)
        return Opened(blocks, index, self._read_gbps(site, knobs))

    def open_books(self, site: StoreSite, knobs: DiskKnobs) -> tuple[SecondaryIndex, float]:
        from kvtier.tier.stores.disk.open import read_disk_index

        index = read_disk_index(str(knobs.path), knobs.size, site.config.eviction_policy,
                                site.slot_bytes, site.encoding, site.namespace,
                                site.block_size, site.changes, site.tenancy)
        return index, self._read_gbps(site, knobs)

    def open_bytes(self, site: StoreSite, knobs: DiskKnobs) -> DiskBlocks:
        return self._open(site, knobs)[0]  # the index rebuilt invalidates slots it cannot take

    def _open(self, site: StoreSite, knobs: DiskKnobs) -> tuple[DiskBlocks, SecondaryIndex]:
        """The slot file (opened, locked, closed by `site.undo` on a failure) and its index."""
        from kvtier.tier.stores.disk.blocks import DiskBlocks
        from kvtier.tier.stores.disk.open import open_disk

        store, index = open_disk(str(knobs.path), knobs.size, site.config.eviction_policy,
                                 site.slot_bytes, site.encoding, site.namespace,
                                 site.block_size, site.changes, site.tenancy)
        site.undo.callback(store.close)
        return DiskBlocks(store, knobs.max_gbps), index

    @staticmethod
    def _read_gbps(site: StoreSite, knobs: DiskKnobs) -> float:
        """The planner's starting read rate: configured, else measured; capped."""
        rate = knobs.read_gbps or measure_disk_gbps(Path(str(knobs.path)), site.slot_bytes)
        return min(rate, knobs.max_gbps) if knobs.max_gbps else rate


DISK = DiskKind()
