"""Block keys (chained content hashes) and where a block's authoritative bytes live."""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence

BlockKey = bytes  # 16-byte blake2b digest; the first block of a chain is seeded by a namespace


class Residency(enum.Enum):
    """Where the authoritative bytes of one logical block are right now."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"
    IN_FLIGHT = "in_flight"
    NONE = "none"  # nowhere: must be recomputed


def hash_block(parent: BlockKey, token_ids: Sequence[int]) -> BlockKey:
    """h_i = H(h_{i-1}, tokens_i): equal keys mean equal namespace and equal whole prefix."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_blocks(
    namespace: BlockKey,
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of every full block of `token_ids` from block index `start` on."""
    keys = []
    prev = namespace if parent is None else parent
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(prev)
    return keys
