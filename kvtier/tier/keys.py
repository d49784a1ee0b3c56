"""Block keys (a chained content hash), the media a block can live on, and swap keys.

    h_i = H(h_{i-1}, token_ids_i), h_{-1} = the fingerprint's namespace (tenant salt included)
Equal keys mean equal namespace and equal whole prefix; token ids confirm every hit anyway.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence

BlockKey = bytes  # 16-byte blake2b digest; the first block of a chain is seeded by a namespace

SWAP_PREFIX = b"swap:"


class Medium(str, enum.Enum):
    """Where a block's bytes can be; the value is the label used in stats and metrics."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"

    def __str__(self) -> str:  # "remote" in messages, not "Medium.REMOTE"
        return self.value


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


def swap_key(request_id: str, block_index: int) -> BlockKey:
    """Key of a preempted sequence's partial last block: not content-addressable, per request."""
    return SWAP_PREFIX + f"{request_id}:{block_index}".encode()


def is_swap_key(key: BlockKey) -> bool:
    return key.startswith(SWAP_PREFIX)
