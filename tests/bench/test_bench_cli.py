"""`kvtier bench` end to end on the tiny preset: configs side by side, files written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.cli import parse_config
from kvtier.cli import main
from kvtier.errors import ConfigError


def test_bench_runs_both_default_configs_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(["bench", "--model", "tiny", "--sessions", "4", "--turns", "2,3",
                 "--think-s", "0.3,0.6", "--arrival-rate", "20", "--num-device-blocks", "40",
                 "--out", str(out), "--config", "swap:kv_offloading_size=0.02,"
                 "preemption_mode=swap,idle_offload_s=0.1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tier-off" in printed and "tier-auto" in printed and "swap" in printed
    results = json.loads((out / "results.json").read_text())
    assert set(results["summaries"]) == {"tier-off", "tier-auto", "swap"}
    per_config = {}
    for rec in results["records"]:
        per_config.setdefault(rec["config"], []).append(rec)
    assert all(len(v) == len(per_config["tier-off"]) for v in per_config.values())
    # the tier is on in tier-auto: later turns woke from host, never under tier-off
    assert any(r["residency"] == "host" for r in per_config["tier-auto"])
    assert not any(r["residency"] == "host" for r in per_config["tier-off"])
    assert results["meta"]["git_sha"] and results["meta"]["model"] == "tiny"
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html


def test_config_parsing_and_errors() -> None:
    assert parse_config("x:kv_offloading_size=2,load_mode=layerwise,batch_invariant=true") == (
        "x", {"kv_offloading_size": 2, "load_mode": "layerwise", "batch_invariant": True})
    with pytest.raises(ConfigError, match="NAME:KNOB=VALUE"):
        parse_config("nocolon")
    with pytest.raises(ConfigError, match="is not KNOB=VALUE"):
        parse_config("x:oops")


def test_bad_trace_line_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"session": "a", "turn": 0, "arrival_s": 0, "input_tokens": 5, '
                   '"output_tokens": 2}\n{"session": "a", "turn": 1}\n')
    assert main(["bench", "--model", "tiny", "--trace", str(bad), "--out",
                 str(tmp_path / "o")]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
