"""Remote tier URLs, checked before any connection and printed with the password masked:
one server (`redis://`, `rediss://`, `unix://`) or a cluster (`redis-cluster://h1:p1,h2:p2`,
`rediss-cluster://`). Valkey speaks the same protocol: `valkey://`, `valkeys://`,
`valkey-cluster://` and `valkeys-cluster://` name the same forms."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier.errors import ConfigError

ACCEPTED_URLS = ("redis://[[user]:password@]host[:port][/db], rediss://... (TLS), "
                 "unix:///path/to/socket, or redis-cluster://[[user]:password@]host:port"
                 "[,host:port...] (rediss-cluster:// for TLS); valkey:// in place of redis://")
CLUSTER_SCHEMES = ("redis-cluster", "rediss-cluster")
# Valkey's schemes, as the Redis ones they mean (the protocol is the same)
VALKEY_SCHEMES = {"valkey": "redis", "valkeys": "rediss", "valkey-cluster": "redis-cluster",
                  "valkeys-cluster": "rediss-cluster"}
SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES, *VALKEY_SCHEMES)


def as_redis_url(url: str) -> str:
    """`url` with a Valkey scheme written as the Redis one it means (others unchanged)."""
    scheme, sep, rest = url.partition("://")
    redis_scheme = VALKEY_SCHEMES.get(scheme.lower()) if sep else None
    return f"{redis_scheme}://{rest}" if redis_scheme else url
DEFAULT_PORT = 6379
# Query parameters a URL may carry; anything else (timeouts, retries) is kvtier's to set.
URL_QUERY_KEYS = frozenset({"db", "username", "password", "client_name", "ssl_cert_reqs",
                            "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"})


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
        for i, item in enumerate(fields):
            if item.partition("=")[0].lower() == "password":
                fields[i] = "password=***"
        rest = f"{base}?{'&'.join(fields)}"
    return f"{scheme}{sep}{rest}"


def is_cluster_url(url: str) -> bool:
    return as_redis_url(url).partition("://")[0].lower() in CLUSTER_SCHEMES


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"invalid Redis URL {mask_url(url)!r}: {why}; expected {ACCEPTED_URLS}")


def validate_url(url: str) -> None:
    """ConfigError (password masked) unless `url` is one of the accepted forms."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"invalid Redis URL {url!r}: expected {ACCEPTED_URLS}")
    url = as_redis_url(url)
    if is_cluster_url(url):
        parse_cluster_url(url)
        return
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise _bad(url, str(e)) from None
    if parts.scheme not in ("redis", "rediss", "unix") or "://" not in url:
        raise _bad(url, "unsupported scheme")
    if parts.fragment:
        raise _bad(url, "unexpected '#' fragment")
    _check_query(url, parse_qsl(parts.query, keep_blank_values=True))
    if parts.scheme == "unix":
        if not parts.path or parts.path == "/":
            raise _bad(url, "no socket path")
        return
    if not parts.hostname:
        raise _bad(url, "no host")
    if port == 0:
        raise _bad(url, "port 0")
    db = parts.path.lstrip("/")
    if (db and not db.isdigit()) or parts.path.count("/") > 1:
        raise _bad(url, "the path must be a database number, as in /0")


def _check_query(url: str, pairs: list[tuple[str, str]]) -> None:
    for key, value in pairs:
        if key not in URL_QUERY_KEYS:
            raise _bad(url, f"unsupported query parameter {key!r}")
        if key == "db" and not value.isdigit():
            raise _bad(url, "the db must be a number")


@dataclass(frozen=True)
class ClusterUrl:
    """A cluster's startup nodes and the connection options every node shares."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    options: tuple[tuple[str, str], ...] = ()  # client_name and ssl_* query parameters


def parse_cluster_url(url: str) -> ClusterUrl:
    """`redis-cluster://[[user]:password@]h1:p1[,h2:p2...][/0][?opts]`; ConfigError if not."""
    url = as_redis_url(url)
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    if "#" in rest or "#" in query:
        raise _bad(url, "unexpected '#' fragment")
    userinfo, _, hosts = rest.rpartition("@")
    hosts, slash, db = hosts.partition("/")
    if slash and db not in ("", "0"):
        raise _bad(url, "a cluster has database 0 only")
    nodes = tuple(_node(url, item) for item in hosts.split(","))
    pairs = parse_qsl(query, keep_blank_values=True)
    _check_query(url, pairs)
    options = {k: v for k, v in pairs}
    if options.pop("db", "0") != "0":
        raise _bad(url, "a cluster has database 0 only")
    user, colon, secret = userinfo.partition(":")  # without a colon, a user (as redis-py)
    username = options.pop("username", unquote(user)) or None
    password = options.pop("password", unquote(secret) if colon else "") or None
    return ClusterUrl(nodes, scheme.lower() == "rediss-cluster", username, password,
                      tuple(sorted(options.items())))


def _node(url: str, item: str) -> tuple[str, int]:
    if not item:
        raise _bad(url, "an empty node in the host list")
    if item.startswith("["):  # [::1]:7000
        host, close, port = item[1:].partition("]")
        if not close or (port and not port.startswith(":")):
            raise _bad(url, f"bad node {item!r}")
        port = port[1:]
    else:
        host, colon, port = item.rpartition(":")
        if not colon:
            host, port = item, ""
    if not host:
        raise _bad(url, f"no host in node {item!r}")
    if port and not port.isdigit():
        raise _bad(url, f"bad port in node {item!r}")
    number = int(port) if port else DEFAULT_PORT
    if not 0 < number < 65536:
        raise _bad(url, f"port out of range in node {item!r}")
    return host, number
