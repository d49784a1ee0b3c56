"""A slow but alive Redis is cut off at the wake's deadline. A real redis-server behind a
loopback proxy that trickles its replies at 12 KB/s (never silent long enough for a socket
timeout): the fetch ends by its deadline, serves the blocks that landed, misses the rest as
"deadline", retires the connection it was cut on, opens the breaker, and the next wake
recomputes; once the store is fast again it is used again, without a restart. Writes get a
timeout of their own, and one that runs out is Reason.TIMEOUT."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import pytest
import torch
from redis_cluster import LocalCluster
from redis_server import RedisServer
from trickle_proxy import TrickleProxy

from kvtier.tier import KVLayout, Medium
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import FETCHING, Match, TierManager, job_ids
from kvtier.tier.books.presence import SharedBooks, SharedPresence
from kvtier.tier.config import TierConfig
from kvtier.tier.io.thread import TierIO
from kvtier.tier.jobs import Job, Miss, Reason, Result
from kvtier.tier.keys import hash_blocks
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.stores.redis.blocks import RedisBlocks
from kvtier.tier.stores.redis.cluster_store import ClusterStore
from kvtier.tier.stores.redis.store import RedisStore
from kvtier.tier.stores.redis.unavailable import RemoteTimeout

NS = bytes(range(16))
BS, N = 4, 8  # 8 blocks of 4 tokens, about 2.2 KB each as stored
RATE = 12_000  # bytes a second: the trickle of the report
SLACK_S = 0.3  # what a busy 2-core machine may add to a deadline
A = list(range(500, 500 + N * BS))  # the prefix of the slow wake
B = list(range(900, 900 + N * BS))  # another prefix, for the wake after it


def chunks(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i * BS:(i + 1) * BS]) for i in range(len(tokens) // BS)]


KEYS = {"A": hash_blocks(NS, A, BS), "B": hash_blocks(NS, B, BS)}
CHUNKS = {"A": chunks(A), "B": chunks(B)}


def host_pool() -> HostPool:
    layout = KVLayout.from_contiguous(torch.randn(N, 2, BS, 2, 2, 8))
    host = HostPool.like(layout, 2 * N)  # rows 0..7: prefix A's blocks, 8..15: B's
    host.tensor.copy_(torch.randn_like(host.tensor))
    return host


def write_both(host: HostPool, url: str) -> None:
    """Prefixes A and B written to Redis at full speed, through the tier's own write path."""
    store = RedisStore(url, NS)
    io = TierIO(host, NS, [RedisBlocks(store, None, host.slot_bytes)])
    try:
        for job_id, (name, rows) in enumerate((("A", range(N)), ("B", range(N, 2 * N)))):
            io.submit(Job(job_id, Medium.HOST, Medium.REDIS, tuple(rows),
                          keys=tuple(KEYS[name]), tokens=tuple(CHUNKS[name]),
                          media=(Medium.REDIS,) * N, below_slots=(-1,) * N))
            [written] = io.wait_any(5)
            assert written.success
    finally:
        io.close()
        store.close()


class Presence(RedisStore):
    """The presence questions the scheduler side asks, recorded."""

    def __init__(self, url: str) -> None:
        super().__init__(url, NS)
        self.asked: list[int] = []

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked.append(len(keys))
        return super().exists_many(keys)


def manager(slot_bytes: int, exists: Callable[[Sequence[bytes]], list[bool]],
            slow_retry_s: float = 10.0) -> TierManager:
    """The scheduler side over a remote tier: Redis starts at 1 GB/s, a prefill of 100
    tokens a second (so restoring 32 tokens' 18 KB wins by far, until Redis is slow)."""
    ids = job_ids()
    host = HostTier(2 * N)
    below = BelowHost(host, [SharedBooks(SharedPresence(exists))], slot_bytes, ids)
    calibration = Calibration(link_gbps=10.0, transfer_overhead_s=0.0,
                              prefill_tokens_per_s=100.0, tier_gbps={"remote": 1.0})
    return TierManager(TierConfig.of(kv_offloading_size=1), BS, host,
                       Planner(calibration, slow_retry_s=slow_retry_s), slot_bytes, below, ids)


def matched(m: TierManager, rid: str, prefix: str) -> Match:
    for _ in range(200):  # Redis is asked for presence on a thread of its own
        match = m.match(rid, KEYS[prefix], CHUNKS[prefix])
        if match is not None:
            return match
        m.wait_presence()
    raise AssertionError("no presence answer")


def run(io: TierIO, job: Job) -> tuple[Result, float]:
    """The job's result and the seconds from its submission to its result."""
    began = time.monotonic()
    io.submit(job)
    [result] = io.wait_any(10)
    return result, time.monotonic() - began


@pytest.fixture
def slow_redis(redis_server: RedisServer) -> Iterator[tuple[RedisServer, TrickleProxy]]:
    proxy = TrickleProxy(redis_server.port)
    try:
        yield redis_server, proxy
    finally:
        proxy.close()


def wake(m: TierManager, io: TierIO, rid: str, prefix: str) -> tuple[Job, Result, float]:
    assert matched(m, rid, prefix) is FETCHING
    [job] = m.take_jobs()
    result, took = run(io, job)
    return job, result, took


