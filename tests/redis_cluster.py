"""Real Redis Cluster on loopback for the cluster-tier tests (a pytest plugin, see conftest.py).

Nodes are `redis_server.RedisServer` children with cluster mode on and an explicit bus port
(the default, port + 10000, breaks above port 55535). The cluster is formed with plain
commands (ADDSLOTSRANGE, MEET, REPLICATE), so no redis-cli is needed, and it is ready only
when every node reports `cluster_state:ok` and every replica's first sync is done: a replica
killed before it would never be promoted (docs/design/redis-cluster.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from redis_server import RedisServer, free_port, redis_server_binary

SLOTS = 16384
NODE_TIMEOUT_MS = 1000
READY_S = 30.0
MANUAL_FAILOVER_S = 6.0  # Redis gives a manual failover 5 s (CLUSTER_MF_TIMEOUT)
CLUSTER_ARGS = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes",
                "--maxmemory-policy", "allkeys-lru",
                "--repl-diskless-sync-delay", "0")


class LocalCluster:
    """`masters` masters, each with `replicas` replicas, formed and waited for by `start`."""

    def __init__(self, binary: str, masters: int = 3, replicas: int = 0,
                 maxmemory: str = "64mb", password: str | None = None) -> None:
        self.num_masters, self.num_replicas = masters, replicas
        self.password = password
        auth = ("--masterauth", password) if password else ()
        self.nodes = [RedisServer(binary, password,
                                  args=(*CLUSTER_ARGS, *auth, "--maxmemory", maxmemory,
                                        "--cluster-port", str(free_port())))
                      for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis-cluster://{auth}" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        masters = self.nodes[:self.num_masters]
        for i, node in enumerate(masters):
            lo, hi = SLOTS * i // len(masters), SLOTS * (i + 1) // len(masters) - 1
            self._ask(node, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self._ask(first, "CLUSTER", "MEET", "127.0.0.1", node.port, self._bus(node))
        self._wait(lambda: all(self._known(n) == len(self.nodes) for n in self.nodes),
                   "every node to know every other")
        for k, replica in enumerate(self.nodes[self.num_masters:]):
            master = masters[k // self.num_replicas]
            self._ask(replica, "CLUSTER", "REPLICATE", self._ask(master, "CLUSTER", "MYID"))
        self.wait_ready()

    def wait_ready(self, timeout_s: float = READY_S) -> float:
        """Seconds until every running node is ok and every replica's link is up."""
        return self._wait(lambda: all(self._ready(n) for n in self.nodes if n.running),
                          "cluster_state:ok everywhere and replicas in sync", timeout_s)

    def wait_replicas_listed(self, timeout_s: float = READY_S) -> float:
        """Seconds until CLUSTER SLOTS lists every replica (it leaves out a replica that holds
        no data yet, so clients cannot read from it before something is written)."""
        def listed() -> bool:
            return all(len(entry) - 3 == self.num_replicas
                       for n in self.nodes if n.running
                       for entry in self._ask(n, "CLUSTER", "SLOTS"))
        return self._wait(listed, "every replica in CLUSTER SLOTS", timeout_s)

    def role(self, node: RedisServer) -> str:
        return str(self._ask(node, "ROLE")[0].decode())

    def masters(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running and self.role(n) == "master"]

    def replica_of(self, master: RedisServer) -> RedisServer | None:
        master_id = self._ask(master, "CLUSTER", "MYID").decode()
        for node in self.nodes:
            if node is not master and node.running and self._master_id(node) == master_id:
                return node
        return None

    def owner(self, name: bytes) -> RedisServer:
        """The master serving `name`'s slot now (as the first running node sees it)."""
        slot = key_slot(name)
        viewer = next(n for n in self.nodes if n.running)
        for lo, hi, master, *_ in self._ask(viewer, "CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise AssertionError(f"slot {slot} is not served")

    def slot_ranges(self, master: RedisServer) -> list[tuple[int, int]]:
        """The slot ranges `master` serves now."""
        viewer = next(n for n in self.nodes if n.running)
        return [(int(lo), int(hi)) for lo, hi, owner, *_ in
                self._ask(viewer, "CLUSTER", "SLOTS") if int(owner[1]) == master.port]

    def keys_per_master(self) -> dict[int, int]:
        return {n.port: int(self._ask(n, "DBSIZE")) for n in self.masters()}

    def info(self, node: RedisServer, section: str) -> dict[str, Any]:
        with node.client(timeout_s=2.0) as client:
            return dict(client.info(section))

    def kill(self, node: RedisServer) -> None:
        node.stop()

    def failover(self, replica: RedisServer, timeout_s: float = 30.0) -> float:
        """Seconds until a manual CLUSTER FAILOVER makes `replica` a master. Redis drops a
        manual failover it cannot finish in 5 s (the master's pause or the vote ran late, as
        on a loaded 2-core runner) without a word, so the command is sent again each time."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.role(replica) == "master":  # the last try finished just after its wait
                return time.monotonic() - start
            self._ask(replica, "CLUSTER", "FAILOVER")
            try:
                self._wait(lambda: self.role(replica) == "master", "the manual failover",
                           MANUAL_FAILOVER_S)
                return time.monotonic() - start
            except RuntimeError:
                continue
        raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for a manual failover")

    def wait_promoted(self, replica: RedisServer, timeout_s: float = 10.0) -> float:
        """Seconds until `replica` is a master, every running node reports ok and no node's
        slot map names a stopped node as a master any more."""
        live = {n.port for n in self.nodes if n.running}

        def done() -> bool:
            return (self.role(replica) == "master"
                    and all(self._state_ok(n) for n in self.nodes if n.running)
                    and all(int(entry[2][1]) in live for n in self.nodes if n.running
                            for entry in self._ask(n, "CLUSTER", "SLOTS")))
        return self._wait(done, "the replica's promotion", timeout_s)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def _ready(self, node: RedisServer) -> bool:
        if not self._state_ok(node):
            return False
        with node.client(timeout_s=2.0) as client:
            info = client.info("replication")
        return info.get("role") != "slave" or info.get("master_link_status") == "up"

    def _state_ok(self, node: RedisServer) -> bool:
        return "cluster_state:ok" in self._ask(node, "CLUSTER", "INFO").decode()

    def _known(self, node: RedisServer) -> int:
        return len(self._ask(node, "CLUSTER", "NODES").decode().strip().splitlines())

    def _master_id(self, node: RedisServer) -> str:
        for line in self._ask(node, "CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                return fields[3]
        return "-"

    def _bus(self, node: RedisServer) -> int:
        return int(node.args[node.args.index("--cluster-port") + 1])

    @staticmethod
    def _ask(node: RedisServer, *command: object) -> object:
        with node.client(timeout_s=2.0) as client:
            return client.execute_command(*command)

    @staticmethod
    def _wait(done: Callable[[], bool], what: str, timeout_s: float = READY_S) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                if done():
                    return time.monotonic() - start
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture
def redis_cluster_factory() -> Iterator[Callable[..., LocalCluster]]:
    """`factory(masters=3, replicas=0, maxmemory="64mb", password=None)` forms a fresh
    cluster; every node is killed and its directory removed at the test's end."""
    binary = redis_server_binary()
    clusters: list[LocalCluster] = []

    def factory(masters: int = 3, replicas: int = 0, maxmemory: str = "64mb",
                password: str | None = None) -> LocalCluster:
        cluster = LocalCluster(binary, masters, replicas, maxmemory, password)
        clusters.append(cluster)
        cluster.start()
        return cluster

    try:
        yield factory
    finally:
        for cluster in clusters:
            cluster.close()
