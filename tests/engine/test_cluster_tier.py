"""The remote tier on a real Redis Cluster: blocks cross processes and shards byte-exact,
and a dead, failed-over or full shard only ever costs misses, never a wrong token."""

from __future__ import annotations

import time
from typing import Any

import pytest
from redis_cluster import LocalCluster
from test_tier_faults import (
    Engine,
    assert_same,
    greedy_answers,
    prompt,
    second_prompt,
    written_remote,
)

from kvtier.model.loader import LoadedModel

BLOCKS = 6  # full blocks of prompt() + its answer (116 tokens, 16 a block)
# A request's lookups and fetches wait at most one socket timeout per round of per-node
# pipelines (kvtier's 0.5 s); with the tiny model's compute, a request finishes well inside.
STALL_BOUND_S = 2.0


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> Any:
    return greedy_answers(tiny)


def conversations(tiny: LoadedModel, url: str, salts: range) -> dict[int, list[int]]:
    """One engine serves a first turn per salt (written through to the cluster); the
    second turns, by salt."""
    a = Engine(tiny, remote_kv_url=url)
    try:
        nexts = {s: second_prompt(prompt(s), a.run(prompt(s))) for s in salts}
        a.engine.drain()
        assert a.deep()["written_blocks"].get("remote", 0) >= BLOCKS * len(salts)
    finally:
        a.close()
    return nexts


def test_blocks_cross_processes_and_land_on_every_master(
        tiny: LoadedModel, redis_cluster_factory: Any, reference: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    ids = written_remote(cluster.url)  # process A
    spread = cluster.keys_per_master()
    b = Engine(tiny, remote_kv_url=cluster.url)
    try:
        out = b.run(ids)
        stats = b.deep()
    finally:
        b.close()
    assert out.residency == "remote" and out.num_restored_tokens == BLOCKS * 16
    assert_same(out, reference(ids))
    assert stats["fetched_blocks"] == {"remote": BLOCKS} and stats["misses"] == {}
    assert len(spread) == 3 and min(spread.values()) >= 1, spread


def test_a_dead_master_without_replica_costs_only_its_blocks(
        tiny: LoadedModel, redis_cluster_factory: Any, reference: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3)
    nexts = conversations(tiny, cluster.url, range(20, 28))
    b = Engine(tiny, remote_kv_url=cluster.url)
    try:
        dead = cluster.masters()[0]
        cluster.kill(dead)
        restored, longest = [], 0.0
        for ids in nexts.values():
            began = time.monotonic()
            out = b.run(ids)
            longest = max(longest, time.monotonic() - began)
            assert_same(out, reference(ids))
            restored.append(out.num_restored_tokens // 16)
        stats = b.deep()
    finally:
        b.close()
    # Each prefix is served up to its first block on the dead shard, and only that far.
    assert 0 < sum(restored) < BLOCKS * len(nexts), restored
    assert stats["remote"]["lookups_answered_absent"] >= 1  # runs cut by the dead shard
    assert set(stats["misses"]) <= {"remote:unavailable"}, stats["misses"]
    assert stats["remote"]["nodes_down"] == [f"127.0.0.1:{dead.port}"]  # its breaker alone
    assert longest < STALL_BOUND_S, longest


def test_failover_costs_misses_only_in_its_window(
        tiny: LoadedModel, redis_cluster_factory: Any, reference: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3, replicas=1)
    nexts = conversations(tiny, cluster.url, range(30, 34))
    cluster.wait_ready()  # the replicas hold the blocks
    dead = cluster.masters()[0]
    heir = cluster.replica_of(dead)
    assert heir is not None
    cluster.kill(dead)
    during = Engine(tiny, remote_kv_url=cluster.url)
    try:
        for ids in nexts.values():  # inside the window: misses, right answers
            assert_same(during.run(ids), reference(ids))
    finally:
        during.close()
    promoted_s = cluster.wait_promoted(heir)
    after = Engine(tiny, remote_kv_url=cluster.url)
    try:
        outs = {s: after.run(ids) for s, ids in nexts.items()}
        stats = after.deep()
    finally:
        after.close()
    for s, out in outs.items():
        assert_same(out, reference(nexts[s]))
        assert out.residency == "remote" and out.num_restored_tokens == BLOCKS * 16
    assert stats["misses"] == {} and stats["fetched_blocks"] == {"remote": BLOCKS * len(nexts)}
    assert promoted_s < 10.0


def test_evictions_under_allkeys_lru_are_misses(
        tiny: LoadedModel, redis_cluster_factory: Any, reference: Any) -> None:
    cluster: LocalCluster = redis_cluster_factory(masters=3, maxmemory="3mb")
    nexts = conversations(tiny, cluster.url, range(40, 100))
    evicted = sum(cluster.info(n, "stats")["evicted_keys"] for n in cluster.masters())
    b = Engine(tiny, remote_kv_url=cluster.url)
    try:
        outs = {s: b.run(ids) for s, ids in nexts.items()}
        stats = b.deep()
    finally:
        b.close()
    for s, out in outs.items():
        assert_same(out, reference(nexts[s]))
    assert evicted > 0
    assert any(o.num_restored_tokens < BLOCKS * 16 for o in outs.values())
    assert any(o.residency == "remote" for o in outs.values())
    assert set(stats["misses"]) <= {"remote:missing"}, stats["misses"]
