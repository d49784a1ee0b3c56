"""A circuit breaker for one remote endpoint: after a failure, calls are refused without
touching the network for `retry_after_s`, then one caller probes while the others are still
refused, so an outage costs one timeout per window instead of one per request."""

from __future__ import annotations

import threading
import time


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
