"""RedisStore against a real redis-server: bytes survive, namespaces and TTLs hold, and an
outage (refused, hung, killed and restarted) is a fast RemoteUnavailable, never a hang."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest
import redis
from redis_server import RedisServer, free_port

from kvtier.errors import ConfigError
from kvtier.tier.stores.redis.store import RedisStore
from kvtier.tier.stores.redis.unavailable import RemoteUnavailable
from kvtier.tier.stores.redis.url import mask_url

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))


def fails_in(store: RedisStore, call: Callable[[RedisStore], object]) -> float:
    """Seconds `call` took to raise RemoteUnavailable."""
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        call(store)
    return time.monotonic() - t0


def test_binary_round_trip(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    items = [(b"\x00\xff", bytes(range(256))), (b"empty", b""),
             (b"big", os.urandom(1 << 20)), (bytes(32), b"\r\n$3\r\n")]
    store.put_many(items)
    keys = [k for k, _ in items]
    assert store.get_many([*keys, b"missing"]) == [v for _, v in items] + [None]
    assert store.exists_many([b"missing", *keys]) == [False, True, True, True, True]
    assert store.delete_many([b"big", b"missing"]) == 1
    assert store.get_many([b"big", b"empty"]) == [None, b""]
    assert store.ping()
    assert store.errors == 0 and store.last_error == ""
    store.close()


def test_caller_bug_is_not_an_outage(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    with pytest.raises(redis.DataError):
        store.put_many([(b"k", None)])  # type: ignore[list-item]
    store.put_many([(b"k", b"v")])  # the circuit stayed closed
    assert store.get_many([b"k"]) == [b"v"] and store.errors == 0


def test_empty_inputs_never_touch_the_network() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}", NS)  # nothing listens there
    store.put_many([])
    assert store.get_many([]) == []
    assert store.exists_many([]) == []
    assert store.delete_many([]) == 0
    assert store.errors == 0


def test_namespaces_keep_blocks_apart(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url, NS), RedisStore(redis_server.url, OTHER_NS)
    a.put_many([(b"block", b"model A")])
    assert b.get_many([b"block"]) == [None]
    b.put_many([(b"block", b"model B")])
    assert a.get_many([b"block"]) == [b"model A"]
    assert b.get_many([b"block"]) == [b"model B"]
    assert a.delete_many([b"block"]) == 1
    assert b.exists_many([b"block"]) == [True]
    with redis_server.client() as client:
        expected = b"kvtier:" + OTHER_NS.hex().encode() + b":" + b"block".hex().encode()
        assert client.keys() == [expected]


def test_ttl_expires_blocks(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS, ttl_s=0.25)
    forever = RedisStore(redis_server.url, OTHER_NS)
    store.put_many([(b"k", b"v")])
    forever.put_many([(b"k", b"v")])
    with redis_server.client() as client:
        assert 0 < client.pttl(store.key(b"k")) <= 250
        assert client.pttl(forever.key(b"k")) == -1  # no expiry without a TTL
    time.sleep(0.35)
    assert store.get_many([b"k"]) == [None]
    assert store.exists_many([b"k"]) == [False]
    assert forever.get_many([b"k"]) == [b"v"]


def test_keep_stretches_ttls_and_never_shortens_or_creates(redis_server: RedisServer) -> None:
    """A retention granted after a block was written reaches its TTL: stretched to the
    deadline, never cut short, an absent key left absent, and no TTL left as none."""
    store = RedisStore(redis_server.url, NS, ttl_s=30.0)
    forever = RedisStore(redis_server.url, OTHER_NS)
    store.put_many([(b"a", b"v"), (b"b", b"v")])
    forever.put_many([(b"a", b"v")])
    now = time.time()
    assert store.keep_many([b"a", b"absent", b"b"], [now + 3600, now + 3600, now - 5]) \
        == [None] * 3
    assert forever.keep_many([b"a"], [now + 3600]) == [None]
    assert store.keep_many([], []) == []
    with redis_server.client() as client:
        assert 3_590_000 < client.pttl(store.key(b"a")) <= 3_600_000
        assert 0 < client.pttl(store.key(b"b")) <= 30_000  # a passed deadline asks nothing
        assert client.exists(store.key(b"absent")) == 0
        assert client.pttl(forever.key(b"a")) == -1
    store.keep_many([b"a"], [time.time() + 60])  # a shorter deadline never shortens it
    with redis_server.client() as client:
        assert client.pttl(store.key(b"a")) > 3_500_000


def test_a_server_refusing_the_renewal_answers_per_key_and_stays_usable(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that knows no PEXPIRE GT (before Redis 7; here a flag it refuses) refuses
    each renewal: answered per key, and the store is not taken for down."""
    store = RedisStore(redis_server.url, NS, ttl_s=30.0)
    store.put_many([(b"a", b"v")])
    monkeypatch.setattr(redis.client.Pipeline, "pexpire",
                        lambda pipe, name, ms, gt=False: pipe.execute_command(
                            "PEXPIRE", name, ms, "NOSUCHFLAG"))
    [refused] = store.keep_many([b"a"], [time.time() + 3600])
    assert isinstance(refused, RemoteUnavailable) and "refused" in str(refused)
    assert store.get_many([b"a"]) == [b"v"] and store.errors == 0


