"""The shared store on Valkey 9 (`valkey://`): the same protocol as Redis, so the Redis store
answers it; a conversation written by one process wakes on another byte-exact (a damaged
value there is a miss that leaves: test_tier_faults runs its damage on both servers)."""

from __future__ import annotations

from typing import Any

import pytest
from test_tier_faults import greedy_answers, valkey_url, woken_on_b, written_remote

from kvtier.model.loader import LoadedModel


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

