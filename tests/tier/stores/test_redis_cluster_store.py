"""ClusterStore against a real Redis Cluster: per-shard answers, redirections followed, a
failover or a migration never surfacing as an error, and URLs checked before any socket."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from redis.crc import key_slot
from redis_cluster import LocalCluster
from redis_server import free_port

from kvtier.errors import ConfigError
from kvtier.tier.config import TierConfig
from kvtier.tier.stores.redis.cluster_store import ClusterStore
from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.unavailable import RemoteUnavailable
from kvtier.tier.stores.redis.url import mask_url, parse_cluster_url, validate_url

NS = b"n" * 16


def blocks(n: int, size: int = 2048) -> list[tuple[bytes, bytes]]:
    return [(os.urandom(16), os.urandom(size)) for _ in range(n)]


def into(store: ClusterStore, keys: list[bytes], size: int = 2048) -> list[Any]:
    """`get_many` through `get_many_into`: each value's last size - 16 bytes land in a row of
    their own (asserted), and come back as the value they were."""
    rows = [memoryview(bytearray(size - 16)) for _ in keys]
    got = store.get_many_into(keys, rows, 64)
    assert not any(isinstance(v, bytes) for v in got)  # nothing came back whole
    return [v.header + bytes(row) if isinstance(v, Landed) else v for v, row in zip(got, rows)]


def wrong(values: list[Any], items: list[tuple[bytes, bytes]]) -> int:
    """Answers that are bytes but not the bytes written: must always be 0."""
    return sum(isinstance(v, bytes) and v != want for v, (_, want) in zip(values, items))


def unlike(values: list[Any], items: list[tuple[bytes, bytes]]) -> dict[int, str]:
    """Per index, what came back instead of the value written ({} when all did): a failure
    names the keys and what they got, not two lists of kilobytes."""
    return {i: "other bytes" if isinstance(v, bytes) else repr(v)[:80]
            for i, (v, (_, want)) in enumerate(zip(values, items)) if v != want}


def served_again(store: ClusterStore, items: list[tuple[bytes, bytes]],
                 within_s: float = 10.0) -> dict[int, str]:
    """What `store` still answers wrong once every key should be served again (a failover
    done): {} as soon as both reads return every value, else the last miss after
    `within_s`. A slot map is re-read once per breaker window, a gossip round later on a
    loaded runner; the values are never wrong meanwhile (asserted)."""
    keys = [k for k, _ in items]
    deadline = time.monotonic() + within_s
    while True:
        got, landed = store.get_many(keys), into(store, keys)
        assert wrong(got, items) == 0 and wrong(landed, items) == 0
        missed = {**unlike(got, items), **unlike(landed, items)}
        if not missed or time.monotonic() > deadline:
            return missed
        time.sleep(0.1)


# -- URLs ---------------------------------------------------------------------------------

def test_cluster_urls_parse() -> None:
    url = parse_cluster_url("rediss-cluster://bob:p%40ss@h1:7000,[::1]:7001,h3?client_name=x")
    assert url.nodes == (("h1", 7000), ("::1", 7001), ("h3", 6379))
    assert url.tls and url.username == "bob" and url.password == "p@ss"
    assert url.options == (("client_name", "x"),)
    assert parse_cluster_url("redis-cluster://:pw@h:1/0").password == "pw"
    assert mask_url("redis-cluster://bob:secret@h1:1,h2:2") == "redis-cluster://bob:***@h1:1,h2:2"


@pytest.mark.parametrize("url, why", [
    ("redis-cluster://", "empty node"),
    ("redis-cluster://h1:1,,h2:2", "empty node"),
    ("redis-cluster://h1:x", "bad port"),
    ("redis-cluster://h1:70000", "out of range"),
    ("redis-cluster://h1:1/3", "database 0 only"),
    ("redis-cluster://h1:1?db=2", "database 0 only"),
    ("redis-cluster://h1:1?socket_timeout=9", "unsupported query parameter"),
    ("redis-cluster://:secret@h1:1#x", "fragment"),
])
def test_bad_cluster_urls_are_config_errors(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as e:
        validate_url(url)
    assert "secret" not in str(e.value)


def test_replica_reads_need_a_cluster_url() -> None:
    with pytest.raises(ConfigError, match="redis-cluster://"):
        TierConfig.of(kv_offloading_size=1, remote_kv_url="redis://h:1/0",
                   remote_kv_read_replicas=True).validate()
    with pytest.raises(ConfigError, match="bad port"):
        TierConfig.of(kv_offloading_size=1, remote_kv_url="redis-cluster://h:p").validate()


# -- a live cluster -----------------------------------------------------------------------

def test_built_lazily_misses_until_the_cluster_is_up(redis_cluster_factory: Any) -> None:
    port = free_port()
    store = ClusterStore(f"redis-cluster://127.0.0.1:{port}", NS, retry_after_s=0.2)
    try:
        began = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            store.get_many([b"k"])
        with pytest.raises(RemoteUnavailable, match="retry in"):  # the breaker, no network
            store.exists_many([b"k"])
        assert time.monotonic() - began < 1.5
    finally:
        store.close()
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    store = ClusterStore(cluster.url, NS)
    try:
        items = blocks(30)
        assert store.put_many(items) == [None] * 30
        assert unlike(store.get_many([k for k, _ in items]), items) == {}
        assert store.exists_many([b"absent"]) == [False]
        assert store.delete_many([k for k, _ in items[:5]]) == 5
    finally:
        store.close()


def test_keep_stretches_ttls_on_every_shard(redis_cluster_factory: Any) -> None:
    """A later retention reaches each key's TTL on the shard that holds it: stretched to its
    deadline, never shortened, an absent key left absent."""
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    store = ClusterStore(cluster.url, NS, ttl_s=30.0)
    try:
        items = blocks(30)
        keys = [k for k, _ in items]
        store.put_many(items)
        now = time.time()
        assert store.keep_many([*keys[:20], b"absent"], [now + 3600] * 21) == [None] * 21
        store.keep_many(keys[:20], [now + 60] * 20)  # shorter: kept as long as before

        def pttl(key: bytes) -> int:
            name = store.key(key)
            with cluster.owner(name).client() as client:
                return int(client.pttl(name))

        assert all(3_500_000 < pttl(k) <= 3_600_000 for k in keys[:20])
        assert all(0 < pttl(k) <= 30_000 for k in keys[20:])
        assert pttl(b"absent") == -2
        assert len({cluster.owner(store.key(k)).port for k in keys[:20]}) == 3
    finally:
        store.close()


@pytest.mark.parametrize("given, why", [("", "requires a password"),
                                         (":wrong-wrong@", "rejected the credentials")])
def test_refused_credentials_are_a_config_error(redis_cluster_factory: Any, given: str,
                                                why: str) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3, password="sesame-sesame")
    url = cluster.url.replace(":sesame-sesame@", given)
    store = ClusterStore(url, NS)
    try:
        with pytest.raises(ConfigError, match=why) as e:
            store.check()
        assert "wrong-wrong" not in str(e.value) and "sesame" not in str(e.value)
    finally:
        store.close()
    good = ClusterStore(cluster.url, NS)
    try:
        good.check()
        items = blocks(3)
        assert good.put_many(items) == [None] * 3
        assert unlike(into(good, [k for k, _ in items]), items) == {}  # AUTH on each node
    finally:
        good.close()


def test_a_dead_shard_answers_its_keys_unavailable_and_only_its_keys(
        redis_cluster_factory: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    store = ClusterStore(cluster.url, NS)
    try:
        items = blocks(60)
        keys = [k for k, _ in items]
        store.put_many(items)
        dead = cluster.masters()[0]
        on_dead = {i for i, k in enumerate(keys) if cluster.owner(store.key(k)) is dead}
        cluster.kill(dead)
        for _ in range(3):  # the first call meets the dead node, the rest its open breaker
            began = time.monotonic()
            for got in (store.get_many(keys), into(store, keys)):
                assert {i for i, v in enumerate(got)
                        if isinstance(v, RemoteUnavailable)} == on_dead
                assert all(got[i] == items[i][1] for i in range(60) if i not in on_dead)
            assert time.monotonic() - began < 2.0
        present = store.exists_many(keys)
        assert {i for i, p in enumerate(present) if p is None} == on_dead
        assert store.keep_many(keys, [time.time() + 60] * 60) == [None] * 60  # no TTL
        kept = ClusterStore(cluster.url, NS, ttl_s=30.0)
        try:
            renewed = kept.keep_many(keys, [time.time() + 3600] * 60)
            assert {i for i, r in enumerate(renewed)
                    if isinstance(r, RemoteUnavailable)} == on_dead
        finally:
            kept.close()
        written = store.put_many(blocks(30))
        assert 0 < sum(w is not None for w in written) < 30
        assert store.describe()["nodes_down"] == [f"127.0.0.1:{dead.port}"]
    finally:
        store.close()


def test_replica_reads_bridge_the_failover_window(redis_cluster_factory: Any) -> None:
    """Counts, per store, the keys answered unavailable while a killed master's replica is
    not yet promoted: with replica reads the replica serves them."""
    cluster: LocalCluster = redis_cluster_factory(masters=3, replicas=1)
    plain = ClusterStore(cluster.url, NS)
    replicas = ClusterStore(cluster.url, NS, read_replicas=True)
    try:
        items = blocks(60)
        keys = [k for k, _ in items]
        plain.put_many(items)
        cluster.wait_ready()  # replicated, and listed in CLUSTER SLOTS from now on
        replicas.check()  # its slot map, replicas included, read now
        dead = cluster.masters()[0]
        heir = cluster.replica_of(dead)
        assert heir is not None
        cluster.kill(dead)
        missed = {"plain": 0, "replicas": 0}
        while cluster.role(heir) != "master":
            for name, store in (("plain", plain), ("replicas", replicas)):
                got = store.get_many(keys)
                assert wrong(got, items) == 0 and wrong(into(store, keys), items) == 0
                missed[name] += sum(isinstance(v, RemoteUnavailable) for v in got)
            time.sleep(0.05)
        cluster.wait_promoted(heir)
        for store in (plain, replicas):
            assert served_again(store, items) == {}
    finally:
        plain.close()
        replicas.close()
    assert missed["plain"] > 0 and missed["replicas"] < missed["plain"], missed


def test_manual_failover_under_load_raises_nothing(redis_cluster_factory: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3, replicas=1)
    store = ClusterStore(cluster.url, NS)
    items = blocks(60)
    keys = [k for k, _ in items]
    store.put_many(items)
    cluster.wait_ready()
    stop, seen, errors = threading.Event(), {"wrong": 0, "calls": 0}, []

    def load() -> None:
        while not stop.is_set():
            try:
                got = store.get_many(keys) if seen["calls"] % 2 else into(store, keys)
                store.put_many(blocks(4))
            except Exception as e:  # anything escaping the store fails the test
                errors.append(e)
                return
            seen["wrong"] += wrong(got, items)
            seen["calls"] += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        old = cluster.masters()[0]
        heir = cluster.replica_of(old)
        assert heir is not None
        cluster.failover(heir)
        cluster.wait_promoted(heir)
        time.sleep(1.5)
    finally:
        stop.set()
        worker.join()
    try:
        assert errors == [] and seen["wrong"] == 0 and seen["calls"] > 5
        assert served_again(store, items) == {}  # MOVED followed to the heir
    finally:
        store.close()


def test_a_slot_migration_is_followed_through_ask_and_moved(redis_cluster_factory: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    store = ClusterStore(cluster.url, NS)
    try:
        items = blocks(20)
        store.put_many(items)
        key, value = items[0]
        name = store.key(key)
        slot, source = key_slot(name), cluster.owner(name)
        target = next(m for m in cluster.masters() if m is not source)
        ids = {n.port: cluster._ask(n, "CLUSTER", "MYID").decode() for n in cluster.masters()}
        cluster._ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
        cluster._ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
        cluster._ask(source, "MIGRATE", "127.0.0.1", target.port, name, 0, 5000)
        assert unlike(store.get_many([k for k, _ in items]), items) == {}  # via ASK
        assert unlike(into(store, [k for k, _ in items]), items) == {}
        for node in cluster.masters():
            cluster._ask(node, "CLUSTER", "SETSLOT", slot, "NODE", ids[target.port])
        assert into(store, [key]) == [value]  # via MOVED (the rows' own connections)
        assert store.get_many([key]) == [value]
        assert store.put_many([(key, value)]) == [None]
        assert cluster.owner(name) is target
    finally:
        store.close()


def test_settings_that_would_cost_blocks_are_named_at_start(
        redis_cluster_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    noevict, strict = cluster.masters()[:2]
    cluster._ask(noevict, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    cluster._ask(strict, "CONFIG", "SET", "cluster-require-full-coverage", "yes")
    store = ClusterStore(cluster.url, NS)
    try:
        with caplog.at_level("WARNING"):
            store.check()
    finally:
        store.close()
    said = caplog.text
    assert f"127.0.0.1:{noevict.port} has maxmemory-policy noeviction" in said
    assert f"127.0.0.1:{strict.port} has cluster-require-full-coverage yes" in said
    assert "has no replicas" in said
