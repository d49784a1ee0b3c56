"""The remote tier's byte store on a Redis Cluster / Valkey cluster.

Each batch is split by the node that owns each key's slot and sent as one pipeline per node,
the nodes in parallel. A node that fails opens its own breaker: its keys are answered
"unavailable" without network for `retry_after_s` while the other shards keep serving (one
dead shard must not turn every batch into a miss, as one whole-batch pipeline would).
Values are immutable and verified on every fetch, so reads from replicas are safe: a replica
that lags can only lack a key. The client is built on first use, so the tier starts while the
cluster is down and misses until it is up.

Bound: a batch waits at most one socket timeout (`timeout_s`) per round of pipelines (nodes
run in parallel), at most two rounds (the second follows MOVED/ASK redirects after a reshard
or failover), plus a topology refresh at most once per `retry_after_s`. A fetch's deadline
cuts every node's reads at once: what landed serves, the rest is a RemoteDeadline per key,
and each node that was still sending opens its breaker (slow counts as failing). Writes wait
`write_timeout_s` on clients of their own; a timed-out one is a RemoteTimeout per key.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from kvtier.errors import ConfigError
from kvtier.tier.stores.redis.breaker import Breaker, NodeBreakers
from kvtier.tier.stores.redis.cluster_client import (
    CLUSTER_EXAMPLE,
    OUTAGES,
    NodeCall,
    connect,
    node_writers,
    pipelined,
    warn_settings,
)
from kvtier.tier.stores.redis.direct import AUTH_ERRORS, DeadlinePassed, node_readers
from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.store import (
    KeyedStore,
    auth_message,
    expiries_ms,
    timed_out,
    with_deadline_misses,
)
from kvtier.tier.stores.redis.unavailable import RemoteDeadline, RemoteTimeout, RemoteUnavailable
from kvtier.tier.stores.redis.url import is_cluster_url, mask_url, parse_cluster_url

log = logging.getLogger(__name__)

MAX_PARALLEL_NODES = 8  # pipelines in flight at once, one per node
TOPOLOGY_REFRESH_S = 10.0  # the slot map is re-read this often even when nothing failed

class ClusterStore(KeyedStore):
    """Batched byte store over a cluster: per-node pipelines, per-node breakers."""

    def __init__(self, url: str, namespace: bytes, ttl_s: float | None = None,
                 timeout_s: float = 0.5, retry_after_s: float = 1.0,
                 read_replicas: bool = False, write_timeout_s: float | None = None) -> None:
        if not isinstance(url, str) or not is_cluster_url(url):
            raise ConfigError(f"a cluster URL starts with redis-cluster:// or "
                              f"rediss-cluster://, got {mask_url(str(url))!r}")
        self._spec = parse_cluster_url(url)
        super().__init__(url, namespace, ttl_s, timeout_s, retry_after_s, write_timeout_s)
        self._timeout_s = timeout_s
        self._retry_after_s = retry_after_s
        self._read_replicas = read_replicas
        self._client: RedisCluster | None = None
        self._building = False
        self._reach = Breaker(retry_after_s)  # the cluster as a whole (building the client)
        self._nodes = NodeBreakers(retry_after_s)
        self._refreshed_at = 0.0
        self._turn = itertools.count()  # spreads reads over a slot's nodes
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_NODES, thread_name_prefix="kvtier-cluster")
        # fetches into host rows, a connection of its own per node (direct.py); TLS:
        # bytes through redis-py
        self._readers = None if self._spec.tls else node_readers(
            timeout_s, username=self._spec.username, password=self._spec.password,
            client_name=dict(self._spec.options).get("client_name"), readonly=read_replicas)
        self._writers = (node_writers(self._spec, timeout_s, write_timeout_s)  # own timeout
                         if write_timeout_s is not None and write_timeout_s != timeout_s else None)

    def put_many(self, items: Sequence[tuple[bytes, bytes]], keep_until: Sequence[float] = ()
                 ) -> list[RemoteUnavailable | None]:
        """Per item None once stored, or why its shard did not take it."""
        names = [self.key(k) for k, _ in items]
        px = expiries_ms(self._px, len(items), keep_until)

        def put(pipe: Any, i: int) -> None:
            pipe.set(names[i], items[i][1], px=px[i])

        out = self._batch("put", names, pipelined(put, self._writers), write=True)
        return [v if isinstance(v, RemoteUnavailable) else None for v in out]

    def _expire_gt(self, names: Sequence[bytes], ms: Sequence[int]) -> list[Any]:
        def keep(pipe: Any, i: int) -> None:
            pipe.pexpire(names[i], ms[i], gt=True)

        return self._batch("keep", names, pipelined(keep, self._writers), write=True)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | RemoteUnavailable | None]:
        """Per key its value, None (absent) or why its shard did not answer."""
        names = [self.key(k) for k in keys]
        return self._batch("get", names, pipelined(lambda pipe, i: pipe.get(names[i])),
                           write=False)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                      header_limit: int, deadline: float | None = None
                      ) -> list[bytes | Landed | RemoteUnavailable | None]:
        """As `get_many`, each value whose payload fits its `out` received straight into it
        (pipelined GETs per node, each on its own connection); by `deadline` (monotonic;
        over TLS, checked only before the call) the values not landed are RemoteDeadline."""
        readers = self._readers
        if readers is None:
            return list(self.get_many(keys))
        names = [self.key(k) for k in keys]

        def fetch(client: RedisCluster, node: ClusterNode, indices: list[int],
                  asking: set[int]) -> list[Any]:
            reader = readers.get(node.name, (node.host, int(node.port)))
            return list(reader.get_each_into(
                [names[i] for i in indices], [outs[i] for i in indices], header_limit,
                {j for j, i in enumerate(indices) if i in asking}, deadline))

        return self._batch("get", names, fetch, write=False)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Per key whether it is held, None where its shard did not answer."""
        names = [self.key(k) for k in keys]
        out = self._batch("exists", names, pipelined(lambda pipe, i: pipe.exists(names[i])),
                          write=False)
        return [None if isinstance(v, RemoteUnavailable) else bool(v) for v in out]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` were present (and are now gone); one DEL per key, since a
        multi-key DEL must stay within one slot."""
        names = [self.key(k) for k in keys]
        out = self._batch("delete", names, pipelined(lambda pipe, i: pipe.delete(names[i])),
                          write=True)
        return sum(v for v in out if isinstance(v, int))

    def check(self) -> None:
        """PING every master: ConfigError on bad credentials, RemoteUnavailable if none
        answers; logs a warning for each server setting that would cost blocks or writes."""
        client = self._cluster()
        self._refresh(client, force=True)  # replicas listed since the client was built
        masters = client.get_primaries()
        answers = self._on_nodes(client, masters, lambda conn: conn.ping())
        if not any(a is True for a in answers.values()):
            raise RemoteUnavailable(f"remote tier {self._url_for_log}: no master answered "
                                    f"PING ({self.last_error})")
        warn_settings(client, [n for n in masters if answers.get(n.name) is True],
                      self._px is not None, self._url_for_log)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            client, self._client = self._client, None
        for nodes in (self._readers, self._writers):
            if nodes is not None:
                nodes.close()
        if client is not None:
            client.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "nodes_down": self._nodes.down()}

    # -- one batch -----------------------------------------------------------------------

    def _batch(self, what: str, names: Sequence[bytes], call: NodeCall,
               write: bool) -> list[Any]:
        """Per name the node's reply (`call` runs each node's keys) or a RemoteUnavailable
        (raised for the whole batch only when no client can be built)."""
        if not names:
            return []
        client = self._cluster()
        # While a node is down, its replica may take its slots: re-read the map (at most
        # once per retry_after_s) before probing it. Replicas appear in CLUSTER SLOTS only
        # once they hold data, so the map is re-read now and then anyway.
        if self._nodes.down() or time.monotonic() - self._refreshed_at > TOPOLOGY_REFRESH_S:
            self._refresh(client)
        out: list[Any] = [None] * len(names)
        groups = self._route(client, range(len(names)), names, write, out)
        redirects, failed = self._send(client, what, groups, call, out, set())
        groups, asking = {}, set[int]()
        if redirects:  # the slot moved (reshard, failover): follow once, then give up
            if any(isinstance(e, MovedError) for e in redirects.values()):
                self._refresh(client)
            groups, asking = self._redirected(client, redirects, out)
        if failed and self._read_replicas and not write:  # another node of the slot may serve
            retry = [i for indices in failed.values() for i in indices]
            again = self._route(client, retry, names, write, out,
                                allowed={name: False for name in failed})
            for node, indices in again.values():
                groups.setdefault(node.name, (node, []))[1].extend(indices)
        if groups:
            self._send(client, what, groups, call, out, asking)
        return out

    def _route(self, client: RedisCluster, indices: Sequence[int], names: Sequence[bytes],
               write: bool, out: list[Any], allowed: dict[str, bool] | None = None
               ) -> dict[str, tuple[ClusterNode, list[int]]]:
        """Each key to a node of its slot whose breaker lets calls through (the master for
        writes; with replica reads on, any of the slot's nodes, in turn; never one that
        `allowed` says no to); keys with none get a RemoteUnavailable in `out`."""
        slots = client.nodes_manager.slots_cache
        allowed = {} if allowed is None else allowed
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i in indices:
            owners = slots.get(key_slot(names[i]))
            if not owners:
                out[i] = RemoteUnavailable(f"remote tier {self._url_for_log}: slot "
                                           f"{key_slot(names[i])} is not served by any node")
                continue
            candidates = owners if self._read_replicas and not write else owners[:1]
            node = self._pick(candidates, allowed)
            if node is None:
                breaker = self._nodes.of(owners[0].name)
                out[i] = RemoteUnavailable(
                    f"remote tier {self._url_for_log}: node {owners[0].name} unavailable "
                    f"(retry in {breaker.retry_in():.1f}s): {self.last_error}")
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return groups

    def _pick(self, candidates: Sequence[ClusterNode], allowed: dict[str, bool]
              ) -> ClusterNode | None:
        start = next(self._turn) % len(candidates) if len(candidates) > 1 else 0
        for k in range(len(candidates)):
            node = candidates[(start + k) % len(candidates)]
            ok = allowed.get(node.name)
            if ok is None:
                ok = allowed[node.name] = self._nodes.of(node.name).allow()
            if ok:
                return node
        return None

    def _send(self, client: RedisCluster, what: str,
              groups: dict[str, tuple[ClusterNode, list[int]]], call: NodeCall,
              out: list[Any], asking: set[int]
              ) -> tuple[dict[int, MovedError | AskError], dict[str, list[int]]]:
        """`call` on each node's keys, the nodes in parallel; fills `out`; the redirected
        keys, and the keys of each node that failed."""
        def run(node: ClusterNode, indices: list[int]) -> list[Any]:
            return call(client, node, indices, asking)

        jobs = list(groups.values())
        if len(jobs) == 1:
            node, ix = jobs[0]
            results = [self._guarded(what, node, functools.partial(run, node, ix))]
        else:
            futures = [self._pool.submit(self._guarded, what, node,
                                         functools.partial(run, node, ix))
                       for node, ix in jobs]
            results = [f.result() for f in futures]
        redirects: dict[int, MovedError | AskError] = {}
        failed: dict[str, list[int]] = {}
        for (node, indices), replies in zip(jobs, results):
            if isinstance(replies, RemoteDeadline):  # no time left to retry elsewhere
                replies = with_deadline_misses(len(indices), replies)
            elif isinstance(replies, RemoteUnavailable):
                failed[node.name] = indices
                for i in indices:
                    out[i] = replies
                continue
            for i, reply in zip(indices, replies):
                if isinstance(reply, RemoteUnavailable):
                    out[i] = reply
                elif isinstance(reply, (MovedError, AskError)):
                    redirects[i] = reply
                elif isinstance(reply, Exception):  # CLUSTERDOWN, TRYAGAIN, OOM...: this key
                    out[i] = RemoteUnavailable(f"remote tier {self._url_for_log} {what} on "
                                               f"{node.name}: {self._record(reply)}")
                else:
                    out[i] = reply
        if failed:  # a master may have died: learn its successor for the next batch
            self._refresh(client)
        return redirects, failed

    def _guarded(self, what: str, node: ClusterNode, call: Callable[[], list[Any]]
                 ) -> list[Any] | RemoteUnavailable:
        """The node's replies; a RemoteUnavailable (its breaker opened) if it failed."""
        breaker = self._nodes.of(node.name)
        try:
            replies = call()
        except redis.DataError:
            breaker.released()
            raise  # a value redis-py cannot encode: the caller's bug, not an outage
        except AUTH_ERRORS as e:
            breaker.released()
            self._record(e)
            raise ConfigError(auth_message(f"Redis Cluster node {node.name}", e,
                                           CLUSTER_EXAMPLE)) from None
        except DeadlinePassed as e:
            return self._late(e, breaker, f"{what} on node {node.name}")
        except OUTAGES as e:
            breaker.failed()
            error = RemoteTimeout if what == "put" and timed_out(e) else RemoteUnavailable
            return error(f"remote tier {self._url_for_log} {what} on node {node.name} "
                         f"failed: {self._record(e)}")
        except BaseException:
            breaker.released()  # a bug of ours: a probe it held must not stay held
            raise
        breaker.succeeded()
        return replies

    def _redirected(self, client: RedisCluster, redirects: dict[int, MovedError | AskError],
                    out: list[Any]) -> tuple[dict[str, tuple[ClusterNode, list[int]]], set[int]]:
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        asking: set[int] = set()
        for i, e in redirects.items():
            node = client.nodes_manager.get_node(host=e.host, port=e.port)
            if node is None or self._nodes.of(node.name).is_open:
                out[i] = RemoteUnavailable(f"remote tier {self._url_for_log}: slot {e.slot_id} "
                                           f"moved to {e.host}:{e.port}, not reachable now")
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
            if isinstance(e, AskError):
                asking.add(i)
        return groups, asking

    # -- the client and the topology -----------------------------------------------------

    def _cluster(self) -> RedisCluster:
        """The client, built on first use (one builder at a time, behind a breaker)."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._building or not self._reach.allow():
                raise RemoteUnavailable(
                    f"remote tier {self._url_for_log} unreachable (retry in "
                    f"{self._reach.retry_in():.1f}s): {self.last_error}")
            self._building = True
        try:
            client = connect(self._spec, self._timeout_s, self._read_replicas)
        except AUTH_ERRORS as e:
            self._reach.released()
            self._record(e)
            raise ConfigError(auth_message(f"Redis Cluster at {self._url_for_log}", e,
                                           CLUSTER_EXAMPLE)) from None
        except OUTAGES as e:
            self._reach.failed()
            raise RemoteUnavailable(f"remote tier {self._url_for_log} unreachable: "
                                    f"{self._record(e)}") from e
        except BaseException:
            self._reach.released()  # a bug of ours: the probe must not stay held
            raise
        finally:
            with self._lock:
                self._building = False
        self._reach.succeeded()
        with self._lock:
            self._client = client
            self._refreshed_at = time.monotonic()
        return client

    def _refresh(self, client: RedisCluster, force: bool = False) -> bool:
        """Re-read the slot map (a node failed or is down, a slot moved), at most once per
        `retry_after_s` unless `force`; whether it was read (a failure leaves the old map)."""
        with self._lock:
            now = time.monotonic()
            if now - self._refreshed_at < self._retry_after_s and not force:
                return False
            self._refreshed_at = now
        try:
            client.nodes_manager.initialize()
        except OUTAGES as e:
            log.debug("kvtier: cluster topology refresh failed: %s", e)
            self._record(e)
            return False
        serving = {n.name for owners in client.nodes_manager.slots_cache.values()
                   for n in owners}
        self._nodes.keep(serving)
        for nodes in (self._readers, self._writers):
            if nodes is not None:
                nodes.keep(serving)
        return True

    def _on_nodes(self, client: RedisCluster, nodes: Sequence[ClusterNode],
                  call: Callable[[redis.Redis], Any]) -> dict[str, Any]:
        """`call` on each node's connection, behind its breaker; per node its answer or
        RemoteUnavailable."""
        answers: dict[str, Any] = {}
        for node in nodes:
            if not self._nodes.of(node.name).allow():
                answers[node.name] = RemoteUnavailable(f"node {node.name} down")
                continue
            answers[node.name] = self._guarded(
                "ping", node, functools.partial(_one, call, client, node))
            if isinstance(answers[node.name], list):
                answers[node.name] = answers[node.name][0]
        return answers


def _one(call: Callable[[redis.Redis], Any], client: RedisCluster, node: ClusterNode
         ) -> list[Any]:
    """`call`'s answer on `node`'s connection, as the one reply of a batch."""
    return [call(client.get_redis_connection(node))]
