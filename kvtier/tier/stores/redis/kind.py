"""The shared key-value store as the builder sees it: `remote_kv_url` (a Redis or Valkey
server, or a cluster of them), its knobs, and its halves: the scheduler asks it for presence
on a connection of its own, the worker moves the bytes on another."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import ConfigError
from kvtier.tier.books.protocol import SecondaryIndex
from kvtier.tier.config import TierConfig
from kvtier.tier.io.kind import Opened, StoreSite
from kvtier.tier.keys import Medium
from kvtier.tier.stores.redis.probe import remote_rate
from kvtier.tier.stores.redis.url import SCHEMES, is_cluster_url, validate_url

if TYPE_CHECKING:
    from kvtier.tier.stores.redis.blocks import RemoteBlocks
    from kvtier.tier.stores.redis.kv import KeyValueStore


class RedisKind:
    """Redis or Valkey, one server or a cluster; blocks signed under the deployment's MAC."""

    name = "redis"
    medium = Medium.REMOTE
    shared = True
    schemes = SCHEMES

    def configured(self, config: TierConfig) -> bool:
        return bool(config.remote_kv_url)

    def check(self, config: TierConfig) -> None:
        if self.name in config.kv_stores:
            raise ConfigError("kv_stores['redis']: the Redis store's knobs are remote_kv_url "
                              "and the other remote_kv_* knobs")
        if config.remote_kv_read_gbps is not None and not config.remote_kv_read_gbps > 0:
            raise ConfigError(f"remote_kv_read_gbps={config.remote_kv_read_gbps} must be > 0 "
                              "(or unset)")
        if config.remote_kv_ttl_s is not None and not config.remote_kv_ttl_s > 0:
            raise ConfigError(f"remote_kv_ttl_s={config.remote_kv_ttl_s} must be > 0 (or unset)")
        if config.remote_kv_ttl_s is not None and not config.remote_kv_url:
            raise ConfigError("remote_kv_ttl_s is set but remote_kv_url is not")
        if config.remote_kv_url is not None:
            validate_url(config.remote_kv_url)
        if config.remote_kv_read_replicas and not (config.remote_kv_url
                                                   and is_cluster_url(config.remote_kv_url)):
            raise ConfigError("remote_kv_read_replicas reads a cluster's replicas: set "
                              "remote_kv_url=redis-cluster://host:port,... as well")

    def open_both(self, site: StoreSite) -> Opened:
        blocks = self.open_bytes(site)
        return Opened(blocks, site.presence_books(blocks.store.exists_many, self.medium,
                                                  self._expires(site)),
                      self._read_gbps(blocks.store, site))

    def open_books(self, site: StoreSite) -> tuple[SecondaryIndex, float]:
        store = self._connect(site)  # presence only, on a connection of the scheduler's own
        return (site.presence_books(store.exists_many, self.medium, self._expires(site)),
                self._read_gbps(store, site))

    def open_bytes(self, site: StoreSite) -> RemoteBlocks:
        from kvtier.tier.stores.redis.blocks import RemoteBlocks

        return RemoteBlocks(self._connect(site), site.mac, site.slot_bytes)

    def _connect(self, site: StoreSite) -> KeyValueStore:
        """A client of the configured server or cluster, closed by `site.undo` on a failure.
        Under a secret, its key space is the secret's: another secret's blocks are never
        found, never deleted."""
        config = site.config
        namespace = site.mac.store_namespace(site.namespace) if site.mac else site.namespace
        url = str(config.remote_kv_url)
        store: KeyValueStore
        if is_cluster_url(url):  # the cluster client only if used
            from kvtier.tier.stores.redis.cluster_store import ClusterStore

            store = ClusterStore(url, namespace, config.remote_kv_ttl_s,
                                 read_replicas=config.remote_kv_read_replicas,
                                 write_timeout_s=config.remote_write_timeout_s)
        else:
            from kvtier.tier.stores.redis.store import RedisStore

            store = RedisStore(url, namespace, config.remote_kv_ttl_s,
                               write_timeout_s=config.remote_write_timeout_s)
        site.undo.callback(store.close)
        return store

    @staticmethod
    def _expires(site: StoreSite) -> bool:
        """Whether its blocks expire (`remote_kv_ttl_s`): a later retention renews them."""
        return site.config.remote_kv_ttl_s is not None

    def _read_gbps(self, store: KeyValueStore, site: StoreSite) -> float:
        return remote_rate(store, site.slot_bytes, site.config.remote_kv_read_gbps)


REDIS = RedisKind()
