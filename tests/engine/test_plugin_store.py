"""Stores own their knobs: a store that lives in tests/ (`sqlite_store.py`) loads by module
path and carries a conversation from one process to another, byte-exact; kvtier's own stores
take their knobs under `kv_stores` as well as by their flat names, the same config either
way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlite_store import SqliteBlocks
from test_tier_faults import BASE, CHILD, Engine, greedy_answers, prompt, woken_on_b

from kvtier.config import EngineConfig
from kvtier.model.loader import LoadedModel
from kvtier.tier import Medium, TierConfig, configured_stores

TESTS = Path(__file__).parents[1]
STORE = "sqlite_store:SQLITE"


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> Any:
    return greedy_answers(tiny)


def test_a_store_from_tests_carries_a_conversation_across_processes(
        tiny: LoadedModel, tmp_path: Path, reference: Any) -> None:
    db = tmp_path / "kv.sqlite"
    knobs = {"kv_stores": {STORE: {"path": str(db)}}}
    first = prompt(3)
    done = subprocess.run(  # process A: a fresh interpreter, tests/ on its import path
        [sys.executable, "-c", CHILD, json.dumps({**BASE, **knobs}), json.dumps(first)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert done.returncode == 0, done.stderr[-2000:]
    ids = [*first, *json.loads(done.stdout.strip().splitlines()[-1]), 3, 4, 5, 6]
    stats = woken_on_b(tiny, ids, reference, "sqlite", **knobs)
    assert stats["sqlite"]["blocks"] >= 6  # its own describe(), reported as kvtier's are


def test_the_store_is_opened_with_its_own_knobs(tiny: LoadedModel, tmp_path: Path) -> None:
    b = Engine(tiny, kv_stores={STORE: {"path": str(tmp_path / "kv.sqlite")}})
    try:
        store = b.engine.tier.worker.store(Medium("sqlite"))
        assert isinstance(store, SqliteBlocks) and store.medium.shared
    finally:
        b.close()


def test_flat_names_and_kv_stores_make_the_same_config(tmp_path: Path) -> None:
    flat = EngineConfig.from_knobs(kv_offloading_size=1, disk_kv_path=str(tmp_path),
                                   disk_kv_size=2, remote_kv_url="redis://127.0.0.1:1/0",
                                   remote_kv_ttl_s=60).offload
    nested = TierConfig.of(kv_offloading_size=1, kv_stores={
        "disk": {"path": str(tmp_path), "size": 2},
        "redis": {"url": "redis://127.0.0.1:1/0", "ttl_s": 60}})
    assert [(s.kind.name, s.knobs) for s in configured_stores(flat)] == \
        [(s.kind.name, s.knobs) for s in configured_stores(nested)]
    assert flat.retention_dir == nested.retention_dir == str(tmp_path)