def test_a_trickling_redis_is_cut_at_the_wakes_deadline(
        slow_redis: tuple[RedisServer, TrickleProxy]) -> None:
    server, proxy = slow_redis
    host = host_pool()
    blocks = host.tensor[:N].clone()
    write_both(host, server.url)
    fast = Presence(server.url)  # presence is asked of the server directly
    slow = RedisStore(proxy.url, NS, retry_after_s=60.0)
    io = TierIO(host, NS, [RedisBlocks(slow, None, host.slot_bytes)])
    m = manager(host.slot_bytes, fast.exists_many)
    try:
        proxy.rate = RATE
        job, result, took = wake(m, io, "a", "A")
        # 8 blocks would take ~1.5 s at 12 KB/s; the wake's deadline is the floor, 0.5 s
        assert job.budget_s == 0.5
        assert took < job.budget_s + SLACK_S, took
        landed = result.ok.index(False)
        assert 1 <= landed < N and all(result.ok[:landed])
        assert set(result.reasons[landed:]) == {Reason.DEADLINE}
        for i in range(landed):  # what landed is the bytes that were written
            assert torch.equal(host.tensor[job.host_slots[i]], blocks[i])
        assert slow._direct is not None and slow._direct._sock is None  # cut: retired
        [done] = m.apply([result])
        assert (done.fetched, done.missed, done.slow) == (landed, N - landed, Medium.REDIS)
        assert m.below.stats.misses == {Miss(Medium.REDIS, Reason.DEADLINE): N - landed}
        # The next wake from Redis recomputes: one late fetch moved the planner, and the
        # tokens it found there are counted declined (the slow store is asked, not read).
        match = matched(m, "b", "B")
        assert match.load_keys == () and m.take_jobs() == []
        assert match.declined_tokens == sum(len(c) for c in CHUNKS["B"][:N])
        # And a fetch sent anyway (a decision made before) is refused by the open breaker
        # without a byte to the slow server.
        requested, accepted = proxy.requested, proxy.accepted
        free = [s for s in range(2 * N) if s not in job.host_slots[:landed]][:2]
        refused, took = run(io, Job(99, Medium.REDIS, Medium.HOST, tuple(free),
                                    keys=tuple(KEYS["B"][:2]), tokens=tuple(CHUNKS["B"][:2]),
                                    media=(Medium.REDIS,) * 2, below_slots=(-1, -1),
                                    budget_s=0.5))
        assert refused.reasons == (Reason.UNAVAILABLE, Reason.SKIPPED) and took < 0.1
        assert (proxy.requested, proxy.accepted) == (requested, accepted)
        m.finished("a")
        m.finished("b")
        assert m.host.stats.pinned == 0 and m.below.pinned_for_requests == 0
        assert m.host_hits(KEYS["A"], CHUNKS["A"]) == landed  # the missed slots are free
    finally:
        io.close()
        for store in (slow, fast):
            store.close()
        m.close()


def test_a_store_that_recovers_is_used_again_without_a_restart(
        slow_redis: tuple[RedisServer, TrickleProxy]) -> None:
    server, proxy = slow_redis
    host = host_pool()
    write_both(host, server.url)
    fast = RedisStore(server.url, NS)
    slow = RedisStore(proxy.url, NS, retry_after_s=0.3)
    io = TierIO(host, NS, [RedisBlocks(slow, None, host.slot_bytes)])
    m = manager(host.slot_bytes, fast.exists_many, slow_retry_s=0.5)
    try:
        proxy.rate = RATE
        _, late, _ = wake(m, io, "a", "A")
        [done] = m.apply([late])
        assert done.slow is Medium.REDIS
        assert matched(m, "b", "B").load_keys == () and m.take_jobs() == []  # recompute
        proxy.rate = None  # the store recovers
        time.sleep(0.6)  # past the planner's cool-down and the breaker's window
        job, result, took = wake(m, io, "c", "B")
        assert result.success and took < job.budget_s
        [done] = m.apply([result])
        assert done.fetched == N and done.slow is None and m.planner.slowdowns == {}
        assert matched(m, "c", "B").load_keys == tuple(KEYS["B"])
    finally:
        io.close()
        for store in (slow, fast):
            store.close()
        m.close()


