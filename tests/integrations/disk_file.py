"""Test helpers over the disk tier's slot file: which blocks a process left there, and a
flipped payload byte in one of them (what a bad sector or a stray write would do)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvtier.tier import TierConfig, configured_stores
from kvtier.tier.stores.disk.file import FILE_HEADER_NBYTES, FILE_NAME, read_headers, round_up
from kvtier.tier.stores.disk.kind import DiskKnobs
from kvtier.tier.stores.disk.open import disk_geometry


def disk_knobs(config: TierConfig) -> DiskKnobs:
    """The disk store's knobs `config` holds (given flat or under kv_stores)."""
    [knobs] = [s.knobs for s in configured_stores(config) if s.kind.name == "disk"]
    return knobs  # type: ignore[no-any-return]


def blocks_on_disk(config: TierConfig, slot_bytes: int, block_size: int
                   ) -> dict[tuple[int, ...], int]:
    """token ids -> slot, for every block whose header the file holds."""
    knobs = disk_knobs(config)
    slots, header = disk_geometry(knobs.size, slot_bytes, block_size)
    found = read_headers(str(knobs.path), slots, slot_bytes, header)
    return {h.tokens: slot for slot, h in found}


def flip_payload_byte(config: TierConfig, slot_bytes: int, block_size: int,
                      tokens: Sequence[int], at: int = 5) -> None:
    """Flip one bit of the payload of the block holding `tokens` (its header stays valid)."""
    slot = blocks_on_disk(config, slot_bytes, block_size)[tuple(tokens)]
    knobs = disk_knobs(config)
    _, header = disk_geometry(knobs.size, slot_bytes, block_size)
    area = round_up(header)
    offset = FILE_HEADER_NBYTES + slot * (area + round_up(slot_bytes)) + area + at
    with open(Path(str(knobs.path)) / FILE_NAME, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
