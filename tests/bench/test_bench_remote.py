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
        # the server's TTFT split, plus what HTTP added in the queue part, adds up to the
        # TTFT the client measured, for both classes; the host wakes waited on their restore
        for r in records:
            parts = r["queue_s"] + r["tier_s"] + r["compute_s"]
            assert abs(parts - r["ttft_s"]) <= max(1e-3, 0.01 * r["ttft_s"]), r
            assert min(r["queue_s"], r["tier_s"], r["compute_s"]) >= 0, r
        assert all(r["tier_s"] > 0 for r in records if r["turn"] == 1)
        assert all(r["tier_s"] == 0 for r in records if r["turn"] == 0)
        # the server returned the generated ids, so the history grew by exactly them
        firsts = {r["session_id"]: r for r in records if r["turn"] == 0}
        for r in records:
            if r["turn"] == 1:
                assert r["context_tokens"] > firsts[r["session_id"]]["context_tokens"] + 2
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_a_servers_split_is_read_in_seconds_and_absent_when_not_reported() -> None:
    from kvtier.bench.remote import _split

    usage = {"ttft_ms": 30.0, "queue_ms": 5.0, "tier_ms": 10.0, "compute_ms": 15.0}
    got = _split(usage, 0.032)  # the client saw 2 ms more than the engine: HTTP, the loop
    assert got["tier_s"] == 0.010 and got["compute_s"] == 0.015
    assert abs(got["queue_s"] - 0.007) < 1e-9
    assert _split({"prompt_tokens": 3}, 0.5) == {"queue_s": None, "tier_s": None,
                                                 "compute_s": None}
    assert _split({**usage, "tier_ms": None}, 0.5)["queue_s"] is None


def test_residency_from_a_servers_cached_token_count_alone() -> None:
    from kvtier.bench.remote import _from_cached

    # vLLM's usage details: its prefix cache plus what a connector loaded, no residency header
    assert _from_cached(None, 1, 400) == "unknown"  # the server counts nothing
    assert _from_cached(0, 0, 0) == "new"
    assert _from_cached(128, 0, 0) == "cached"  # a shared system prompt on a first turn
    assert _from_cached(384, 1, 400) == "cached"  # all full blocks of the earlier turns
    assert _from_cached(0, 1, 400) == "recomputed"  # evicted everywhere, computed again
    assert _from_cached(128, 2, 900) == "recomputed"  # only a short common prefix was reused
