"""Fetched values that land straight in the caller's host rows: one raw RESP2 connection.

redis-py hands every value over as a new `bytes`: inside a vLLM worker each 5.9 MB value
was fresh memory to fault in (~3x the standalone cost) and then one more copy into its host
row, so a 94 MB wake's fetch took 240-390 ms there against 66-82 ms alone. Here a value
whose length says "header + one row" is received with `recv_into` into a small header
buffer and the row itself (faulted in when the pool was allocated); any other length comes
back whole as bytes (and fails verification as before). One server answers one MGET; a
cluster node answers pipelined GETs, each key's error reply (MOVED, ASK, ...) its own.
Plain TCP and unix sockets only (TLS stays on redis-py).

A fetch's deadline (a `time.monotonic()` instant) bounds the whole exchange, not each read:
before every receive the clock is read, and once the socket's timeout could carry a receive
more than ARM_SLACK_S past the deadline, it is lowered to what is left (so near a deadline
about once per ARM_SLACK_S, and never for a fetch that lands well within its deadline). A
server that trickles its reply is cut off at the deadline with `DeadlinePassed` (the values
that landed whole before it are kept), and the connection is closed: a reply cut short is
never read as the next one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import redis
from redis.connection import parse_url
from redis.exceptions import AskError, MovedError, NoPermissionError

from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.per_node import PerNode

RECV_CHUNK = 64 << 10  # a status line or a small value is read in chunks of this size
MAX_VALUE_BYTES = 512 << 20  # Redis's own cap on a value (proto-max-bulk-len)
_CRLF = b"\r\n"
_AUTH_REPLY_PREFIXES = ("NOAUTH", "WRONGPASS", "ERR invalid password", "ERR AUTH",
                "ERR Client sent AUTH")
# redis-py's errors for refused credentials, on every connection kvtier makes to Redis: a
# configuration mistake (ConfigError), never an outage
AUTH_ERRORS = (redis.AuthenticationError, NoPermissionError)

T = TypeVar("T")
Value = bytes | Landed | None  # a value: landed in its row, whole, or absent
LATE_SLACK_S = 0.005  # a receive that timed out this close to the deadline met it
ARM_SLACK_S = 0.01  # a receive may end this far past a fetch's deadline (see above)


class DeadlinePassed(redis.TimeoutError):
    """A fetch's deadline passed before its reply was whole. `landed`: the leading values
    received whole before it (their rows are filled); `sent`: whether the request went out
    (False: the deadline had passed before anything touched the network)."""

    def __init__(self, landed: Sequence[Any], sent: bool) -> None:
        super().__init__(f"the fetch's deadline passed after {len(landed)} value(s)")
        self.landed, self.sent = list(landed), sent


def direct_supported(url: str) -> bool:
    """Whether values from this single-server URL may be received straight into rows."""
    return url.partition("://")[0].lower() in ("redis", "unix")


class DirectReader:
    """Fetches into rows over its own connection (opened on first use, reopened after any
    error: a reply cut short leaves the stream unusable). Errors are redis-py's and OSError's,
    so a store maps them as it maps its client's: credentials -> ConfigError, else
    unavailable. `where`: (host, port) or a unix socket path; `readonly`: a cluster
    connection that may read from a replica."""

    def __init__(self, where: tuple[str, int] | str, timeout_s: float, *,
                 username: str | None = None, password: str | None = None, db: int = 0,
                 client_name: str | None = None, readonly: bool = False) -> None:
        self._where = where
        self._handshake: list[tuple[bytes, ...]] = []
        if password is not None:
            self._handshake.append((b"AUTH", *([username.encode()] if username else []),
                                    password.encode()))
        if db:
            self._handshake.append((b"SELECT", str(db).encode()))
        if client_name:
            self._handshake.append((b"CLIENT", b"SETNAME", client_name.encode()))
        if readonly:
            self._handshake.append((b"READONLY",))
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._sock_timeout = timeout_s  # the open socket's timeout now (lowered near a deadline)
        self._deadline: float | None = None  # the exchange in progress's, if it has one
        self._buf = bytearray()  # bytes received past the last parsed item
        self._lock = threading.Lock()

    @classmethod
    def for_url(cls, url: str, timeout_s: float) -> DirectReader:
        """A reader for one server's `redis://` or `unix://` URL (`direct_supported`)."""
        options: dict[str, Any] = parse_url(url)
        where: tuple[str, int] | str = (options["path"] if "path" in options else
                                        (options.get("host", "localhost"),
                                         int(options.get("port", 6379))))
        return cls(where, timeout_s, username=options.get("username"),
                   password=options.get("password"), db=int(options.get("db") or 0),
                   client_name=options.get("client_name"))

    def mget_into(self, names: Sequence[bytes], outs: Sequence[memoryview],
                  header_limit: int, deadline: float | None = None) -> list[Value]:
        """One MGET. Per name: Landed (its last len(out) bytes are in `out`, the bytes before
        them in `header`) when the value is longer than `out` by at most `header_limit`; else
        the whole value as bytes, or None if absent. An error reply raises; so does a
        `deadline` (monotonic) that passes first (`DeadlinePassed`)."""
        def parse(head: bytes, values: list[Any]) -> list[Value]:
            if head.startswith(b"-"):
                raise reply_error(head)
            if head[:1] != b"*" or number(head) != len(names):
                raise redis.ResponseError(f"direct MGET: expected {len(names)} values, got "
                                          f"{head[:40]!r}")
            for out in outs:
                values.append(self._value(self._line(), out, header_limit))
            return values

        return self._exchange(command(b"MGET", *names), parse, deadline)

    def get_each_into(self, names: Sequence[bytes], outs: Sequence[memoryview],
                      header_limit: int, asking: Collection[int] = (),
                      deadline: float | None = None) -> list[Value | redis.RedisError]:
        """Pipelined GETs (a cluster node: keys of many slots), each as `mget_into`'s values,
        or the key's error reply as an exception (MovedError, AskError, ...); `asking`:
        indices sent after an ASKING (a slot being migrated); `deadline` as `mget_into`'s."""
        request = b"".join((command(b"ASKING") if i in asking else b"") + command(b"GET", name)
                           for i, name in enumerate(names))

        def parse(first: bytes, values: list[Any]) -> list[Value | redis.RedisError]:
            pending = [first]

            def line() -> bytes:
                return pending.pop() if pending else self._line()

            for i, out in enumerate(outs):
                denied = None
                if i in asking:  # ASKING's own reply first: +OK, or why not
                    ok = line()
                    denied = None if ok.startswith(b"+") else reply_error(ok)
                reply = line()
                value = (reply_error(reply) if reply.startswith(b"-")
                         else self._value(reply, out, header_limit))
                values.append(denied or value)
            refused = [v for v in values if isinstance(v, AUTH_ERRORS)]
            if refused:  # the connection's credentials, not one key's trouble
                raise refused[0]
            return values

        return self._exchange(request, parse, deadline)

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- one request, one reply ---------------------------------------------------------

    def _exchange(self, request: bytes, parse: Callable[[bytes, list[Any]], T],
                  deadline: float | None) -> T:
        """Send `request`, parse its reply from the first line on (`parse` appends each
        value to the list it is given as it lands). One immediate retry when a connection
        turns out closed before any reply byte (a server restart); never twice for a
        timeout. Any error closes the connection; a timeout at `deadline` is DeadlinePassed."""
        with self._lock:
            if self._sock is not None and self._sock_timeout != self._timeout_s:
                self._sock.settimeout(self._timeout_s)  # lowered near the last deadline
                self._sock_timeout = self._timeout_s
            self._deadline = deadline
            values: list[Any] = []
            sent = False
            try:
                for attempt in (0, 1):
                    fresh = self._sock is None
                    try:
                        sock = self._connected()
                        self._arm(sock)
                        sock.sendall(request)
                        sent = True
                        first = self._line()
                    except (ConnectionError, EOFError) as e:
                        self._close()
                        if fresh or attempt:
                            raise redis.ConnectionError(f"direct read: {e}") from None
                        continue
                    except BaseException:
                        self._close()
                        raise
                    try:
                        reply = parse(first, values)
                    except EOFError as e:  # closed mid-reply: an outage, as a reset would be
                        self._close()
                        raise redis.ConnectionError(f"direct read: {e}") from None
                    except BaseException:
                        self._close()
                        raise
                    if self._buf:  # bytes past the reply: the stream is not what was asked for
                        self._close()
                    return reply
            except TimeoutError:
                if deadline is None or time.monotonic() < deadline - LATE_SLACK_S:
                    raise  # the socket's own timeout: the server went quiet
                raise DeadlinePassed(values, sent) from None
            finally:
                self._deadline = None
        raise AssertionError("unreachable")

    def _wait_s(self) -> float:
        """How long the next connect or receive may wait: the socket timeout, or less once
        the exchange's deadline is nearer (TimeoutError once it has passed)."""
        if self._deadline is None:
            return self._timeout_s
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's deadline passed")
        return min(self._timeout_s, left)

    def _arm(self, sock: socket.socket) -> None:
        """Before a send or receive: a clock read (none without a deadline), and a
        settimeout only where the socket's timeout could carry it past the deadline."""
        if self._deadline is None:
            return
        wait = self._wait_s()
        if self._sock_timeout > wait + ARM_SLACK_S:
            sock.settimeout(wait)
            self._sock_timeout = wait

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        wait = self._wait_s()
        if isinstance(self._where, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(wait)
            try:
                sock.connect(self._where)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self._where, timeout=wait)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._buf, self._sock_timeout = sock, bytearray(), wait
        try:
            for parts in self._handshake:
                sock.sendall(command(*parts))
                reply = self._line()
                if not reply.startswith(b"+"):
                    raise reply_error(reply)
        except BaseException:
            self._close()
            raise
        return sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buf = None, bytearray()

    # -- parsing ------------------------------------------------------------------------

    def _value(self, line: bytes, out: memoryview, header_limit: int) -> Value:
        """The bulk value `line` announces: into `out` (and a header) where it fits."""
        if line.startswith(b"-"):
            raise reply_error(line)
        if line[:1] != b"$":
            raise redis.ResponseError(f"direct read: expected a bulk value, got {line[:40]!r}")
        length = number(line)
        if length < 0:
            return None
        if length > MAX_VALUE_BYTES:  # never allocate what a garbled stream claims
            raise redis.ResponseError(f"direct read: a {length}-byte value")
        extra = length - len(out)
        value: Value
        if 0 < extra <= header_limit:
            header = bytearray(extra)
            self._exactly(memoryview(header))
            self._exactly(out)
            value = Landed(bytes(header))
        else:
            whole = bytearray(length)
            self._exactly(memoryview(whole))
            value = bytes(whole)
        if self._take(2) != _CRLF:
            raise redis.ResponseError("direct read: a value not followed by CRLF")
        return value

    def _line(self) -> bytes:
        """One CRLF-terminated line, without the CRLF."""
        while True:
            end = self._buf.find(_CRLF)
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 2]
                return line
            self._fill()

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        got = bytes(self._buf[:n])
        del self._buf[:n]
        return got

    def _exactly(self, out: memoryview) -> None:
        """Fill `out` with the stream's next len(out) bytes: what is buffered, then
        straight from the socket into `out`."""
        have = min(len(self._buf), len(out))
        out[:have] = self._buf[:have]
        del self._buf[:have]
        pos = have
        sock = self._sock
        assert sock is not None
        while pos < len(out):
            self._arm(sock)
            got = sock.recv_into(out[pos:])
            if not got:
                raise EOFError("the server closed the connection mid-value")
            pos += got

    def _fill(self) -> None:
        assert self._sock is not None
        self._arm(self._sock)
        chunk = self._sock.recv(RECV_CHUNK)
        if not chunk:
            raise EOFError("the server closed the connection")
        self._buf += chunk


