"""The report: every figure equals one computed by hand from the raw records, the flags fire
exactly when a run cannot show what offload costs, and the files stand on their own."""

from __future__ import annotations

import base64
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.html_report import write_html
from kvtier.bench.report import (
    print_table,
    render_table,
    summarize_config,
    write_json,
)


def rec(config: str, sid: str, turn: int, residency: str, ttft: float, *, itl: float | None = 0.01,
        context: int = 100, out: int = 8, restored: int = 0, recomputed: int = 0,
        cached: int = 0, nbytes: int = 0, restore_s: float = 0.0, arrival: float = 0.0,
        finish: float = 1.0) -> dict[str, Any]:
    return {"config": config, "session_id": sid, "turn": turn, "context_tokens": context,
            "output_tokens": out, "ttft_s": ttft, "itl_s": itl, "residency": residency,
            "restored_tokens": restored, "recomputed_tokens": recomputed,
            "cached_tokens": cached, "restore_bytes": nbytes, "restore_s": restore_s,
            "arrival_s": arrival, "finish_s": finish}


def tier_records(config: str = "tier") -> list[dict[str, Any]]:
    # 3 sessions: s1 new then resident x2, s2 new(as resident prefix) + host x3, s3 resident.
    return [
        rec(config, "s1", 0, "new", 0.050, context=120, arrival=0.0, finish=0.4),
        rec(config, "s1", 1, "resident", 0.010, context=160, cached=112, arrival=1.0, finish=1.2),
        rec(config, "s1", 2, "resident", 0.014, context=200, cached=160, itl=None, out=1,
            arrival=2.0, finish=2.1),
        rec(config, "s2", 0, "resident", 0.012, context=130, cached=16, itl=0.02, arrival=0.5,
            finish=0.9),
        rec(config, "s2", 1, "host", 0.100, context=170, restored=128, nbytes=4_000_000,
            restore_s=0.004, itl=0.03, arrival=5.0, finish=5.5),
        rec(config, "s2", 2, "host", 0.130, context=210, restored=160, nbytes=5_000_000,
            restore_s=0.006, itl=0.015, arrival=9.0, finish=9.6),
        rec(config, "s2", 3, "host", 0.090, context=250, restored=208, nbytes=6_500_000,
            restore_s=0.005, itl=0.012, arrival=12.0, finish=12.5),
        rec(config, "s3", 0, "resident", 0.011, context=90, cached=80, itl=0.011, arrival=3.0,
            finish=3.3),
    ]


ENGINE = {
    "preemptions": {"total": 3, "swap": 2, "recompute": 1},
    "host_peak_slots": 9,
    "host_tier": {
        "slots": {"used": 5, "capacity": 64, "pinned": 0},
        "link": {"store": {"bytes": 1, "busy_s": 0.5, "utilisation": 0.25, "gbps": 10.0},
                 "load": {"bytes": 2, "busy_s": 0.2, "utilisation": 0.1, "gbps": 12.5}},
        "planner": {"error": {"restore": {"count": 3, "median_rel_error": 0.12,
                                          "p90_rel_error": 0.3}}},
    },
}
TIER_OFF = {"preemptions": {"total": 0, "swap": 0, "recompute": 0}, "host_tier": None,
            "host_peak_slots": 0}