def test_password(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(password="s3cret")
    good = RedisStore(server.url, NS)
    good.put_many([(b"k", b"v")])
    assert good.get_many([b"k"]) == [b"v"]

    wrong = RedisStore(server.url.replace("s3cret", "hunter2"), NS)
    with pytest.raises(ConfigError, match="rejected the credentials") as e:
        wrong.get_many([b"k"])
    assert "hunter2" not in str(e.value) and "***" in str(e.value)
    assert not wrong.ping()

    missing = RedisStore(f"redis://127.0.0.1:{server.port}/0", NS)
    with pytest.raises(ConfigError, match="requires a password"):
        missing.exists_many([b"k"])
    # A configuration mistake is reported every time, not hidden behind the breaker.
    with pytest.raises(ConfigError):
        missing.put_many([(b"k", b"x")])
    assert good.get_many([b"k"]) == [b"v"]


def test_refused_connection_fails_fast() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", NS, timeout_s=0.5)
    assert fails_in(store, lambda s: s.get_many([b"k"])) < 0.5
    assert store.errors == 1 and "refused" in store.last_error.lower()
    assert "\n" not in store.last_error
    assert not store.ping()


def test_breaker_pays_one_timeout_per_window() -> None:
    # A listener that never answers: connects succeed, every read times out.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        port = hung.getsockname()[1]
        store = RedisStore(f"redis://127.0.0.1:{port}", NS, timeout_s=0.2, retry_after_s=0.5)
        assert fails_in(store, lambda s: s.exists_many([b"k"])) >= 0.15
        calls: list[Callable[[RedisStore], object]] = [
            lambda s: s.get_many([b"k"]), lambda s: s.put_many([(b"k", b"v")]),
            lambda s: s.exists_many([b"k"]), lambda s: s.delete_many([b"k"])]
        for call in calls * 5:  # refused by the open circuit: counted below, not timed
            fails_in(store, call)
        assert not store.ping()
        assert store.errors == 1 and "Timeout" in store.last_error
        hung.setblocking(False)
        accepted = []
        while True:
            try:
                accepted.append(hung.accept()[0])
            except BlockingIOError:
                break
        for conn in accepted:
            conn.close()
        assert len(accepted) == 1  # the open circuit never touched the network
        time.sleep(0.5)  # past the window: the next call tries the server again
        assert fails_in(store, lambda s: s.get_many([b"k"])) >= 0.15
        assert store.errors == 2


def test_server_killed_and_restarted(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS, timeout_s=0.5, retry_after_s=0.3)
    store.put_many([(b"k", b"v")])
    redis_server.stop()
    assert fails_in(store, lambda s: s.get_many([b"k"])) < 0.5
    assert fails_in(store, lambda s: s.put_many([(b"k", b"v")])) < 0.1
    time.sleep(0.3)
    fails_in(store, lambda s: s.exists_many([b"k"]))  # still down: one more real try
    assert store.errors == 2

    redis_server.start()  # same port, empty (nothing is persisted)
    time.sleep(0.3)
    assert store.get_many([b"k"]) == [None]
    store.put_many([(b"k", b"again")])
    assert store.get_many([b"k"]) == [b"again"]
    assert store.ping() and store.errors == 2


def test_a_probe_that_ends_in_an_unexpected_error_does_not_hold_the_breaker_open(
        redis_server: RedisServer) -> None:
    # Issue 42, item 14 asked whether a breaker stayed open: one did, for good, when the
    # call that probed a recovered server raised anything but a Redis or OS error.
    store = RedisStore(redis_server.url, NS, timeout_s=0.5, retry_after_s=0.2)
    redis_server.stop()
    fails_in(store, lambda s: s.get_many([b"k"]))  # the breaker opens
    redis_server.start()
    time.sleep(0.25)

    def bug(client: redis.Redis) -> None:
        raise RuntimeError("a bug in the call, not an outage")

    with pytest.raises(RuntimeError):
        store._call("get", bug)  # the probe
    assert store.get_many([b"k"]) == [None]  # the next call goes out: the probe was freed


def test_concurrent_callers(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, NS)
    failures: list[BaseException] = []

    def work(tag: bytes) -> None:
        try:
            for i in range(50):
                key = tag + i.to_bytes(2, "big")
                store.put_many([(key, key * 3)])
                assert store.exists_many([key]) == [True]
                assert store.get_many([key]) == [key * 3]
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=work, args=(tag,)) for tag in (b"io", b"sched")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@pytest.mark.parametrize("url", [
    "http://user:hunter2@localhost:6379",
    "localhost:6379",
    "redis://:hunter2@",
    "redis://:hunter2@localhost:notaport",
    "redis://:hunter2@localhost:99999",
    "redis://:hunter2@localhost/cache",
    "redis://:hunter2@localhost/0/1",
    "redis://:hunter2@localhost?socket_timeout=9",
    "redis://localhost?db=x&password=hunter2",
    "redis:/:hunter2@localhost",
    "unix://",
    "",
])
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError, match="expected redis://") as e:
        RedisStore(url, NS)
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://localhost", "redis://localhost"),
    ("redis://:pw@10.0.0.5:6380/2", "redis://:***@10.0.0.5:6380/2"),
    ("rediss://alice:p@ss@cache.internal:6379", "rediss://alice:***@cache.internal:6379"),
    ("unix:///run/valkey.sock?db=1&password=pw", "unix:///run/valkey.sock?db=1&password=***"),
])
def test_good_urls_are_masked_for_logs(url: str, masked: str) -> None:
    assert RedisStore(url, NS).url_for_log == masked == mask_url(url)


def test_bad_settings() -> None:
    url = "redis://localhost"
    with pytest.raises(ConfigError, match="16-byte"):
        RedisStore(url, bytes(32))
    with pytest.raises(ConfigError, match="TTL"):
        RedisStore(url, NS, ttl_s=0)
    with pytest.raises(ConfigError, match="timeout"):
        RedisStore(url, NS, timeout_s=0)
