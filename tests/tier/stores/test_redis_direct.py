"""Values received straight into host rows (`RedisStore.get_many_into`, redis_direct.py):
exact bytes, every length and absence handled, credentials and databases honoured, and a
cut, garbled or silent reply a fast RemoteUnavailable that leaves the next call working."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AskError, MovedError
from redis_server import RedisServer, free_port, redis_server_binary

from kvtier.errors import ConfigError
from kvtier.tier.stores.redis.direct import DirectReader
from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.store import RedisStore
from kvtier.tier.stores.redis.unavailable import RemoteUnavailable

NS = bytes(range(16))
ROW = 1 << 20
LIMIT = 512


def rows(n: int, nbytes: int = ROW) -> list[memoryview]:
    return [memoryview(bytearray(b"\xee" * nbytes)) for _ in range(n)]


def test_values_land_in_their_rows_exactly(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    header, payload = os.urandom(200), os.urandom(ROW)
    crlf = b"\r\n$3\r\n*2\r\n" * 10  # protocol bytes inside a value are only bytes
    items = [(b"landed", header + payload), (b"crlf", crlf + payload),
             (b"short", b"x" * 10), (b"exact", payload), (b"long", os.urandom(ROW + LIMIT + 1)),
             (b"empty", b"")]
    store.put_many(items)
    outs = rows(len(items) + 1)
    got = store.get_many_into([*(k for k, _ in items), b"missing"], outs, LIMIT)
    assert got[0] == Landed(header) and outs[0] == payload
    assert got[1] == Landed(crlf) and outs[1] == payload
    # any other length comes back whole, and its row is untouched
    assert got[2:6] == [v for _, v in items[2:]]
    assert got[6] is None
    assert all(bytes(o) == b"\xee" * ROW for o in outs[2:])
    assert store.get_many([b"landed"]) == [header + payload]  # redis-py's path agrees
    store.close()


def test_many_large_values_in_one_call(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    items = [(i.to_bytes(2, "big"), os.urandom(64) + os.urandom(ROW)) for i in range(12)]
    store.put_many(items)
    outs = rows(len(items))
    got = store.get_many_into([k for k, _ in items], outs, LIMIT)
    for (_, value), landed, out in zip(items, got, outs):
        assert landed == Landed(value[:64]) and out == value[64:]
    store.close()


def test_password_and_database_are_honoured(
        redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(password="s3cret")
    url = f"redis://:s3cret@127.0.0.1:{server.port}/3?client_name=kvtier-test"
    store = RedisStore(url, NS)
    store.put_many([(b"k", b"h" * 8 + b"p" * 64)])
    with server.client() as client:  # database 0 does not hold it
        assert client.dbsize() == 0
    outs = rows(1, 64)
    assert store.get_many_into([b"k"], outs, LIMIT) == [Landed(b"h" * 8)]
    assert outs[0] == b"p" * 64
    wrong = RedisStore(url.replace("s3cret", "hunter2"), NS)
    with pytest.raises(ConfigError, match="rejected the credentials") as e:
        wrong.get_many_into([b"k"], outs, LIMIT)
    assert "hunter2" not in str(e.value)
    store.close()
    wrong.close()


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), args=("--unixsocket", str(tmp_path / "r.sock")))
    server.start()
    try:
        yield server
    finally:
        server.close()


def test_a_unix_socket(unix_server: RedisServer) -> None:
    path = unix_server.args[1]
    store = RedisStore(f"unix://{path}?db=1", NS)
    store.put_many([(b"k", b"h" + b"p" * 100)])
    outs = rows(1, 100)
    assert store.get_many_into([b"k"], outs, LIMIT) == [Landed(b"h")]
    assert outs[0] == b"p" * 100
    store.close()


def test_a_restarted_server_is_reached_again(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS, timeout_s=0.5, retry_after_s=0.0)
    store.put_many([(b"k", b"hh" + b"p" * 10)])
    assert store.get_many_into([b"k"], rows(1, 10), LIMIT) == [Landed(b"hh")]
    redis_server.stop()
    with pytest.raises(RemoteUnavailable):
        store.get_many_into([b"k"], rows(1, 10), LIMIT)
    redis_server.start()  # empty; the old connection is stale and is replaced at once
    assert store.get_many_into([b"k"], rows(1, 10), LIMIT) == [None]
    store.put_many([(b"k", b"hh" + b"q" * 10)])
    outs = rows(1, 10)
    assert store.get_many_into([b"k"], outs, LIMIT) == [Landed(b"hh")] and outs[0] == b"q" * 10
    store.close()


class FakeServer:
    """A listener that answers every command with `reply(command_bytes)` (None: close);
    `hang_up`: close the connection after each answer."""

    def __init__(self, reply: Callable[[bytes], bytes | None], hang_up: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.reply, self.hang_up = reply, hang_up
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                while True:
                    data = conn.recv(1 << 16)
                    if not data:
                        break
                    out = self.reply(data)
                    if out is None:
                        break
                    conn.sendall(out)
                    if self.hang_up:
                        break

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(("name", "reply"), [
    ("cut mid-value", b"*1\r\n$100\r\n" + b"x" * 40),
    ("wrong count", b"*2\r\n$1\r\na\r\n$1\r\nb\r\n"),
    ("not an array", b"+OK\r\n"),
    ("a number where a value goes", b"*1\r\n:5\r\n"),
    ("an error reply", b"-ERR something broke\r\n"),
    ("no CRLF after the value", b"*1\r\n$3\r\nabcXY"),
    ("a length that is not a number", b"*1\r\n$x1\r\n"),
    ("a length no value can have", b"*1\r\n$99999999999999\r\n"),
])
def test_a_bad_reply_is_unavailable_and_the_next_call_reconnects(name: str,
                                                                  reply: bytes) -> None:
    good = b"*1\r\n$6\r\nhhpppp\r\n"
    replies = iter([reply])
    server = FakeServer(lambda _: next(replies, good))
    try:
        store = RedisStore(f"redis://127.0.0.1:{server.port}", NS, timeout_s=0.3,
                           retry_after_s=0.0)
        with pytest.raises(RemoteUnavailable):
            store.get_many_into([b"k"], rows(1, 4), LIMIT)
        assert store.errors == 1 and "\n" not in store.last_error
        outs = rows(1, 4)
        assert store.get_many_into([b"k"], outs, LIMIT) == [Landed(b"hh")]
        assert outs[0] == b"pppp"
        store.close()
    finally:
        server.close()


def test_a_server_that_hangs_up_mid_value_is_unavailable() -> None:
    server = FakeServer(lambda _: b"*1\r\n$100\r\nhhpp", hang_up=True)
    try:
        store = RedisStore(f"redis://127.0.0.1:{server.port}", NS, timeout_s=1.0)
        with pytest.raises(RemoteUnavailable, match="closed the connection mid-value"):
            store.get_many_into([b"k"], rows(1, 4), LIMIT)
        store.close()
    finally:
        server.close()


def test_a_silent_server_times_out() -> None:
    server = FakeServer(lambda _: b"")  # reads the command, never answers
    try:
        reader = DirectReader(("127.0.0.1", server.port), timeout_s=0.2)
        with pytest.raises(TimeoutError):
            reader.mget_into([b"k"], rows(1, 4), LIMIT)
        reader.close()
    finally:
        server.close()


def test_nothing_listening_is_unavailable() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}", NS, timeout_s=0.3)
    with pytest.raises(RemoteUnavailable, match="refused"):
        store.get_many_into([b"k"], rows(1, 4), LIMIT)


def test_pipelined_gets_answer_each_key_on_its_own(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    store.put_many([(b"a", b"hh" + b"a" * 8), (b"b", b"bbb")])
    with redis_server.client() as client:
        client.rpush(store.key(b"list"), b"x")  # GET on it: a WRONGTYPE error, this key only
    reader = DirectReader(("127.0.0.1", redis_server.port), timeout_s=1.0)
    outs = rows(4, 8)
    got = reader.get_each_into([store.key(k) for k in (b"a", b"list", b"gone", b"b")], outs,
                               LIMIT)
    assert got[0] == Landed(b"hh") and outs[0] == b"a" * 8
    assert isinstance(got[1], redis.ResponseError) and "WRONGTYPE" in str(got[1])
    assert got[2:] == [None, b"bbb"]
    # ASKING outside a cluster is refused: that key's answer, the others still served
    got = reader.get_each_into([store.key(b"a"), store.key(b"b")], rows(2, 8), LIMIT,
                               asking={0})
    assert isinstance(got[0], redis.ResponseError) and got[1] == b"bbb"
    reader.close()
    store.close()


def test_redirections_come_back_as_redis_pys_errors() -> None:
    replies = {b"GET": b"-MOVED 3999 127.0.0.1:6381\r\n$3\r\nabc\r\n-ASK 12 10.0.0.2:7000\r\n"}
    server = FakeServer(lambda data: replies[b"GET"])
    try:
        reader = DirectReader(("127.0.0.1", server.port), timeout_s=1.0)
        got = reader.get_each_into([b"x", b"y", b"z"], rows(3, 8), LIMIT)
        assert isinstance(got[0], MovedError) and got[0].node_addr == ("127.0.0.1", 6381)
        assert got[1] == b"abc"
        assert isinstance(got[2], AskError) and got[2].slot_id == 12
        reader.close()
    finally:
        server.close()


def test_refused_credentials_on_a_pipeline_are_raised_not_per_key() -> None:
    server = FakeServer(lambda _: b"-NOAUTH Authentication required.\r\n" * 2)
    try:
        reader = DirectReader(("127.0.0.1", server.port), timeout_s=1.0)
        with pytest.raises(redis.AuthenticationError):
            reader.get_each_into([b"x", b"y"], rows(2, 8), LIMIT)
        reader.close()
    finally:
        server.close()


def test_bytes_past_a_reply_retire_the_connection() -> None:
    replies = iter([b"*1\r\n$6\r\nhhpppp\r\n+EXTRA\r\n"])
    server = FakeServer(lambda _: next(replies, b"*1\r\n$6\r\nhhqqqq\r\n"))
    try:
        reader = DirectReader(("127.0.0.1", server.port), timeout_s=1.0)
        outs = rows(1, 4)
        assert reader.mget_into([b"k"], outs, LIMIT) == [Landed(b"hh")] and outs[0] == b"pppp"
        # the stray "+EXTRA" is never read as the next reply: a new connection answers
        assert reader.mget_into([b"k"], outs, LIMIT) == [Landed(b"hh")] and outs[0] == b"qqqq"
        assert server.accepted == 2
        reader.close()
    finally:
        server.close()
