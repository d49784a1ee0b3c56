"""The local disk store as the builder sees it: `disk_kv_path` and `disk_kv_size`, one slot
file per process, its index rebuilt from the file at start."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.config import TierConfig
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.keys import Medium
from kvtier.tier.stores.disk.probe import measure_disk_gbps

if TYPE_CHECKING:
    from kvtier.tier.stores.disk.blocks import DiskBlocks


class DiskKind:
    """A local disk tier: never shared (its file is locked by one process)."""

    name = "disk"
    medium = Medium.DISK
    shared = False

    def configured(self, config: TierConfig) -> bool:
        return config.disk_kv_size > 0

    def check(self, config: TierConfig) -> None:
        if self.name in config.kv_stores:
            raise ConfigError("kv_stores['disk']: the disk store's knobs are disk_kv_path, "
                              "disk_kv_size, disk_kv_max_gbps and disk_kv_read_gbps")
        if config.disk_kv_size < 0:
            raise ConfigError(f"disk_kv_size={config.disk_kv_size} GiB must be >= 0 (0 = off)")
        if config.disk_kv_size > 0 and not config.disk_kv_path:
            raise ConfigError("disk_kv_size is set but disk_kv_path is not; name a directory")
        if config.disk_kv_path and config.disk_kv_size == 0:
            raise ConfigError("disk_kv_path is set but disk_kv_size is 0; give its size in GiB")
        for name in ("disk_kv_max_gbps", "disk_kv_read_gbps"):
            value = getattr(config, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be > 0 (or unset)")

    def open_both(self, site: StoreSite) -> Opened:
        blocks, index = self._open(site)
        return Opened(blocks, index, self._read_gbps(site))

    def open_books(self, site: StoreSite) -> tuple[SecondaryIndex, float]:
        from kvtier.tier.stores.disk.open import read_disk_index

        index = read_disk_index(site.config, site.slot_bytes, site.encoding, site.namespace,
                                site.block_size, site.changes, site.tenancy)
        return index, self._read_gbps(site)

    def open_bytes(self, site: StoreSite) -> DiskBlocks:
        return self._open(site)[0]  # the index rebuilt invalidates the slots it cannot take

    def _open(self, site: StoreSite) -> tuple[DiskBlocks, SecondaryIndex]:
        """The slot file (opened, locked, closed by `site.undo` on a failure) and its index."""
        from kvtier.tier.stores.disk.blocks import DiskBlocks
        from kvtier.tier.stores.disk.open import open_disk

        store, index = open_disk(site.config, site.slot_bytes, site.encoding, site.namespace,
                                 site.block_size, site.changes, site.tenancy)
        site.undo.callback(store.close)
        return DiskBlocks(store, site.config.disk_kv_max_gbps), index

    def _read_gbps(self, site: StoreSite) -> float:
        """The planner's starting read rate: configured, else measured; capped."""
        config = site.config
        rate = config.disk_kv_read_gbps or measure_disk_gbps(Path(str(config.disk_kv_path)),
                                                             site.slot_bytes)
        cap = config.disk_kv_max_gbps
        return min(rate, cap) if cap else rate


DISK = DiskKind()
