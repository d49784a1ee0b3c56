"""The remote tier's byte store: batched SET/MGET/EXISTS/DEL on Redis or Valkey.

A remote tier is an optimisation, never a dependency: when the server is down, slow or
erroring, every call raises `RemoteUnavailable` (the caller treats it as a miss) and a
circuit breaker then refuses calls without touching the network for `retry_after_s`, so an
outage costs one timeout per window instead of one per request. A fetch that misses its
deadline (`get_many_into`'s) opens the breaker too: a slow server is treated as a failing
one. Writes wait `write_timeout_s` (longer than a read's: a starved server still keeps up);
one that times out raises `RemoteTimeout`. Wrong credentials are a configuration mistake,
not an outage: they raise `ConfigError`.
Keys are namespaced by a fingerprint of the model and cache layout, so two models or
configurations sharing one server never read each other's blocks.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from kvtier.errors import ConfigError, KvtierError
from kvtier.tier.stores.redis.breaker import Breaker
from kvtier.tier.stores.redis.direct import (
    AUTH_ERRORS,
    DeadlinePassed,
    DirectReader,
    direct_supported,
)
from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.unavailable import RemoteDeadline, RemoteTimeout, RemoteUnavailable
from kvtier.tier.stores.redis.url import ACCEPTED_URLS, as_redis_url, mask_url, validate_url

NAMESPACE_BYTES = 16

T = TypeVar("T")


def check_store_args(namespace: bytes, ttl_s: float | None, timeout_s: float,
                     retry_after_s: float, write_timeout_s: float | None = None) -> None:
    """ConfigError for a knob no remote store can work with."""
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ConfigError(f"remote tier namespace must be a {NAMESPACE_BYTES}-byte digest, "
                          f"got {namespace!r}")
    if ttl_s is not None and not ttl_s > 0:
        raise ConfigError(f"remote tier TTL must be positive seconds or unset, got {ttl_s}")
    if not timeout_s > 0:
        raise ConfigError(f"remote tier timeout must be positive seconds, got {timeout_s}")
    if write_timeout_s is not None and not write_timeout_s > 0:
        raise ConfigError(f"remote_write_timeout_s must be positive seconds, got "
                          f"{write_timeout_s}")
    if not retry_after_s >= 0:
        raise ConfigError(f"remote tier retry_after_s must be >= 0, got {retry_after_s}")


def key_prefix(namespace: bytes) -> bytes:
    """Every block key of one namespace starts with this (one Redis key per block)."""
    return b"kvtier:" + namespace.hex().encode() + b":"


def ttl_ms(ttl_s: float | None) -> int | None:
    return None if ttl_s is None else max(1, round(ttl_s * 1000))


def expiries_ms(px: int | None, count: int, keep_until: Sequence[float]) -> list[int | None]:
    """Each item's PX: the store's TTL, stretched to a retention deadline that outlives it
    (no TTL: nothing expires, retained or not)."""
    if px is None or not keep_until:
        return [px] * count
    now = time.time()
    return [max(px, round((until - now) * 1000)) for until in keep_until]


def renewals_ms(keep_until: Sequence[float]) -> list[tuple[int, int]]:
    """(index, milliseconds left) of each deadline still ahead: the TTL a renewal asks for."""
    now = time.time()
    left = [(i, round((until - now) * 1000)) for i, until in enumerate(keep_until)]
    return [(i, ms) for i, ms in left if ms > 0]


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def timed_out(e: BaseException) -> bool:
    """Whether a store call failed by waiting too long (not a refusal or a reset)."""
    return isinstance(e, (redis.TimeoutError, TimeoutError))


def with_deadline_misses(n: int, e: RemoteDeadline) -> list[Any]:
    """A batch of `n` values cut by a fetch's deadline: the leading ones that landed, then
    `e` for each one that did not."""
    return [*e.landed, *[e] * (n - len(e.landed))]


class KeyedStore(ABC):
    """What one server and a cluster share: the checked knobs, the URL as it may be logged,
    one key per block in the namespace, the errors seen, and `ping` over `check`."""

    def __init__(self, url: str, namespace: bytes, ttl_s: float | None, timeout_s: float,
                 retry_after_s: float, write_timeout_s: float | None = None) -> None:
        check_store_args(namespace, ttl_s, timeout_s, retry_after_s, write_timeout_s)
        self._url_for_log = mask_url(url)
        self._prefix = key_prefix(namespace)
        self._px = ttl_ms(ttl_s)
        self._lock = threading.Lock()
        self.errors = 0
        self.last_error = ""

    @property
    def url_for_log(self) -> str:
        return self._url_for_log

    def key(self, block_key: bytes) -> bytes:
        """The key of one block in this store's namespace (no hash tag: on a cluster, the
        blocks spread over the shards)."""
        return self._prefix + block_key.hex().encode()

    @abstractmethod
    def check(self) -> None:
        """ConfigError on bad credentials, RemoteUnavailable if the store does not answer."""

    def keep_many(self, keys: Sequence[bytes], keep_until: Sequence[float]
                  ) -> list[RemoteUnavailable | None]:
        """Per key None once its TTL reaches its deadline (PEXPIRE GT: never shortened, an
        absent key stays absent), or why it was not: its shard did not answer, or the
        server refused the command (before Redis 7 it knows no GT: refused, not an outage);
        RemoteUnavailable raised for a whole batch one server could not take."""
        out: list[RemoteUnavailable | None] = [None] * len(keys)
        renew = renewals_ms(keep_until) if self._px is not None else []  # no TTL: kept
        if not renew:
            return out
        replies = self._expire_gt([self.key(keys[i]) for i, _ in renew], [ms for _, ms in renew])
        for (i, _), reply in zip(renew, replies):
            if isinstance(reply, RemoteUnavailable):
                out[i] = reply
            elif isinstance(reply, Exception):
                out[i] = RemoteUnavailable(f"remote tier {self._url_for_log} refused to "
                                           f"keep a block: {one_line(reply)}")
        return out

    @abstractmethod
    def _expire_gt(self, names: Sequence[bytes], ms: Sequence[int]) -> list[Any]:
        """Each name's reply to `PEXPIRE name ms GT`, an exception object where refused."""

    def ping(self) -> bool:
        """Whether the store answers now; never raises."""
        try:
            self.check()
        except KvtierError:
            return False
        return True

    def describe(self) -> dict[str, Any]:
        return {"errors": self.errors, "last_error": self.last_error, "url": self.url_for_log}

    def _record(self, e: BaseException) -> str:
        reason = one_line(e)
        with self._lock:
            self.errors += 1
            self.last_error = reason
        return reason

    def _late(self, e: DeadlinePassed, breaker: Breaker, where: str) -> RemoteDeadline:
        """A fetch cut at its deadline: once the request went out, slow counts as failing
        (the breaker opens, the error is recorded); before that, nothing was learned."""
        if e.sent:
            breaker.failed()
            detail = self._record(e)
        else:
            breaker.released()
            detail = str(e)
        return RemoteDeadline(f"remote tier {self._url_for_log} {where}: {detail}", e.landed)


