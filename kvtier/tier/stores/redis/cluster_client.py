"""redis-py's side of `ClusterStore`: the client built from a checked URL, refused credentials
told apart from an outage, the server settings that would cost kvtier blocks or writes named
at start, and a node's keys sent as one pipeline."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvtier.tier.stores.redis.direct import AUTH_ERRORS
from kvtier.tier.stores.redis.per_node import PerNode
from kvtier.tier.stores.redis.url import ClusterUrl

log = logging.getLogger(__name__)

# An outage of a node or of the whole cluster: a miss, never a crash (RedisClusterException
# is not a RedisError).
OUTAGES = (redis.RedisError, RedisClusterException, OSError)
CLUSTER_EXAMPLE = "redis-cluster://:PASSWORD@host1:port1,host2:port2"
EVICTING_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")

# Adds key i's command to a pipeline.
Command = Callable[[Any, int], None]
# Runs one node's keys (by index; those in the set go after an ASKING): a reply or an
# exception per key.
NodeCall = Callable[[RedisCluster, ClusterNode, list[int], set[int]], list[Any]]


def pipelined(command: Command, clients: PerNode[redis.Redis] | None = None) -> NodeCall:
    """A node's keys as one redis-py pipeline of `command`s on that node's connection (the
    cluster client's, or the node's own in `clients`)."""
    def run(client: RedisCluster, node: ClusterNode, indices: list[int],
            asking: set[int]) -> list[Any]:
        conn = (client.get_redis_connection(node) if clients is None else
                clients.get(node.name, (node.host, int(node.port))))
        pipe = conn.pipeline(transaction=False)
        for i in indices:
            if i in asking:
                pipe.execute_command("ASKING")
            command(pipe, i)
        replies = iter(pipe.execute(raise_on_error=False))
        kept = []
        for i in indices:
            if i in asking:
                next(replies)  # ASKING's own OK
            kept.append(next(replies))
        return kept
    return run


def connect(spec: ClusterUrl, timeout_s: float, read_replicas: bool) -> RedisCluster:
    """A client holding the cluster's slot map (one retry, no backoff: kvtier's breakers
    decide when to try again); raises an auth error for refused credentials, else an OUTAGE."""
    options = _connection_options(spec, timeout_s)
    try:
        client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in spec.nodes],
            require_full_coverage=False, retry=Retry(NoBackoff(), 1),
            load_balancing_strategy=LoadBalancingStrategy.ROUND_ROBIN if read_replicas else None,
            **options)
    except RedisClusterException:
        _diagnose(spec, options)
        raise
    _ping_a_master(client)
    return client


def node_writers(spec: ClusterUrl, timeout_s: float, write_timeout_s: float
                 ) -> PerNode[redis.Redis]:
    """A redis-py client per node for writes, waiting `write_timeout_s` for each (the
    cluster client's connections keep the read timeout)."""
    options = {**_connection_options(spec, write_timeout_s), "socket_connect_timeout": timeout_s,
               "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))}

    def make(address: tuple[str, int]) -> redis.Redis:
        return redis.Redis(host=address[0], port=address[1], **options)

    return PerNode(make)


def _ping_a_master(client: RedisCluster) -> None:
    """PING the masters that serve slots until one answers (a startup node that died may
    still be listed as a master); raises the last error if none does."""
    serving = {owners[0].name: owners[0]
               for owners in client.nodes_manager.slots_cache.values() if owners}
    error: Exception = RedisClusterException("no node serves any slot")
    for node in serving.values():
        try:
            client.get_redis_connection(node).ping()
            return
        except AUTH_ERRORS:
            raise
        except OUTAGES as e:
            error = e
    client.close()
    raise error


def _connection_options(spec: ClusterUrl, timeout_s: float) -> dict[str, Any]:
    options: dict[str, Any] = dict(spec.options)
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() in (
            "1", "true", "yes", "on")
    return {"username": spec.username, "password": spec.password, "ssl": spec.tls,
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, **options}


def _diagnose(spec: ClusterUrl, options: dict[str, Any]) -> None:
    """RedisCluster folds its startup nodes' errors into one message, so refused credentials
    would read as an outage: one plain PING per node tells them apart (raises the auth
    error; returns if none answers that way)."""
    for host, port in spec.nodes:
        try:
            with redis.Redis(host=host, port=port, retry=Retry(NoBackoff(), 0),
                             **options) as conn:
                conn.ping()
            return
        except AUTH_ERRORS:
            raise
        except OUTAGES:
            continue


def warn_settings(client: RedisCluster, masters: Sequence[ClusterNode], has_ttl: bool,
                  url_for_log: str) -> None:
    """Warn about server settings that turn a full or lost shard into failed writes or a
    stopped cluster (managed services may refuse CONFIG: then nothing is said)."""
    for node in masters:
        try:
            conn = client.get_redis_connection(node)
            policy = conn.config_get("maxmemory-policy").get("maxmemory-policy", "")
            coverage = conn.config_get("cluster-require-full-coverage").get(
                "cluster-require-full-coverage", "")
        except OUTAGES as e:
            log.debug("kvtier: cannot read %s's settings: %s", node.name, e)
            continue
        if policy and policy not in EVICTING_POLICIES and not (
                policy.startswith("volatile") and has_ttl):
            log.warning("kvtier: cluster node %s has maxmemory-policy %s: once full it refuses "
                        "kvtier's writes; set allkeys-lru", node.name, policy)
        if coverage == "yes":
            log.warning("kvtier: cluster node %s has cluster-require-full-coverage yes: one "
                        "lost shard stops the whole cluster; set it to no", node.name)
    if masters and not _has_replicas(client, masters[0]):
        log.warning("kvtier: remote tier %s has no replicas: a lost shard loses its blocks and "
                    "cuts most long prefixes to their first blocks; add replicas", url_for_log)


def _has_replicas(client: RedisCluster, node: ClusterNode) -> bool:
    """Whether `node` knows of any replica (CLUSTER SLOTS lists none until they hold data)."""
    try:
        nodes = client.get_redis_connection(node).execute_command("CLUSTER", "NODES")
    except OUTAGES:
        return True  # unknown: say nothing
    if isinstance(nodes, dict):  # a client that parses the reply
        return any("slave" in str(v.get("flags", "")) for v in nodes.values())
    text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
    return any(len(f := line.split()) > 2 and "slave" in f[2] for line in text.splitlines())
