"""Eviction policies: the order in which a tier gives up its unpinned resident keys.

Primitives: `insert(key)` (a new resident), `touch(key)` (a hit), `remove(key)` (forget it,
history included), `evict(n, skip)` (give up n residents in policy order, passing over keys
`skip` says are pinned; None and no change if fewer than n can go; with `partial`, as many
as can go, up to n). A policy never sees slots.
`POLICIES` maps knob names to classes; `make_policy` turns an unknown name into a ConfigError.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from types import MappingProxyType
from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.tier.keys import BlockKey

Skip = Callable[[BlockKey], bool]  # True for a key that must not be evicted now (pinned)


class EvictionPolicy(Protocol):
    """Orders a tier's resident keys for eviction; knows nothing of slots, pins or bytes."""

    def insert(self, key: BlockKey) -> None: ...

    def touch(self, key: BlockKey) -> None: ...

    def remove(self, key: BlockKey) -> None: ...

    def evict(self, n: int, skip: Skip, partial: bool = False) -> list[BlockKey] | None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


def _evictable(keys: Iterable[BlockKey], skip: Skip) -> Iterator[BlockKey]:
    """Keys in the given order, pinned ones left out (lazily: stops when the caller does)."""
    return (key for key in keys if not skip(key))


class LRUPolicy:
    """Least recently inserted or touched goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # unused by LRU; every policy is built the same way
        self._order: OrderedDict[BlockKey, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: BlockKey) -> None:
        assert key not in self._order, f"key {key!r} is already resident"
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        """A hit moves the key to the most recent end; a key not resident is ignored."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, skip: Skip, partial: bool = False) -> list[BlockKey] | None:
        victims = list(islice(_evictable(self._order, skip), n))
        if len(victims) < n and not partial:
            return None
        for key in victims:
            del self._order[key]
        return victims


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003): a one-pass scan of new keys
    cannot flush the keys that were hit more than once.

    Residents are split into `t1` (seen once) and `t2` (hit again since); `b1` and `b2` are
    ghosts, keys recently evicted from each, remembered without a slot. A new key whose ghost
    is in `b1` says t1 was evicted too early and raises `p`, the target size of t1; a ghost in
    `b2` lowers it. Eviction takes t1's oldest key while |t1| > p, else t2's oldest.
    Departure from the paper: the tier evicts before it inserts a batch, so a ghost hit moves
    `p` for the next eviction, not for the one that made room for that key.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"ARC capacity={capacity} must be >= 1 (it is the tier's slots)")
        self.capacity = capacity
        self.p = 0.0  # target size of t1, adapted in [0, capacity]
        self.t1: OrderedDict[BlockKey, None] = OrderedDict()  # residents seen once, oldest first
        self.t2: OrderedDict[BlockKey, None] = OrderedDict()  # residents hit again, oldest first
        self.b1: OrderedDict[BlockKey, None] = OrderedDict()  # ghosts evicted from t1
        self.b2: OrderedDict[BlockKey, None] = OrderedDict()  # ghosts evicted from t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def insert(self, key: BlockKey) -> None:
        assert key not in self, f"key {key!r} is already resident"
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
            self._trim_ghosts()

    def touch(self, key: BlockKey) -> None:
        """A hit promotes a t1 key to t2, or refreshes a t2 key; a key not resident is ignored."""
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        """Forget the key entirely, ghost included: a removed key teaches the policy nothing."""
        for keys in (self.t1, self.t2, self.b1, self.b2):
            keys.pop(key, None)

    def evict(self, n: int, skip: Skip, partial: bool = False) -> list[BlockKey] | None:
        old1, old2 = _evictable(self.t1, skip), _evictable(self.t2, skip)
        next1, next2 = next(old1, None), next(old2, None)
        size1 = len(self.t1)
        picks: list[tuple[bool, BlockKey]] = []  # (from t1, key), decided before any change
        while len(picks) < n:
            if next1 is not None and (size1 > self.p or next2 is None):
                picks.append((True, next1))
                size1 -= 1
                next1 = next(old1, None)
            elif next2 is not None:
                picks.append((False, next2))
                next2 = next(old2, None)
            elif partial:
                break
            else:
                return None
        for from_t1, key in picks:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        return [key for _, key in picks]

    def _trim_ghosts(self) -> None:
        """Keep |t1| + |b1| <= c and all four lists <= 2c, dropping the oldest ghosts."""
        while len(self.t1) + len(self.b1) > self.capacity and self.b1:
            self.b1.popitem(last=False)
        while len(self) + len(self.b1) + len(self.b2) > 2 * self.capacity and (self.b1 or self.b2):
            (self.b2 or self.b1).popitem(last=False)


POLICIES: Mapping[str, Callable[[int], EvictionPolicy]] = MappingProxyType(
    {"arc": ARCPolicy, "lru": LRUPolicy}
)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy registered under `name`, sized for `capacity` slots."""
    cls = POLICIES.get(name)
    if cls is None:
        choices = ", ".join(sorted(POLICIES))
        raise ConfigError(f"eviction policy {name!r} is unknown; choose one of {choices}")
    return cls(capacity)
