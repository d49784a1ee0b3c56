"""The shared filesystem store as the builder sees it: `kv_stores={"fs": {...}}`.

Knobs: `path` (the shared directory, created 0700 if missing), `read_gbps` (the planner's
starting read rate; unset: measured at start), `fsync` (sync each block before it is renamed
into place; off by default: a block lost to a crash is a miss, never a wrong hit). Its books
ask the directory for presence off the scheduler's thread, as they ask Redis: another
instance may write or remove a block at any time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.io.probe import cold_read_gbps
from kvtier.tier.keys import Medium
from kvtier.tier.knobs import parse_store_knobs, store_entry

if TYPE_CHECKING:
    from kvtier.tier.stores.fs.blocks import FsBlocks

log = logging.getLogger(__name__)

PROBE_BLOCKS = 8
UNMEASURED_GBPS = 0.5  # a directory that could not be measured: assume a slow one


@dataclass(frozen=True)
class FsKnobs:
    """The shared directory store's knobs."""

    path: str | None = None  # the directory the instances share (created 0700 if missing)
    read_gbps: float | None = None  # the planner's starting read rate; None: measured at start
    fsync: bool = False  # sync each block before it is renamed into place


class FsKind:
    """A directory of block files that several instances share (MAC-signed under a secret)."""

    name = "fs"
    medium = Medium.declare("fs", shared=True)
    shared = True
    knobs_type = FsKnobs
    aliases: Mapping[str, str] = {}

    def parse(self, raw: Mapping[str, Any]) -> FsKnobs:
        knobs, named = parse_store_knobs(FsKnobs, self.name, raw, self.aliases)
        if not knobs.path or not knobs.path.strip():
            raise ConfigError("kv_stores['fs'] needs 'path': the directory the instances "
                              "share")
        if knobs.read_gbps is not None and not 0 < knobs.read_gbps < 1e6:
            raise ConfigError(f"{named('read_gbps')}={knobs.read_gbps} must be in (0, 1e6) "
                              "GB/s")
        directory = Path(knobs.path)
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{named('path')}={knobs.path!r} is not a directory")
        return knobs

    def state_dir(self, knobs: FsKnobs) -> str | None:
        return None  # other instances share it

    def rank_share(self, knobs: FsKnobs, rank: int, world_size: int) -> Mapping[str, Any]:
        """Every rank in the same directory (each rank's blocks name its split)."""
        return store_entry(knobs)

    def open_both(self, site: StoreSite, knobs: FsKnobs) -> Opened:
        blocks = self.open_bytes(site, knobs)
        return Opened(blocks, site.presence_books(blocks.files.exists_many, self.medium),
                      self._read_gbps(blocks, site, knobs))

    def open_books(self, site: StoreSite, knobs: FsKnobs) -> tuple[SecondaryIndex, float]:
        blocks = self.open_bytes(site, knobs)
        return (site.presence_books(blocks.files.exists_many, self.medium),
                self._read_gbps(blocks, site, knobs))

    def open_bytes(self, site: StoreSite, knobs: FsKnobs) -> FsBlocks:
        from kvtier.tier.stores.fs.blocks import DIR_MODE, BlockFiles, FsBlocks

        # Under a secret, its directory is the secret's: another secret's blocks are never
        # found, never removed.
        namespace = site.mac.store_namespace(site.namespace) if site.mac else site.namespace
        files = BlockFiles(Path(str(knobs.path)), namespace)
        try:
            files.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"kv_stores['fs']['path']={knobs.path!r}: cannot create "
                              f"{files.dir} ({e.strerror or type(e).__name__})") from None
        return FsBlocks(files, self.medium, site.mac, knobs.fsync)

    @staticmethod
    def _read_gbps(blocks: FsBlocks, site: StoreSite, knobs: FsKnobs) -> float:
        """Configured, else a few scratch blocks written, dropped from the page cache where
        the kernel allows, and read back; a slow guess where that fails."""
        if knobs.read_gbps:
            return knobs.read_gbps
        scratch = blocks.files.dir / f".kvtier-probe-{os.getpid()}"
        try:
            return cold_read_gbps(scratch, site.slot_bytes, PROBE_BLOCKS)
        except OSError as e:
            log.warning("kvtier: the fs store's read rate could not be measured in %s (%s); "
                        "the planner starts from %.1f GB/s (set kv_stores.fs.read_gbps)",
                        blocks.files.dir, e.strerror or e, UNMEASURED_GBPS)
            return UNMEASURED_GBPS


FS = FsKind()