def test_a_trickling_cluster_node_is_cut_at_the_deadline_and_its_breaker_opens(
        redis_cluster_factory: Callable[..., LocalCluster]) -> None:
    """One master that announces the proxy's port: every client reaches it through there."""
    cluster = redis_cluster_factory(masters=1)
    node = cluster.nodes[0]
    proxy = TrickleProxy(node.port)
    with node.client() as client:
        client.config_set("cluster-announce-port", proxy.port)
    url = f"redis-cluster://127.0.0.1:{proxy.port}"
    store = ClusterStore(url, NS, retry_after_s=60.0, write_timeout_s=2.0)
    hasty = ClusterStore(url, NS)  # writes wait as long as reads: 0.5 s
    host = host_pool()
    blocks = host.tensor[:N].clone()
    io = TierIO(host, NS, [RedisBlocks(store, None, host.slot_bytes)])
    fetch = Job(2, Medium.REDIS, Medium.HOST, tuple(range(N, 2 * N)), keys=tuple(KEYS["A"]),
                tokens=tuple(CHUNKS["A"]), media=(Medium.REDIS,) * N,
                below_slots=(-1,) * N, budget_s=0.5)
    try:
        for cluster_store in (store, hasty):  # clients built, slot maps read: then it stalls
            cluster_store.check()
        proxy.delay_s = 0.8  # a starved node: writes wait for its replies on their own clients
        written, _ = run(io, Job(1, Medium.HOST, Medium.REDIS, tuple(range(N)),
                                 keys=tuple(KEYS["A"]), tokens=tuple(CHUNKS["A"]),
                                 media=(Medium.REDIS,) * N, below_slots=(-1,) * N))
        assert written.success
        [lost] = hasty.put_many([(b"k", b"v")])
        assert isinstance(lost, RemoteTimeout)
        proxy.delay_s, proxy.rate = 0.0, RATE
        result, took = run(io, fetch)
        assert took < 0.5 + SLACK_S, took
        landed = result.ok.index(False)
        assert 1 <= landed < N and set(result.reasons[landed:]) == {Reason.DEADLINE}
        assert torch.equal(host.tensor[N:N + landed], blocks[:landed])
        assert store.describe()["nodes_down"] == [f"127.0.0.1:{proxy.port}"]
        requested = proxy.requested
        refused, took = run(io, replace(fetch, id=3))
        assert refused.reasons[0] is Reason.UNAVAILABLE and took < 0.1
        assert proxy.requested == requested  # the node's breaker: not a byte sent
    finally:
        io.close()
        for cluster_store in (store, hasty):
            cluster_store.close()
        proxy.close()


def test_a_deadline_already_past_touches_nothing(
        slow_redis: tuple[RedisServer, TrickleProxy]) -> None:
    """A fetch that waited out its budget behind a write: no byte goes out, and the store is
    not taken for slow (its breaker stays closed)."""
    _, proxy = slow_redis
    store = RedisStore(proxy.url, NS)
    try:
        store.check()
        requested = proxy.requested
        rows = [memoryview(bytearray(8)) for _ in range(3)]
        got = store.get_many_into([b"a", b"b", b"c"], rows, 64, time.monotonic() - 0.1)
        assert [r.reason for r in got] == [Reason.DEADLINE] * 3  # type: ignore[union-attr]
        assert proxy.requested == requested and not store._breaker.is_open
    finally:
        store.close()


def test_a_fetch_that_meets_its_deadline_is_unchanged(redis_server: RedisServer) -> None:
    host = host_pool()
    blocks = host.tensor[:N].clone()
    write_both(host, redis_server.url)
    store = RedisStore(redis_server.url, NS)
    io = TierIO(host, NS, [RedisBlocks(store, None, host.slot_bytes)])
    try:
        for job_id in (1, 2):
            result, _ = run(io, Job(job_id, Medium.REDIS, Medium.HOST, tuple(range(N, 2 * N)),
                                    keys=tuple(KEYS["A"]), tokens=tuple(CHUNKS["A"]),
                                    media=(Medium.REDIS,) * N, below_slots=(-1,) * N,
                                    budget_s=5.0))
            assert result.success
            assert torch.equal(host.tensor[N:], blocks)
        reader = store._direct
        assert reader is not None and reader._sock is not None  # one connection, kept
        assert reader._sock_timeout == 0.5  # never lowered: the deadline was never near
    finally:
        io.close()
        store.close()


def test_a_starved_store_keeps_up_with_the_write_timeout(
        slow_redis: tuple[RedisServer, TrickleProxy]) -> None:
    """Replies 0.8 s late (a loopback Redis starved of CPU): the 0.5 s a read waits would
    lose the write; the write timeout (2 s by default) keeps it. One that runs out is a
    TIMEOUT, not an outage's UNAVAILABLE."""
    _, proxy = slow_redis
    proxy.delay_s = 0.8
    host = host_pool()
    patient = RedisStore(proxy.url, NS, write_timeout_s=2.0)
    hasty = RedisStore(proxy.url, NS)  # writes wait as long as reads: 0.5 s
    io = TierIO(host, NS, [RedisBlocks(hasty, None, host.slot_bytes)])
    try:
        assert patient.put_many([(b"k", b"v")]) == [None]
        with pytest.raises(RemoteTimeout):
            hasty.put_many([(b"k", b"v")])
        hasty._breaker.succeeded()  # its breaker opened; close it for the tier's write
        written, _ = run(io, Job(1, Medium.HOST, Medium.REDIS, (0, 1),
                                 keys=tuple(KEYS["A"][:2]), tokens=tuple(CHUNKS["A"][:2]),
                                 media=(Medium.REDIS,) * 2, below_slots=(-1, -1)))
        assert written.reasons == (Reason.TIMEOUT, Reason.TIMEOUT)
    finally:
        io.close()
        for store in (patient, hasty):
            store.close()
