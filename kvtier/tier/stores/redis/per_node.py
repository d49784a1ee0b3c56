"""One connection per Redis Cluster node (by its "host:port" name), made on first use and
closed when the node leaves the slot map: the direct readers and the write clients alike."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class PerNode(Generic[C]):
    """`make(address)` builds a node's connection the first time `get` names the node."""

    def __init__(self, make: Callable[[tuple[str, int]], C]) -> None:
        self._make = make
        self._conns: dict[str, C] = {}
        self._lock = threading.Lock()

    def get(self, name: str, address: tuple[str, int]) -> C:
        with self._lock:
            conn = self._conns.get(name)
            if conn is None:
                conn = self._conns[name] = self._make(address)
            return conn

    def keep(self, names: Collection[str]) -> None:
        """Close the connections of nodes not in `names` (they left the slot map)."""
        with self._lock:
            gone = [c for name, c in self._conns.items() if name not in names]
            self._conns = {n: c for n, c in self._conns.items() if n in names}
        for conn in gone:
            conn.close()

    def close(self) -> None:
        self.keep(())