class RedisStore(KeyedStore):
    """Batched byte store over one Redis/Valkey server, each batch one round trip;
    `write_timeout_s` (None: `timeout_s`) is what a write waits, on a client of its own."""

    def __init__(self, url: str, namespace: bytes, ttl_s: float | None = None,
                 timeout_s: float = 0.5, retry_after_s: float = 1.0,
                 write_timeout_s: float | None = None) -> None:
        validate_url(url)
        super().__init__(url, namespace, ttl_s, timeout_s, retry_after_s, write_timeout_s)
        url = as_redis_url(url)  # valkey:// is the same protocol; logs keep what was given
        # One immediate retry on a broken connection only: a pooled socket left stale by a
        # server restart reconnects at once, while a timeout is never paid twice.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s, retry=retry)
            self._writer = self._client if write_timeout_s in (None, timeout_s) else \
                redis.Redis.from_url(url, socket_timeout=write_timeout_s,
                                     socket_connect_timeout=timeout_s, retry=retry)
        except ValueError as e:
            raise ConfigError(f"invalid Redis URL {self._url_for_log!r}: {e}; "
                              f"expected {ACCEPTED_URLS}") from None
        self._breaker = Breaker(retry_after_s)
        # fetches into host rows over a connection of its own (direct.py); TLS: bytes
        self._direct = DirectReader.for_url(url, timeout_s) if direct_supported(url) else None

    def put_many(self, items: Sequence[tuple[bytes, bytes]], keep_until: Sequence[float] = ()
                 ) -> list[RemoteUnavailable | None]:
        """Per item None once stored (one server: the batch fails whole, by raising)."""
        if not items:
            return []
        px = expiries_ms(self._px, len(items), keep_until)

        def put(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for (block_key, value), ms in zip(items, px):
                pipe.set(self.key(block_key), value, px=ms)
            pipe.execute()

        self._call("put", put, self._writer)
        return [None] * len(items)

    def _expire_gt(self, names: Sequence[bytes], ms: Sequence[int]) -> list[Any]:
        def keep(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, left in zip(names, ms):
                pipe.pexpire(name, left, gt=True)
            return list(pipe.execute(raise_on_error=False))

        return self._call("keep", keep, self._writer)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | RemoteUnavailable | None]:
        """Per key its value or None (absent); RemoteUnavailable raised for the batch."""
        if not keys:
            return []
        names = [self.key(k) for k in keys]
        # decode_responses is off: every value is bytes (or None, absent)
        return self._call("get", lambda client: cast("list[bytes | RemoteUnavailable | None]",
                                                     list(client.mget(names))))

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                      header_limit: int, deadline: float | None = None
                      ) -> list[bytes | Landed | RemoteUnavailable | None]:
        """As `get_many`, each value whose payload fits its `out` received straight into it;
        by `deadline` (monotonic; over TLS, checked only before the call), the values not
        landed are a RemoteDeadline each."""
        if self._direct is None:
            return list(self.get_many(keys))
        if not keys:
            return []
        direct, names = self._direct, [self.key(k) for k in keys]
        try:
            return list(self._call("get", lambda _: direct.mget_into(names, outs, header_limit,
                                                                     deadline)))
        except RemoteDeadline as e:
            return with_deadline_misses(len(keys), e)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists(client: redis.Redis) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.key(k))
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", exists)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` were present (and are now gone)."""
        if not keys:
            return 0
        names = [self.key(k) for k in keys]
        return int(self._call("delete", lambda client: client.delete(*names)))

    def check(self) -> None:
        """One PING: ConfigError on bad credentials, RemoteUnavailable if unreachable."""
        self._call("ping", lambda client: client.ping())

    def close(self) -> None:
        self._client.close()
        if self._writer is not self._client:
            self._writer.close()
        if self._direct is not None:
            self._direct.close()

    def _call(self, what: str, op: Callable[[redis.Redis], T],
              client: redis.Redis | None = None) -> T:
        if not self._breaker.allow():
            raise RemoteUnavailable(
                f"remote tier {self._url_for_log} unavailable (retry in "
                f"{self._breaker.retry_in():.1f}s): {self.last_error}")
        try:
            result = op(self._client if client is None else client)
        except redis.DataError:
            self._breaker.released()
            raise  # a value redis-py cannot encode: the caller's bug, not an outage
        except AUTH_ERRORS as e:
            self._breaker.released()
            self._record(e)
            raise ConfigError(auth_message(f"Redis at {self._url_for_log}", e)) from None
        except DeadlinePassed as e:
            raise self._late(e, self._breaker, what) from None
        except (redis.RedisError, OSError) as e:
            self._breaker.failed()
            reason = self._record(e)
            error = RemoteTimeout if what == "put" and timed_out(e) else RemoteUnavailable
            raise error(f"remote tier {self._url_for_log} {what} failed: {reason}") from e
        except BaseException:
            self._breaker.released()  # a bug of ours: a probe it held must not stay held
            raise
        self._breaker.succeeded()
        return result


def auth_message(where: str, e: BaseException,
                 example: str = "redis://:PASSWORD@host:port/0") -> str:
    """What to fix when the server refused the URL's credentials (never the password)."""
    text = str(e)
    if "without any password" in text or "no password is set" in text:
        return f"{where} has no password set: remove the password from the URL"
    if "Authentication required" in text or "already authenticated" in text:
        return f"{where} requires a password: put it in the URL, as in {example}"
    if isinstance(e, NoPermissionError):
        return f"{where}: the user in the URL lacks a permission kvtier needs ({text})"
    return f"{where} rejected the credentials in the URL ({text}): check user and password"
