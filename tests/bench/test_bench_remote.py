"""`kvtier bench --url`: the same trace driven over HTTP against `kvtier serve`."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import start_server

from kvtier.cli import main


def test_bench_drives_a_running_server(tmp_path: Path) -> None:
    proc, url = start_server("--num-device-blocks", "48", "--kv-offloading-size", "0.02",
                             "--idle-offload-s", "0.2")
    try:
        out = tmp_path / "remote"
        code = main(["bench", "--model", "tiny", "--url", url, "--sessions", "3",
                     "--turns", "2,2", "--think-s", "0.6,0.8", "--arrival-rate", "20",
                     "--out", str(out)])
        assert code == 0
        results = json.loads((out / "results.json").read_text())
        records = results["records"]
        assert len(records) == 6 and {r["config"] for r in records} == {"remote"}
        # the server's own header: second turns woke from host after the idle gap
        assert [r["residency"] for r in records if r["turn"] == 1] == ["host"] * 3
        assert all(r["restored_tokens"] > 0 for r in records if r["turn"] == 1)
        # the server returned the generated ids, so the history grew by exactly them
        firsts = {r["session_id"]: r for r in records if r["turn"] == 0}
        for r in records:
            if r["turn"] == 1:
                assert r["context_tokens"] > firsts[r["session_id"]]["context_tokens"] + 2
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_residency_from_a_servers_cached_token_count_alone() -> None:
    from kvtier.bench.remote import _from_cached

    # vLLM's usage details: its prefix cache plus what a connector loaded, no residency header
    assert _from_cached(None, 1, 400) == "unknown"  # the server counts nothing
    assert _from_cached(0, 0, 0) == "new"
    assert _from_cached(128, 0, 0) == "cached"  # a shared system prompt on a first turn
    assert _from_cached(384, 1, 400) == "cached"  # all full blocks of the earlier turns
    assert _from_cached(0, 1, 400) == "recomputed"  # evicted everywhere, computed again
    assert _from_cached(128, 2, 900) == "recomputed"  # only a short common prefix was reused
