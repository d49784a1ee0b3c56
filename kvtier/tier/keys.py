"""Block keys (a chained content hash), the media a block can live on, and swap keys.

    h_i = H(h_{i-1}, token_ids_i), h_{-1} = the fingerprint's namespace (tenant salt included)
Equal keys mean equal namespace and equal whole prefix; token ids confirm every hit anyway.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import ClassVar

BlockKey = bytes  # 16-byte blake2b digest; the first block of a chain is seeded by a namespace

SWAP_PREFIX = b"swap:"


class Medium(str):
    """Where a block's bytes can be: the device, host memory, or a store below host. An open
    set: each store names its own (`declare`), and the name is the label used in stats,
    metrics and reports. `shared`: a store other instances read too (a wake from it is a
    "remote" residency; from a local one, "disk")."""

    __slots__ = ()
    _shared: ClassVar[dict[str, bool]] = {}
    _interned: ClassVar[dict[str, Medium]] = {}  # one object per name: `is` compares, as enums
    DEVICE: ClassVar[Medium]
    HOST: ClassVar[Medium]
    DISK: ClassVar[Medium]
    REDIS: ClassVar[Medium]

    def __new__(cls, name: str) -> Medium:
        medium = cls._interned.get(name)
        if medium is None:
            medium = cls._interned.setdefault(name, super().__new__(cls, name))
        return medium

    def __reduce__(self) -> tuple[type[Medium], tuple[str]]:
        return Medium, (self.value,)  # unpickled (another process) as the same object

    @classmethod
    def declare(cls, name: str, shared: bool) -> Medium:
        """The medium of a store below host, declared once (the same again is a no-op)."""
        if not name.isidentifier() or name in ("device", "host"):
            raise ValueError(f"a store's medium must be an identifier other than device and "
                             f"host, not {name!r}")
        if cls._shared.setdefault(name, shared) != shared:
            raise ValueError(f"medium {name!r} is already declared with shared="
                             f"{cls._shared[name]}")
        return cls(name)

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def shared(self) -> bool:
        """Whether other instances read this medium's blocks too."""
        return Medium._shared.get(self.value, False)

    def __repr__(self) -> str:
        return f"Medium({self.value!r})"


Medium.DEVICE, Medium.HOST = Medium("device"), Medium("host")
Medium.DISK = Medium.declare("disk", shared=False)  # the local disk store's
Medium.REDIS = Medium.declare("remote", shared=True)  # Redis / Valkey; its label stays "remote"


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


def partial_keys(parent: BlockKey, token_ids: Sequence[int], block_size: int
                 ) -> list[tuple[BlockKey, Sequence[int]]]:
    """Every proper leading part of a block's tokens after `parent`, longest first, with its
    key: a cache breakpoint inside a block keeps the tokens before it under such a key (a
    part hashes fewer tokens than a full block, so no part's key is a full block's)."""
    top = min(len(token_ids), block_size - 1)
    return [(hash_block(parent, token_ids[:n]), token_ids[:n]) for n in range(top, 0, -1)]


def chain_parents(keys: Sequence[BlockKey]) -> list[BlockKey | None]:
    """Each key's parent where `keys` are a prefix from its first block (the tiers drop a
    prefix from its tail with these)."""
    return [None, *keys[:-1]]


def swap_key(request_id: str, block_index: int) -> BlockKey:
    """Key of a preempted sequence's partial last block: not content-addressable, per request."""
    return SWAP_PREFIX + f"{request_id}:{block_index}".encode()


def is_swap_key(key: BlockKey) -> bool:
    return key.startswith(SWAP_PREFIX)
