"""The shared store on Valkey 9 (`valkey://`): the same protocol as Redis, so the Redis store
answers it; a conversation written by one process wakes on another byte-exact (a damaged
value there is a miss that leaves: test_tier_faults runs its damage on both servers), and a
later retention stretches a block's TTL there as on Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_tier_faults import greedy_answers, valkey_url, woken_on_b, written_remote

from kvtier.model.loader import LoadedModel
from kvtier.tier.stores.redis.store import RedisStore


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> Any:
    return greedy_answers(tiny)


def test_a_conversation_crosses_processes_through_valkey(tiny: LoadedModel, valkey_server: Any,
                                                         reference: Any) -> None:
    info = valkey_server.client().info("server")
    assert str(info.get("valkey_version", "")).startswith("9.")
    ids = written_remote(valkey_url(valkey_server))
    stats = woken_on_b(tiny, ids, reference, "remote", remote_kv_url=valkey_url(valkey_server))
    assert stats["remote"]["url"].startswith("valkey://")


def test_a_later_retention_stretches_a_valkey_ttl(valkey_server: Any) -> None:
    store = RedisStore(valkey_url(valkey_server), bytes(16), ttl_s=30.0)
    try:
        store.put_many([(b"k", b"v")])
        assert store.keep_many([b"k"], [time.time() + 3600]) == [None]
        with valkey_server.client() as client:
            assert 3_500_000 < client.pttl(store.key(b"k")) <= 3_600_000
    finally:
        store.close()

