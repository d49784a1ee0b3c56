"""The shared store on Valkey 9 (`valkey://`): the same protocol as Redis, so the Redis store
answers it; a conversation written by one process wakes on another byte-exact, and a damaged
value is a miss that leaves."""

from __future__ import annotations

from typing import Any

import pytest
from test_tier_faults import (
    BLOCK,
    Engine,
    assert_same,
    greedy_answers,
    woken_on_b,
    written_remote,
)

from kvtier.model.loader import LoadedModel
from kvtier.tier.io.block_format import pack, unpack
from kvtier.tier.keys import Medium


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> Any:
    return greedy_answers(tiny)


def valkey_url(server: Any) -> str:
    return f"valkey://127.0.0.1:{server.port}/0"


def test_a_conversation_crosses_processes_through_valkey(tiny: LoadedModel, valkey_server: Any,
                                                         reference: Any) -> None:
    info = valkey_server.client().info("server")
    assert str(info.get("valkey_version", "")).startswith("9.")
    ids = written_remote(valkey_url(valkey_server))
    stats = woken_on_b(tiny, ids, reference, "remote", remote_kv_url=valkey_url(valkey_server))
    assert stats["remote"]["url"].startswith("valkey://")


def test_a_damaged_value_in_valkey_is_a_miss(tiny: LoadedModel, valkey_server: Any,
                                             reference: Any) -> None:
    ids = written_remote(valkey_url(valkey_server))
    b = Engine(tiny, remote_kv_url=valkey_url(valkey_server))
    try:
        name = b.engine.tier.worker.store(Medium.REMOTE).store.key(b.keys(ids)[2])
        client = valkey_server.client()
        header, payload = unpack(client.get(name))
        damaged = bytearray(payload)
        damaged[100] ^= 0x40
        client.set(name, pack(header, bytes(damaged)))
        out = b.run(ids)
        stats = b.deep()
        gone = client.exists(name) == 0
    finally:
        b.close()
    assert_same(out, reference(ids))
    assert out.residency == "remote" and out.num_restored_tokens == 2 * BLOCK
    assert stats["misses"] == {"remote:checksum": 1} and gone
