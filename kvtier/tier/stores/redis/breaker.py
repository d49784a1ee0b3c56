"""A circuit breaker for one remote endpoint: after a failure, calls are refused without
touching the network for `retry_after_s`, then one caller probes while the others are still
refused, so an outage costs one timeout per window instead of one per request."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection


class Breaker:
    """Closed (calls go through) or open until a monotonic time; thread-safe."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._open_until: float | None = None
        self._probing = False

    def allow(self) -> bool:
        """Whether a call may go out now; after the window, True for one prober only (it
        must then call `succeeded` or `failed`)."""
        with self._lock:
            if self._open_until is None:
                return True
            if time.monotonic() < self._open_until or self._probing:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._open_until, self._probing = None, False

    def failed(self) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self.retry_after_s
            self._probing = False

    def released(self) -> None:
        """The call ended neither way (the caller's own error): nothing learned, probe freed."""
        with self._lock:
            self._probing = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def retry_in(self) -> float:
        """Seconds until a probe may go out (0 when closed)."""
        with self._lock:
            if self._open_until is None:
                return 0.0
            return max(0.0, self._open_until - time.monotonic())


class NodeBreakers:
    """One `Breaker` per node of a cluster, made on first use; thread-safe."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._by_node: dict[str, Breaker] = {}  # node name -> its breaker

    def of(self, name: str) -> Breaker:
        with self._lock:
            breaker = self._by_node.get(name)
            if breaker is None:
                breaker = self._by_node[name] = Breaker(self.retry_after_s)
            return breaker

    def down(self) -> list[str]:
        """The nodes whose breaker is open, by name."""
        with self._lock:
            breakers = list(self._by_node.items())
        return sorted(name for name, b in breakers if b.is_open)

    def keep(self, serving: Collection[str]) -> None:
        """Forget the nodes that left the slot map: they are gone, not down."""
        with self._lock:
            self._by_node = {k: b for k, b in self._by_node.items() if k in serving}
