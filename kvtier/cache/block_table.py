"""A sequence's logical-to-physical block map, with the chained keys of its full blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tier import BlockKey


@dataclass
class BlockTable:
    """Logical block i of a sequence lives in physical device block `block_ids[i]`.

    `keys` holds the chained keys of the full blocks hashed so far (a prefix of the table),
    `num_registered` how many of them are published in the prefix index.
    """

    block_ids: list[int] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    num_registered: int = 0

    def __len__(self) -> int:
        return len(self.block_ids)

    def append(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)

    def clear(self) -> list[int]:
        """Forget every block; returns the physical ids so the caller can release them."""
        ids = self.block_ids
        self.block_ids, self.keys = [], []
        self.num_registered = 0
        return ids
