"""The remote tier's byte store: batched SET/MGET/EXISTS/DEL on Redis or Valkey.

A remote tier is an optimisation, never a dependency: when the server is down, slow or
erroring, every call raises `RemoteUnavailable` (the caller treats it as a miss) and a
circuit breaker then refuses calls without touching the network for `retry_after_s`, so an
outage costs one timeout per window instead of one per request. Wrong credentials are a
configuration mistake, not an outage: they raise `ConfigError`.
Keys are namespaced by a fingerprint of the model and cache layout, so two models or
configurations sharing one server never read each other's blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from kvtier.errors import ConfigError, KvtierError
from kvtier.tier.worker.unavailable import RemoteUnavailable

ACCEPTED_URLS = ("redis://[[user]:password@]host[:port][/db], rediss://... (TLS) "
                 "or unix:///path/to/socket")
# Query parameters a URL may carry; anything else (timeouts, retries) is kvtier's to set.
URL_QUERY_KEYS = frozenset({"db", "username", "password", "client_name", "ssl_cert_reqs",
                            "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"})
NAMESPACE_BYTES = 16

T = TypeVar("T")


def mask_url(url: str) -> str:
    """`url` with any password replaced by `***`; safe on malformed URLs too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    # Credentials end at the last '@' (a password may hold one); unix:///a@b is a path.
    if "@" in rest and not (scheme == "unix" and rest.startswith("/")):
        userinfo, _, rest = rest.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # Without a colon the userinfo may be a password typed where a user goes: hide it all.
        rest = f"{user}:***@{rest}" if colon else f"***@{rest}"
    base, qsep, query = rest.partition("?")
    if qsep:
        fields = query.split("&")
        for i, field in enumerate(fields):
            if field.partition("=")[0].lower() == "password":
                fields[i] = "password=***"
        rest = f"{base}?{'&'.join(fields)}"
    return f"{scheme}{sep}{rest}"


def validate_url(url: str) -> None:
    """ConfigError (password masked) unless `url` is one of the accepted forms."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"invalid Redis URL {mask_url(url)!r}: {why}; "
                           f"expected {ACCEPTED_URLS}")

    if not isinstance(url, str) or not url:
        raise ConfigError(f"invalid Redis URL {url!r}: expected {ACCEPTED_URLS}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise bad(str(e)) from None
    if parts.scheme not in ("redis", "rediss", "unix") or "://" not in url:
        raise bad("unsupported scheme")
    if parts.fragment:
        raise bad("unexpected '#' fragment")
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in URL_QUERY_KEYS:
            raise bad(f"unsupported query parameter {key!r}")
        if key == "db" and not value.isdigit():
            raise bad("the db must be a number")
    if parts.scheme == "unix":
        if not parts.path or parts.path == "/":
            raise bad("no socket path")
        return
    if not parts.hostname:
        raise bad("no host")
    if port == 0:
        raise bad("port 0")
    db = parts.path.lstrip("/")
    if (db and not db.isdigit()) or parts.path.count("/") > 1:
        raise bad("the path must be a database number, as in /0")


class RedisStore:
    """Batched byte store over one Redis/Valkey server, each batch one round trip."""

    def __init__(self, url: str, namespace: bytes, ttl_s: float | None = None,
                 timeout_s: float = 0.5, retry_after_s: float = 1.0) -> None:
        validate_url(url)
        if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
            raise ConfigError(f"remote tier namespace must be a {NAMESPACE_BYTES}-byte digest, "
                              f"got {namespace!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"remote tier TTL must be positive seconds or unset, got {ttl_s}")
        if not timeout_s > 0:
            raise ConfigError(f"remote tier timeout must be positive seconds, got {timeout_s}")
        if not retry_after_s >= 0:
            raise ConfigError(f"remote tier retry_after_s must be >= 0, got {retry_after_s}")
        self._url_for_log = mask_url(url)
        self._prefix = b"kvtier:" + namespace.hex().encode() + b":"
        self._px = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._retry_after_s = retry_after_s
        # One immediate retry on a broken connection only: a pooled socket left stale by a
        # server restart reconnects at once, while a timeout is never paid twice.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                                socket_connect_timeout=timeout_s, retry=retry)
        except ValueError as e:
            raise ConfigError(f"invalid Redis URL {self._url_for_log!r}: {e}; "
                              f"expected {ACCEPTED_URLS}") from None
        self._lock = threading.Lock()
        self._open_until: float | None = None  # circuit open until this monotonic time
        self._probing = False  # one caller is trying the server after the window
        self.errors = 0
        self.last_error = ""

    @property
    def url_for_log(self) -> str:
        return self._url_for_log

    def key(self, block_key: bytes) -> bytes:
        """The Redis key of one block in this store's namespace."""
        return self._prefix + block_key.hex().encode()

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return

        def put(client: redis.Redis) -> None:
            pipe = client.pipeline(transaction=False)
            for block_key, value in items:
                pipe.set(self.key(block_key), value, px=self._px)
            pipe.execute()

        self._call("put", put)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        names = [self.key(k) for k in keys]
        return self._call("get", lambda client: list(client.mget(names)))

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

    def ping(self) -> bool:
        """Whether the server answers now; never raises."""
        try:
            self.check()
        except KvtierError:
            return False
        return True

    def close(self) -> None:
        self._client.close()

    def _call(self, what: str, op: Callable[[redis.Redis], T]) -> T:
        with self._lock:
            if self._open_until is not None:
                now = time.monotonic()
                if now < self._open_until or self._probing:
                    wait = max(0.0, self._open_until - now)
                    raise RemoteUnavailable(
                        f"remote tier {self._url_for_log} unavailable (retry in {wait:.1f}s): "
                        f"{self.last_error}")
                self._probing = True
        try:
            result = op(self._client)
        except redis.DataError:
            raise  # a value redis-py cannot encode: the caller's bug, not an outage
        except (redis.AuthenticationError, NoPermissionError) as e:
            self._record(e, open_circuit=False)
            raise ConfigError(self._auth_message(e)) from None
        except (redis.RedisError, OSError) as e:
            reason = self._record(e, open_circuit=True)
            raise RemoteUnavailable(f"remote tier {self._url_for_log} {what} failed: "
                                    f"{reason}") from e
        finally:
            with self._lock:
                self._probing = False
        with self._lock:
            self._open_until = None
        return result

    def _record(self, e: BaseException, open_circuit: bool) -> str:
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        with self._lock:
            self.errors += 1
            self.last_error = reason
            if open_circuit:
                self._open_until = time.monotonic() + self._retry_after_s
        return reason

    def _auth_message(self, e: BaseException) -> str:
        text = str(e)
        where = f"Redis at {self._url_for_log}"
        if "without any password" in text or "no password is set" in text:
            return f"{where} has no password set: remove the password from the URL"
        if "Authentication required" in text or "already authenticated" in text:
            return (f"{where} requires a password: put it in the URL, as in "
                    f"redis://:PASSWORD@host:port/0")
        if isinstance(e, NoPermissionError):
            return f"{where}: the user in the URL lacks a permission kvtier needs ({text})"
        return f"{where} rejected the credentials in the URL ({text}): check user and password"
