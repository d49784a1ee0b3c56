"""MGET whose values land straight in the caller's host rows: one raw RESP2 connection.

redis-py hands every value over as a new `bytes`: inside a vLLM worker each 5.9 MB value
was fresh memory to fault in (~3x the standalone cost) and then one more copy into its host
row, so a 94 MB wake's fetch took 240-390 ms there against 66-82 ms alone. Here a value
whose length says "header + one row" is received with `recv_into` into a small header
buffer and the row itself (already faulted in); any other length comes back whole as bytes
(and fails verification as before). Plain TCP and unix sockets only (TLS stays on redis-py).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import parse_url

from kvtier.tier.worker.remote_store import Landed

RECV_CHUNK = 64 << 10  # a status line or a small value is read in chunks of this size
MAX_VALUE_BYTES = 512 << 20  # Redis's own cap on a value (proto-max-bulk-len)
_CRLF = b"\r\n"


def direct_supported(url: str) -> bool:
    """Whether values from this single-server URL may be received straight into rows."""
    return url.partition("://")[0].lower() in ("redis", "unix")


class DirectReader:
    """MGET into rows over its own connection (opened on first use, reopened after any error:
    a reply cut short leaves the stream unusable). Errors are redis-py's and OSError's, so the
    store maps them as it maps its client's: credentials -> ConfigError, else unavailable."""

    def __init__(self, url: str, timeout_s: float) -> None:
        options: dict[str, Any] = parse_url(url)
        self._path: str | None = options.get("path")
        self._address = (options.get("host", "localhost"), int(options.get("port", 6379)))
        self._handshake: list[tuple[bytes, ...]] = []
        password, username = options.get("password"), options.get("username")
        if password is not None:
            self._handshake.append((b"AUTH", *([username.encode()] if username else []),
                                    password.encode()))
        if int(options.get("db") or 0):
            self._handshake.append((b"SELECT", str(int(options["db"])).encode()))
        if options.get("client_name"):
            self._handshake.append((b"CLIENT", b"SETNAME", options["client_name"].encode()))
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes received past the last parsed item
        self._lock = threading.Lock()

    def mget_into(self, names: Sequence[bytes], outs: Sequence[memoryview],
                  header_limit: int) -> list[bytes | Landed | None]:
        """Per name: Landed (its last len(out) bytes are in `out`, the bytes before them in
        `header`) when the value is longer than `out` by at most `header_limit`; else the
        whole value as bytes, or None if absent. One immediate retry when a pooled
        connection turns out closed before any reply byte (a server restart); never twice
        for a timeout."""
        with self._lock:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    sock = self._connected()
                    sock.sendall(command(b"MGET", *names))
                    head = self._line()
                except (ConnectionError, EOFError) as e:
                    self._close()
                    if fresh or attempt:
                        raise redis.ConnectionError(f"direct MGET: {e}") from None
                    continue
                except BaseException:
                    self._close()
                    raise
                try:
                    return self._values(head, outs, header_limit, len(names))
                except BaseException:
                    self._close()
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._close()

    # -- connection ---------------------------------------------------------------------

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self._path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout_s)
            try:
                sock.connect(self._path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self._address, timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._buf = sock, bytearray()
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

    def _values(self, head: bytes, outs: Sequence[memoryview], header_limit: int,
                n: int) -> list[bytes | Landed | None]:
        if head.startswith(b"-"):
            raise reply_error(head)
        if head[:1] != b"*" or number(head) != n:
            raise redis.ResponseError(f"direct MGET: expected {n} values, got {head[:40]!r}")
        values: list[bytes | Landed | None] = []
        for out in outs:
            line = self._line()
            if line[:1] != b"$":
                raise redis.ResponseError(f"direct MGET: expected a bulk value, got "
                                          f"{line[:40]!r}")
            length = number(line)
            if length > MAX_VALUE_BYTES:  # never allocate what a garbled stream claims
                raise redis.ResponseError(f"direct MGET: a {length}-byte value")
            if length < 0:
                values.append(None)
                continue
            extra = length - len(out)
            if 0 < extra <= header_limit:
                header = bytearray(extra)
                self._exactly(memoryview(header))
                self._exactly(out)
                values.append(Landed(bytes(header)))
            else:
                whole = bytearray(length)
                self._exactly(memoryview(whole))
                values.append(bytes(whole))
            if self._take(2) != _CRLF:
                raise redis.ResponseError("direct MGET: a value not followed by CRLF")
        return values

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
        assert self._sock is not None
        while pos < len(out):
            got = self._sock.recv_into(out[pos:])
            if not got:
                raise EOFError("the server closed the connection mid-value")
            pos += got

    def _fill(self) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(RECV_CHUNK)
        if not chunk:
            raise EOFError("the server closed the connection")
        self._buf += chunk


def number(line: bytes) -> int:
    """The count or length after a RESP type byte; a garbled one is the server's error."""
    try:
        return int(line[1:])
    except ValueError:
        raise redis.ResponseError(f"direct MGET: a garbled length {line[:40]!r}") from None


def command(*parts: bytes) -> bytes:
    """One RESP2 command as an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n" % len(part))
        out.append(part)
        out.append(_CRLF)
    return b"".join(out)


def reply_error(line: bytes) -> redis.RedisError:
    """The redis-py exception for an error reply, so the store maps it as it maps its
    client's (credentials -> AuthenticationError)."""
    text = line[1:].decode(errors="replace") if line[:1] == b"-" else repr(line[:80])
    if text.startswith(("NOAUTH", "WRONGPASS", "ERR invalid password",
                        "ERR AUTH", "ERR Client sent AUTH")):
        return redis.AuthenticationError(text)
    if text.startswith("NOPERM"):
        return redis.exceptions.NoPermissionError(text)
    return redis.ResponseError(text)
