"""What the remote tier asks of its byte store, so one server (`RedisStore`) and a cluster
(`ClusterStore`) sit behind the same tier: batched, per-key answers, never a crash."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.tier.stores.redis.unavailable import RemoteUnavailable


@dataclass(frozen=True)
class Landed:
    """A value received straight into the caller's row: the row holds its tail (the
    payload), `header` the bytes before it."""

    header: bytes


class KeyValueStore(Protocol):
    """Batched byte store; a whole batch that cannot be served raises `RemoteUnavailable`,
    one key that cannot (its shard is down) is answered with a `RemoteUnavailable`."""

    @property
    def url_for_log(self) -> str: ...

    def key(self, block_key: bytes) -> bytes:
        """The store's key of one block (namespaced)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]], keep_until: Sequence[float] = ()
                 ) -> list[RemoteUnavailable | None]:
        """Store the items; `keep_until[i]` (Unix time, 0: none): item i expires no sooner."""
        ...

    def keep_many(self, keys: Sequence[bytes], keep_until: Sequence[float]
                  ) -> list[RemoteUnavailable | None]:
        """Key i expires no sooner than `keep_until[i]` (Unix time): its TTL is stretched,
        never shortened; an absent key stays absent, and with no TTL nothing expires."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | RemoteUnavailable | None]:
        ...

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                      header_limit: int, deadline: float | None = None
                      ) -> list[bytes | Landed | RemoteUnavailable | None]:
        """As `get_many`, but a value up to `header_limit` bytes longer than its `out` may
        land in it (`Landed`); a store that cannot do that returns the bytes. What has not
        landed by `deadline` (`time.monotonic()`) is a `RemoteDeadline` per key."""
        ...

    def exists_many(self, keys: Sequence[bytes]) -> Sequence[bool | None]:
        """Per key whether it is held; None where the store could not say (one dead shard):
        presence is only a hint."""
        ...

    def delete_many(self, keys: Sequence[bytes]) -> int: ...

    def check(self) -> None:
        """ConfigError on bad credentials, RemoteUnavailable if unreachable."""
        ...

    def ping(self) -> bool: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Errors so far and the last one, for the tier's report."""
        ...
