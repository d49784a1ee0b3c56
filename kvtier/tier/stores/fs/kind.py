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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.config import TierConfig
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.io.probe import cold_read_gbps
from kvtier.tier.keys import Medium

if TYPE_CHECKING:
    from kvtier.tier.stores.fs.blocks import FsBlocks

log = logging.getLogger(__name__)

KNOBS = {"path": str, "read_gbps": float, "fsync": bool}
KNOB_TYPES = {str: "a string", float: "a number", bool: "true or false"}
PROBE_BLOCKS = 8
UNMEASURED_GBPS = 0.5  # a directory that could not be measured: assume a slow one


class FsKind:
    """A directory of block files that several instances share (MAC-signed under a secret)."""

    name = "fs"
    medium = Medium.declare("fs", shared=True)
    shared = True

    def configured(self, config: TierConfig) -> bool:
        return self.name in config.kv_stores

    def check(self, config: TierConfig) -> None:
        if not self.configured(config):
            return
        knobs = config.kv_stores[self.name]
        where = "kv_stores['fs']"
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise ConfigError(f"{where} has unknown knob(s) {', '.join(map(repr, unknown))}; "
                              f"its knobs are: {', '.join(KNOBS)}")
        for name, kind in KNOBS.items():
            value = knobs.get(name)
            if value is None:
                continue
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  if kind is float else isinstance(value, kind))
            if not ok:
                raise ConfigError(f"{where}[{name!r}]={value!r} must be {KNOB_TYPES[kind]}")
        path = knobs.get("path")
        if not path or not str(path).strip():
            raise ConfigError(f"{where} needs 'path': the directory the instances share")
        gbps = knobs.get("read_gbps")
        if gbps is not None and not 0 < gbps < 1e6:
            raise ConfigError(f"{where}['read_gbps']={gbps} must be in (0, 1e6) GB/s")
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{where}['path']={path!r} is not a directory")

    def open_both(self, site: StoreSite) -> Opened:
        blocks = self.open_bytes(site)
        return Opened(blocks, site.presence_books(blocks.files.exists_many, self.medium),
                      self._read_gbps(blocks, site))

    def open_books(self, site: StoreSite) -> tuple[SecondaryIndex, float]:
        blocks = self.open_bytes(site)
        return (site.presence_books(blocks.files.exists_many, self.medium),
                self._read_gbps(blocks, site))

    def open_bytes(self, site: StoreSite) -> FsBlocks:
        from kvtier.tier.stores.fs.blocks import DIR_MODE, BlockFiles, FsBlocks

        knobs = self._knobs(site.config)
        # Under a secret, its directory is the secret's: another secret's blocks are never
        # found, never removed.
        namespace = site.mac.store_namespace(site.namespace) if site.mac else site.namespace
        files = BlockFiles(Path(str(knobs["path"])), namespace)
        try:
            files.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"kv_stores['fs']['path']={knobs['path']!r}: cannot create "
                              f"{files.dir} ({e.strerror or type(e).__name__})") from None
        return FsBlocks(files, self.medium, site.mac, bool(knobs.get("fsync", False)))

    def _knobs(self, config: TierConfig) -> Mapping[str, Any]:
        return config.kv_stores[self.name]

    def _read_gbps(self, blocks: FsBlocks, site: StoreSite) -> float:
        """Configured, else a few scratch blocks written, dropped from the page cache where
        the kernel allows, and read back; a slow guess where that fails."""
        given = self._knobs(site.config).get("read_gbps")
        if given:
            return float(given)
        scratch = blocks.files.dir / f".kvtier-probe-{os.getpid()}"
        try:
            return cold_read_gbps(scratch, site.slot_bytes, PROBE_BLOCKS)
        except OSError as e:
            log.warning("kvtier: the fs store's read rate could not be measured in %s (%s); "
                        "the planner starts from %.1f GB/s (set kv_stores.fs.read_gbps)",
                        blocks.files.dir, e.strerror or e, UNMEASURED_GBPS)
            return UNMEASURED_GBPS


FS = FsKind()