def node_readers(timeout_s: float, *, username: str | None, password: str | None,
                 client_name: str | None, readonly: bool) -> PerNode[DirectReader]:
    """A `DirectReader` per cluster node, every one with the cluster's credentials."""
    def make(address: tuple[str, int]) -> DirectReader:
        return DirectReader(address, timeout_s, username=username, password=password,
                            client_name=client_name, readonly=readonly)

    return PerNode(make)


def number(line: bytes) -> int:
    """The count or length after a RESP type byte; a garbled one is the server's error."""
    try:
        return int(line[1:])
    except ValueError:
        raise redis.ResponseError(f"direct read: a garbled length {line[:40]!r}") from None


def command(*parts: bytes) -> bytes:
    """One RESP2 command as an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n" % len(part))
        out.append(part)
        out.append(_CRLF)
    return b"".join(out)


def reply_error(line: bytes) -> redis.RedisError:
    """The redis-py exception for an error reply, so a store maps it as it maps its
    client's (credentials -> AuthenticationError, a moved slot -> MovedError)."""
    text = line[1:].decode(errors="replace") if line[:1] == b"-" else repr(line[:80])
    code, _, rest = text.partition(" ")
    try:
        if code == "MOVED":
            return MovedError(rest)
        if code == "ASK":
            return AskError(rest)
    except ValueError:  # not "slot host:port"
        return redis.ResponseError(text)
    if text.startswith(_AUTH_REPLY_PREFIXES):
        return redis.AuthenticationError(text)
    if code == "NOPERM":
        return NoPermissionError(text)
    return redis.ResponseError(text)
