"""The error a shared store raises when it cannot be reached (no redis import needed to
catch it, so the rest of the worker loads on a machine without the Redis client)."""

from __future__ import annotations

from kvtier.errors import KvtierError


class RemoteUnavailable(KvtierError):
    """The remote tier did not answer, timed out or failed: a miss, never a crash."""
