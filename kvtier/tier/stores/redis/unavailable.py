"""The errors a shared store raises when it cannot serve in time (no redis import needed to
catch them, so the rest of the worker loads on a machine without the Redis client).

  RemoteUnavailable   down, refused, erroring, breaker open: Reason.UNAVAILABLE
  RemoteTimeout       a write the store did not acknowledge within its timeout: TIMEOUT
  RemoteDeadline      a fetch's deadline passed: DEADLINE; `landed` holds the values that
                      arrived whole before it (their rows are filled), leading keys first
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import KvtierError
from kvtier.tier.jobs import Reason


class RemoteUnavailable(KvtierError):
    """The remote tier did not answer, timed out or failed: a miss, never a crash."""

    reason = Reason.UNAVAILABLE


class RemoteTimeout(RemoteUnavailable):
    """A write that timed out: the store is alive but slow (starved of CPU, overloaded)."""

    reason = Reason.TIMEOUT


class RemoteDeadline(RemoteUnavailable):
    """A fetch's deadline passed before every value arrived; the connection it was read on
    was retired (never reused mid-reply)."""

    reason = Reason.DEADLINE

    def __init__(self, detail: str, landed: Sequence[Any] = ()) -> None:
        super().__init__(detail)
        self.landed = list(landed)
