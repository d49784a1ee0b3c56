"""The shared key-value store as the builder sees it: `kv_stores={"redis": {"url": ...}}` (or
the flat `remote_kv_url` and the other `remote_kv_*` knobs: a Redis or Valkey server, or a
cluster of them), its knobs, and its halves: the scheduler asks it for presence on a
connection of its own, the worker moves the bytes on another."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.keys import Medium
from kvtier.tier.knobs import check_bounds, parse_store_knobs, store_entry
from kvtier.tier.stores.redis.probe import remote_rate
from kvtier.tier.stores.redis.url import SCHEMES, is_cluster_url, validate_url

if TYPE_CHECKING:
    from kvtier.tier.stores.redis.blocks import RedisBlocks
    from kvtier.tier.stores.redis.kv import KeyValueStore

WRITE_TIMEOUT_S = 2.0  # `write_timeout_s`'s default
BOUNDS = {"ttl_s": (0.0, 1e9), "read_gbps": (0.0, 1e6), "write_timeout_s": (0.0, 600.0)}


@dataclass(frozen=True)
class RedisKnobs:
    """The Redis store's knobs."""

    # redis://[:password@]host:port[/db] (one server) or redis-cluster://h1:p1,h2:p2 (a Redis
    # Cluster / Valkey cluster), shared by processes
    url: str | None = None
    # Cluster only: reads go to replicas too (safe: blocks are immutable and verified, a
    # lagging replica can only lack one), which also serves a dead master's keys until its
    # replica is promoted.
    read_replicas: bool = False
    ttl_s: float | None = None  # expire its blocks after this long; None = never
    # The planner's starting read rate (GB/s); None: probed at start (a few blocks).
    read_gbps: float | None = None
    # Seconds a write may wait for the store (each batch of up to 16 MB): longer than a
    # read's, so a store starved of CPU (a loopback Redis beside tensor-parallel workers on a
    # small machine) still keeps up. A write that times out is counted (write failures,
    # reason "timeout") and logged.
    write_timeout_s: float = WRITE_TIMEOUT_S


class RedisKind:
    """Redis or Valkey, one server or a cluster; blocks signed under the deployment's MAC."""

    name = "redis"
    medium = Medium.REDIS
    shared = True
    schemes = SCHEMES
    knobs_type = RedisKnobs
    aliases: Mapping[str, str] = {
        "remote_kv_url": "url", "remote_kv_read_replicas": "read_replicas",
        "remote_kv_ttl_s": "ttl_s", "remote_kv_read_gbps": "read_gbps",
        "remote_write_timeout_s": "write_timeout_s"}

    def parse(self, raw: Mapping[str, Any]) -> RedisKnobs | None:
        knobs, named = parse_store_knobs(RedisKnobs, self.name, raw, self.aliases)
        if knobs.read_gbps is not None and not knobs.read_gbps > 0:
            raise ConfigError(f"{named('read_gbps')}={knobs.read_gbps} must be > 0 (or unset)")
        if knobs.ttl_s is not None and not knobs.ttl_s > 0:
            raise ConfigError(f"{named('ttl_s')}={knobs.ttl_s} must be > 0 (or unset)")
        if knobs.ttl_s is not None and not knobs.url:
            raise ConfigError(f"{named('ttl_s')} is set but {named('url')} is not")
        if not knobs.write_timeout_s > 0:
            raise ConfigError(f"{named('write_timeout_s')}={knobs.write_timeout_s} must be > 0 "
                              "seconds: how long a write waits for the store (default "
                              f"{WRITE_TIMEOUT_S:g})")
        if knobs.url is not None:
            validate_url(knobs.url)
        if knobs.read_replicas and not (knobs.url and is_cluster_url(knobs.url)):
            raise ConfigError(f"{named('read_replicas')} reads a cluster's replicas: set "
                              f"{named('url')}=redis-cluster://host:port,... as well")
        check_bounds(knobs, BOUNDS, named)
        return knobs if knobs.url else None

    def state_dir(self, knobs: RedisKnobs) -> str | None:
        return None

    def rank_share(self, knobs: RedisKnobs, rank: int, world_size: int) -> Mapping[str, Any]:
        """Every rank on the same store (each rank's keys name its split)."""
        return store_entry(knobs)

    def open_both(self, site: StoreSite, knobs: RedisKnobs) -> Opened:
        blocks = self.open_bytes(site, knobs)
        return Opened(blocks, site.presence_books(blocks.store.exists_many, self.medium,
                                                  knobs.ttl_s is not None),
                      remote_rate(blocks.store, site.slot_bytes, knobs.read_gbps))

    def open_books(self, site: StoreSite, knobs: RedisKnobs) -> tuple[SecondaryIndex, float]:
        # presence only, on a connection of the scheduler's own; blocks that expire by
        # themselves (a TTL) are renewed by a later retention
        store = self._connect(site, knobs)
        return (site.presence_books(store.exists_many, self.medium, knobs.ttl_s is not None),
                remote_rate(store, site.slot_bytes, knobs.read_gbps))

    def open_bytes(self, site: StoreSite, knobs: RedisKnobs) -> RedisBlocks:
        from kvtier.tier.stores.redis.blocks import RedisBlocks

        return RedisBlocks(self._connect(site, knobs), site.mac, site.slot_bytes)

    @staticmethod
    def _connect(site: StoreSite, knobs: RedisKnobs) -> KeyValueStore:
        """A client of the configured server or cluster, closed by `site.undo` on a failure.
        Under a secret, its key space is the secret's: another secret's blocks are never
        found, never deleted."""
        namespace = site.mac.store_namespace(site.namespace) if site.mac else site.namespace
        url = str(knobs.url)
        store: KeyValueStore
        if is_cluster_url(url):  # the cluster client only if used
            from kvtier.tier.stores.redis.cluster_store import ClusterStore

            store = ClusterStore(url, namespace, knobs.ttl_s, read_replicas=knobs.read_replicas,
                                 write_timeout_s=knobs.write_timeout_s)
        else:
            from kvtier.tier.stores.redis.store import RedisStore

            store = RedisStore(url, namespace, knobs.ttl_s, write_timeout_s=knobs.write_timeout_s)
        site.undo.callback(store.close)
        return store


REDIS = RedisKind()
