"""`kvtier plan` on the command line: the table, --json's keys, errors, --trace."""

import argparse
import json
import sys
import types
from itertools import pairwise
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.plan.cli import add_plan_args, parse_contexts, run_plan
from kvtier.plan.simulate import SimTurn


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



def test_trace_prints_simulated_ttft_per_class(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    seen = fake_loader(monkeypatch)
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--context", "2000"))
    text = capsys.readouterr().out
    assert seen["args"] == ("t.jsonl", 128256, "auto")
    assert seen["kw"] == {"scale_length": 1.0, "time_scale": 1.0, "limit": None}
    assert "simulated TTFT by residency" in text and "host" in text
    assert "simulated TTFT split (p50 / p90)" in text and "compute: busy" in text
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--json"))
    sim = json.loads(capsys.readouterr().out)["simulation"]
    assert sim["ttft_s"]["host"]["count"] == 3 and len(sim["requests"]) == 6
    host = sim["split_s"]["host"]
    assert set(host) == {"queue", "tier", "compute"} and host["tier"]["p50"] > 0
    assert set(sim["split_s"]) >= {"all", "resident", "host", "recomputed", "new"}
    assert 0 < sim["compute_utilisation"] <= 1
    for r in sim["requests"]:
        assert r["queue_s"] + r["tier_s"] + r["compute_s"] == pytest.approx(r["ttft_s"])


def fake_loader(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Stand in for kvtier.bench.trace: 3 sessions x 2 turns 60 s apart; notes its call."""
    seen: dict[str, object] = {}

    def load_trace(path: str, vocab_size: int, fmt: str = "auto", **kw: object) -> list[SimTurn]:
        seen["args"], seen["kw"] = (path, vocab_size, fmt), kw
        return [SimTurn(s, k, float(s) if k == 0 else 60.0, (1,) * 2000, 50)
                for s in range(3) for k in range(2)]

    fake = types.ModuleType("kvtier.bench.trace")
    fake.load_trace = load_trace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvtier.bench.trace", fake)
    return seen


def test_trace_flags_reach_the_loader_as_bench_passes_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen = fake_loader(monkeypatch)
    run_plan(parse("--trace", "m.jsonl", "--format", "mooncake", "--scale-length", "0.25",
                   "--time-scale", "0.5", "--limit", "40", "--json"))
    assert seen["args"] == ("m.jsonl", 128256, "mooncake")
    assert seen["kw"] == {"scale_length": 0.25, "time_scale": 0.5, "limit": 40}
    assert json.loads(capsys.readouterr().out)["simulation"]["split_s"]["all"]


def test_trace_flags_shape_the_real_trace(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path)
    run_plan(parse("--trace", str(path), "--limit", "2", "--time-scale", "3", "--json"))
    requests = json.loads(capsys.readouterr().out)["simulation"]["requests"]
    assert [(r["session_id"], r["turn"]) for r in requests] == [("a", 0), ("b", 0)]
    assert requests[1]["arrival_s"] == pytest.approx(3 * 1.5)


def write_jsonl(tmp_path: Path) -> Path:
    """A kvtier JSONL trace: sessions a and b, two turns each."""
    rows = [{"session": s, "turn": k, "arrival_s": 1.5 * i if k == 0 else 10.0,
             "input_tokens": 300, "output_tokens": 8}
            for k in range(2) for i, s in enumerate("ab")]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("flags", "message"), [
    (("--limit", "0"), "limit=0: expected None (all requests) or an integer >= 1"),
    (("--time-scale", "-1"), "time_scale"),
    (("--scale-length", "0.5"), "applies to Mooncake traces only"),
    (("--load-policy", "sometimes"), "load_policy='sometimes' is not one of auto"),
    (("--max-load-gbps", "0"), "max_load_gbps=0.0 must be a number of GB/s > 0"),
    (("--clients", "0"), "clients=0 must be a whole number >= 1"),
    (("--max-num-seqs", "-2"), "max_num_seqs=-2 must be a whole number >= 1"),
])
def test_a_bad_trace_flag_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           flags: tuple[str, ...], message: str) -> None:
    from kvtier.cli import main

    assert main(["plan", "--trace", str(write_jsonl(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and message in err
    assert "Traceback" not in err


def test_a_trace_flag_without_a_trace_is_an_error() -> None:
    with pytest.raises(ConfigError, match="--limit 5 applies to a simulated trace"):
        run_plan(parse("--limit", "5"))
    with pytest.raises(ConfigError, match=r"--time-scale 2\.0 applies"):
        run_plan(parse("--time-scale", "2"))
    with pytest.raises(ConfigError, match="--load-policy never applies"):
        run_plan(parse("--load-policy", "never"))


def test_the_engine_knobs_reach_the_simulation(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # 3 sessions of 2000 tokens woken from host: never recomputes all three and says why;
    # one client sends one turn at a time; a restore capped at 1 GB/s (always loaded: auto
    # would recompute it) takes at least its bytes / 1 GB/s
    fake_loader(monkeypatch)
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--load-policy", "never"))
    assert "restores declined (recomputed): policy 3" in capsys.readouterr().out
    run_plan(parse("--trace", "t.jsonl", "--device-sessions", "1", "--clients", "1",
                   "--max-load-gbps", "1", "--load-policy", "always", "--json"))
    sim = json.loads(capsys.readouterr().out)["simulation"]
    spans = sorted((r["arrival_s"], r["finish_s"]) for r in sim["requests"])
    assert all(b[0] >= a[1] for a, b in pairwise(spans))
    host = [r for r in sim["requests"] if r["residency"] == "host"]
    assert host and all(r["tier_s"] >= r["context"] * 131072 / 1e9 for r in host)