def nearest_rank(values: list[float], q: float) -> float:
    """Independent nearest-rank percentile: the smallest value with >= q% at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered) / 100) - 1)]


def test_summary_equals_numbers_computed_by_hand() -> None:
    records = tier_records()
    s = summarize_config(records, ENGINE)
    by_class: dict[str, list[float]] = {}
    for r in records:
        by_class.setdefault(r["residency"], []).append(r["ttft_s"])
    by_class["all"] = [r["ttft_s"] for r in records]
    for cls, values in by_class.items():
        for q in (50, 90, 99):
            assert s["ttft_s"][cls][f"p{q}"] == nearest_rank(values, q), (cls, q)
        assert s["ttft_s"][cls]["count"] == len(values)
    assert s["ttft_s"]["recomputed"]["count"] == 0 and s["ttft_s"]["recomputed"]["p50"] is None
    # Spelled out for the host class: sorted [0.090, 0.100, 0.130].
    assert (s["ttft_s"]["host"]["p50"], s["ttft_s"]["host"]["p99"]) == (0.100, 0.130)
    itl = [r["itl_s"] for r in records if r["itl_s"] is not None]
    assert s["itl_s"] == {"count": 7, "p50": nearest_rank(itl, 50), "p99": nearest_rank(itl, 99)}
    assert (s["config"], s["requests"], s["sessions"]) == ("tier", 8, 3)
    assert s["residency_counts"] == {"resident": 4, "host": 3, "disk": 0, "remote": 0,
                                     "recomputed": 0, "new": 1}
    assert s["restore_bytes"] == 15_500_000
    assert s["restore_bytes_per_request"] == 15_500_000 / 8
    assert s["restore_s_total"] == pytest.approx(0.015)
    assert s["restore_gbps"] == pytest.approx(15_500_000 / 0.015 / 1e9)
    assert (s["restored_tokens"], s["recomputed_tokens"], s["cached_tokens"]) == (496, 0, 368)
    assert s["duration_s"] == 12.5  # first arrival 0.0, last finish 12.5
    assert s["output_tokens_per_s"] == pytest.approx(57 / 12.5)
    # Engine-side figures are passed through, the host peak is the larger of the two reads.
    assert s["preemptions"] == {"total": 3, "swap": 2, "recompute": 1}
    assert s["link_utilisation"] == {"store": 0.25, "load": 0.1}
    assert s["link_gbps"] == {"store": 10.0, "load": 12.5}
    assert (s["host_peak_slots"], s["host_capacity_slots"]) == (9, 64)
    assert s["planner_error"] == ENGINE["host_tier"]["planner"]["error"]


def test_tier_off_engine_and_empty_records_do_not_break() -> None:
    s = summarize_config(tier_records("off"), TIER_OFF)
    assert s["link_utilisation"] is None and s["host_peak_slots"] is None
    assert s["planner_error"] is None
    empty = summarize_config([], {})
    assert (empty["requests"], empty["ttft_s"]["all"]["p50"], empty["flags"]) == (0, None, [])


def flag_names(records: list[dict[str, Any]]) -> list[str]:
    return [f["name"] for f in summarize_config(records, TIER_OFF)["flags"]]


def test_no_idle_gaps_fires_only_when_nothing_went_cold() -> None:
    warm = [rec("c", f"s{i}", 0, "new" if i % 2 else "resident", 0.01) for i in range(4)]
    s = summarize_config(warm, TIER_OFF)
    assert [f["message"] for f in s["flags"]] == [
        "no idle gaps: nothing went cold, offload looks free"]
    assert "no_idle_gaps" not in flag_names([*warm, rec("c", "s9", 1, "host", 0.02)])
    assert "no_idle_gaps" not in flag_names([*warm, rec("c", "s9", 1, "recomputed", 0.02)])
    assert "no_idle_gaps" not in flag_names([*warm, rec("c", "s9", 0, "new", 0.02,
                                                         recomputed=16)])


def test_bimodal_fires_on_two_populations_and_names_them() -> None:
    s = summarize_config(tier_records(), ENGINE)
    # resident p50 of [10, 11, 12, 14] ms is 11 ms; host p50 of [90, 100, 130] is 100 ms.
    assert [f["message"] for f in s["flags"] if f["name"] == "bimodal"] == [
        "TTFT is bimodal: host p50 100.0 ms vs resident p50 11.0 ms; the overall p50 "
        "averages two populations"]
    resident = [rec("c", f"r{i}", 1, "resident", 0.010) for i in range(3)]
    close = [rec("c", f"h{i}", 1, "host", 0.025) for i in range(3)]  # 2.5x: one population
    assert "bimodal" not in flag_names(resident + close)
    few = [rec("c", f"h{i}", 1, "host", 1.0) for i in range(2)]  # too few to call a class
    assert "bimodal" not in flag_names(resident + few)
    far = [rec("c", f"h{i}", 1, "host", 0.031) for i in range(3)]  # just over 3x
    assert "bimodal" in flag_names(resident + far)


def test_table_shows_configs_side_by_side() -> None:
    from rich.console import Console

    summaries = {"tier": summarize_config(tier_records(), ENGINE),
                 "off": summarize_config(tier_records("off"), TIER_OFF)}
    console = Console(file=io.StringIO(), width=250, record=True)
    console.print(render_table(summaries))
    text = console.export_text()
    assert "tier" in text and "off" in text
    assert "TTFT host" in text and "100.0 / 130.0 / 130.0 (n=3)" in text
    assert "TTFT recomputed" in text and "- (n=0)" in text
    assert "25% / 10%" in text and "restore GB/s" in text and "9 / 64" in text
    assert "restore 12% (n=3)" in text
    out = Console(file=io.StringIO(), width=250, record=True)
    print_table(summaries, console=out)
    assert "tier: TTFT is bimodal: host p50 100.0 ms" in out.export_text()


def test_write_html_is_self_contained(tmp_path: Path) -> None:
    records = [*tier_records(),
               rec("off", "s2", 1, "recomputed", 0.070, context=170, recomputed=128),
               rec("off", "s1", 0, "new", 0.040)]
    summaries = {"tier": summarize_config(records[:8], ENGINE),
                 "off": summarize_config(records[8:], TIER_OFF)}
    meta = {"command": "kvtier bench --trace t.jsonl", "git_sha": "abc1234",
            "hardware": {"machine": "x86_64"}, "model": "tiny", "configs": {"tier": {}},
            "link_timeline": {"tier": [{"t": 0.25 * i, "store_util": 0.1 * (i % 3),
                                        "load_util": 0.05 * i} for i in range(8)],
                              "off": []}}
    path = tmp_path / "out" / "report.html"
    write_html(path, summaries, records, meta)
    text = path.read_text()
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 4  # CDF, context, split, link
    assert all(base64.b64decode(img).startswith(b"\x89PNG") for img in images)
    assert "http://" not in text and "https://" not in text
    assert "abc1234" in text and "kvtier bench --trace t.jsonl" in text
    assert "TTFT is bimodal" in text and "TTFT host" in text
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"]  # no temp file


def test_write_json_round_trip(tmp_path: Path) -> None:
    summaries = {"tier": summarize_config(tier_records(), ENGINE)}
    payload = {"summaries": summaries, "records": tier_records(),
               "meta": {"trace": Path("a/b.jsonl"), "pair": (1, 2)}}
    path = tmp_path / "results.json"
    write_json(path, payload)
    write_json(path, payload)  # replacing an existing file is fine
    loaded = json.loads(path.read_text())
    assert loaded["summaries"] == summaries and loaded["records"] == tier_records()
    assert loaded["meta"] == {"trace": "a/b.jsonl", "pair": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
