"""`kvtier plan` on the command line: the table, --json's keys, errors, --trace."""

import argparse
import json
import sys
import types
from dataclasses import dataclass

import pytest

from kvtier.errors import ConfigError
from kvtier.plan.cli import add_plan_args, parse_contexts, run_plan


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    add_plan_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_json_has_the_per_context_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--context",
                 "1024,8192", "--kv-dtype", "fp8", "--json")
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["context"] for c in out["contexts"]] == [1024, 8192]
    for c in out["contexts"]:
        assert {"kv_bytes_per_token", "session_bytes", "restore_s", "recompute_s",
                "decision"} <= set(c)
        assert c["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1
    assert out["crossover_tokens"] > 0 and out["pinned_bytes"] > 0


def test_table_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--model", "llama-3.1-70b", "--hardware", "a100-80g-pcie-gen4", "--context",
                 "8000", "--link-gbps", "12.5", "--tp", "8")
    assert run_plan(args) == 0
    text = capsys.readouterr().out
    assert "restore vs recompute" in text and "2.62 GB" in text
    assert "link 100 GB/s (8 x 12.5)" in text
    assert "crossover" in text and "pinned host memory to reserve" in text


def test_errors_name_the_bad_value_and_the_choices() -> None:
    with pytest.raises(ConfigError, match="'b200' is not a preset; choose one of "
                                          "a100-80g-pcie-gen4, h100-sxm"):
        run_plan(parse("--hardware", "b200"))
    with pytest.raises(ConfigError, match="'8k' is not a positive token count"):
        run_plan(parse("--context", "1024,8k"))
    with pytest.raises(ConfigError, match="'0'"):
        parse_contexts("0")
    with pytest.raises(ConfigError, match="--kv-dtype 'int8'"):
        run_plan(parse("--kv-dtype", "int8"))
    assert parse_contexts("1000, 8_000") == [1000, 8000]


@dataclass(frozen=True)
class Turn:
    session_id: int
    turn: int
    arrival_s: float
    new_tokens: tuple[int, ...]
    output_tokens: int


def test_trace_prints_simulated_ttft_per_class(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    seen = {}

    def load_trace(path: str, vocab_size: int) -> list[Turn]:
        seen["args"] = (path, vocab_size)
        return [Turn(s, k, float(s) if k == 0 else 60.0, (1,) * 2000, 50)
                for s in range(3) for k in range(2)]

    fake = types.ModuleType("kvtier.bench.trace")
    fake.load_trace = load_trace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.bench.trace", fake)
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--context", "2000"))
    text = capsys.readouterr().out
    assert seen["args"] == ("t.jsonl", 128256)
    assert "simulated TTFT by residency" in text and "host" in text
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--json"))
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["ttft_s"]["host"]["count"] == 3 and len(sim["requests"]) == 6
