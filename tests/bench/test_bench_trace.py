"""Traces: the generator is a pure function of its seed, files parse exactly, bad lines
name themselves, and Mooncake's equal hash ids become equal token runs."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from kvtier.bench.trace import (
    FIRST_TOKEN_ID,
    Trace,
    TraceError,
    detect_format,
    generate,
    load_jsonl,
    load_mooncake,
    load_trace,
)
from kvtier.errors import KvtierError

MOONCAKE = Path("/work/shared/traces/mooncake_conversation_1000.jsonl")
VOCAB = 1000


def _gen(seed: int, **kw: object) -> Trace:
    args: dict = dict(num_sessions=6, turns=(2, 4), arrival_rate=2.0, think_s=(1.0, 4.0),
                      first_tokens=(20, 40), turn_tokens=(3, 8), output_tokens=(2, 6),
                      vocab_size=VOCAB, seed=seed)
    args.update(kw)
    return generate(**args)


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- generator


def test_generate_is_a_function_of_the_seed() -> None:
    assert _gen(7).requests == _gen(7).requests
    assert _gen(7).requests != _gen(8).requests


def test_generate_respects_its_ranges() -> None:
    trace = _gen(3)
    sessions = trace.sessions()
    assert trace.num_sessions == len(sessions) == 6
    starts = [turns[0].arrival_s for turns in sessions.values()]
    assert starts[0] == 0.0 and starts == sorted(starts)  # Poisson arrivals, first at t=0
    for turns in sessions.values():
        assert 2 <= len(turns) <= 4
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert 20 <= len(turns[0].new_tokens) <= 40
        assert all(3 <= len(r.new_tokens) <= 8 for r in turns[1:])
        assert all(2 <= r.output_tokens <= 6 for r in turns)
        assert all(FIRST_TOKEN_ID <= t < VOCAB for r in turns for t in r.new_tokens)
    assert trace.total_input_tokens == sum(len(r.new_tokens) for r in trace.requests)


def test_think_times_are_lognormal_with_the_given_median_and_p90() -> None:
    # 1500 sessions of 2 turns: 1500 think times, median ~1 s and p90 ~4 s.
    trace = _gen(0, num_sessions=1500, turns=(2, 2), first_tokens=(1, 1), turn_tokens=(1, 1))
    thinks = sorted(r.arrival_s for r in trace.requests if r.turn > 0)
    assert 0.85 < statistics.median(thinks) < 1.15
    assert 3.3 < thinks[int(0.9 * len(thinks))] < 4.8


def test_zero_think_time_means_back_to_back() -> None:
    trace = _gen(1, think_s=(0.0, 0.0))
    assert all(r.arrival_s == 0.0 for r in trace.requests if r.turn > 0)


@pytest.mark.parametrize("kw", [
    {"num_sessions": 0}, {"turns": (3, 2)}, {"turns": (0, 2)}, {"arrival_rate": 0.0},
    {"think_s": (5.0, 1.0)}, {"think_s": (0.0, 1.0)}, {"vocab_size": 50},
    {"output_tokens": (0, 3)},
])
def test_generate_rejects_bad_settings(kw: dict) -> None:
    with pytest.raises(TraceError):
        _gen(0, **kw)


# ---------------------------------------------------------------------------- JSONL


def test_jsonl_parses_counts_explicit_tokens_comments_and_interleaving(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        "# two sessions, interleaved by time",
        '{"session": "a", "turn": 0, "arrival_s": 0.0, "input_tokens": 5, "output_tokens": 3}',
        "",
        '{"session": "b", "turn": 0, "arrival_s": 1.5, "tokens": [1, 2, 3], "output_tokens": 2}',
        '{"session": "a", "turn": 1, "arrival_s": 30, "input_tokens": 2, "output_tokens": 4,'
        ' "note": "ignored"}',
    ])
    trace = load_jsonl(path, VOCAB, seed=5)
    assert [(r.session_id, r.turn) for r in trace.requests] == [("a", 0), ("a", 1), ("b", 0)]
    a0, a1, b0 = trace.requests
    assert (a0.arrival_s, a1.arrival_s, b0.arrival_s) == (0.0, 30.0, 1.5)
    assert (len(a0.new_tokens), len(a1.new_tokens)) == (5, 2)
    assert b0.new_tokens == (1, 2, 3) and b0.output_tokens == 2
    assert load_jsonl(path, VOCAB, seed=5).requests == trace.requests
    assert load_jsonl(path, VOCAB, seed=6).requests != trace.requests
    # time_scale stretches arrivals and think times; limit keeps the first N lines.
    assert [r.arrival_s for r in load_jsonl(path, VOCAB, seed=5, time_scale=2).requests] \
        == [0.0, 60.0, 3.0]
    assert len(load_jsonl(path, VOCAB, limit=2).requests) == 2


OK = {"session": "s", "turn": 0, "arrival_s": 0.0, "input_tokens": 4, "output_tokens": 2}


@pytest.mark.parametrize(("line", "words"), [
    ('{"session": "s", "turn": 0,', "not valid JSON"),
    ("[1, 2, 3]", "expected an object"),
    (json.dumps({k: v for k, v in OK.items() if k != "output_tokens"}), "missing field"),
    (json.dumps({**OK, "input_tokens": "12"}), "input_tokens='12'"),
    (json.dumps({**OK, "input_tokens": -3}), "input_tokens=-3"),
    (json.dumps({**OK, "arrival_s": -1}), "arrival_s=-1"),
    (json.dumps({**OK, "output_tokens": True}), "output_tokens=True"),
    (json.dumps({**OK, "session": 3}), "session=3"),
    (json.dumps({**OK, "session": "x", "turn": 2}), "expected turn 1"),
    (json.dumps({**OK, "tokens": [5, 5000]}), "out of range"),
    (json.dumps({**OK, "tokens": [5, 6]}), "tokens has 2 ids"),
    (json.dumps({**OK, "tokens": []}), "tokens is empty"),
])
def test_jsonl_bad_line_names_its_line(tmp_path: Path, line: str, words: str) -> None:
    # line 1 is a comment, line 2 a good turn 0 of session "x", line 3 the bad one.
    path = _write(tmp_path, ["# header", json.dumps({**OK, "session": "x"}), line])
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{re.escape(words)}"):
        load_trace(path, VOCAB)


def test_empty_and_missing_files_are_trace_errors(tmp_path: Path) -> None:
    empty = _write(tmp_path, ["# only a comment", ""], "empty.jsonl")
    with pytest.raises(TraceError, match="empty trace"):
        load_trace(empty, VOCAB)
    with pytest.raises(TraceError, match=r"nope\.jsonl"):
        load_trace(tmp_path / "nope.jsonl", VOCAB)
    assert issubclass(TraceError, KvtierError)


def test_load_trace_detects_the_format_and_refuses_misplaced_options(tmp_path: Path) -> None:
    jsonl = _write(tmp_path, [json.dumps(OK)], "k.jsonl")
    moon = _write(tmp_path, ['{"timestamp": 0, "input_length": 10, "output_length": 2, '
                             '"hash_ids": [1]}'], "m.jsonl")
    assert (detect_format(jsonl), detect_format(moon)) == ("jsonl", "mooncake")
    assert load_trace(moon, VOCAB).meta["format"] == "mooncake"
    assert load_trace(jsonl, VOCAB, scale_length=1.0, time_scale=1.0, limit=None).meta[
        "format"] == "jsonl"
    with pytest.raises(TraceError, match="Mooncake traces only"):
        load_trace(jsonl, VOCAB, scale_length=0.5)
    with pytest.raises(TraceError, match="fmt='csv'"):
        load_trace(jsonl, VOCAB, fmt="csv")


# ---------------------------------------------------------------------------- Mooncake


def _moon(ts: int, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out,
                       "hash_ids": ids})


def test_mooncake_equal_hash_ids_are_equal_token_runs(tmp_path: Path) -> None:
    # block_tokens 4: [7, 8, 9] and [7, 8, 10] share two blocks = 8 tokens of prefix.
    path = _write(tmp_path, [_moon(0, 12, 3, [7, 8, 9]), _moon(2500, 10, 0, [7, 8, 10])])
    a, b = load_mooncake(path, VOCAB, block_tokens=4).requests
    assert (len(a.new_tokens), len(b.new_tokens)) == (12, 10)
    assert a.new_tokens[:8] == b.new_tokens[:8] and a.new_tokens[8:10] != b.new_tokens[8:10]
    assert (a.output_tokens, b.output_tokens) == (3, 1)  # output_length 0 -> at least 1
    assert (a.session_id, a.turn, b.arrival_s) == ("r0", 0, 2.5)
    # Stable across processes and loads: no salted hash().
    assert load_mooncake(path, VOCAB, block_tokens=4).requests == [a, b]


@pytest.mark.parametrize(("line", "words"), [
    ("{bad json", "not valid JSON"),
    (_moon(0, 600, 2, []), "hash_ids has 0 ids"),
    (_moon(0, 1100, 2, [1, 2]), "expected 3 ids"),
    (_moon(0, -5, 2, [1]), "input_length=-5"),
    (_moon(0, 10, -1, [1]), "output_length=-1"),
    (_moon(0, 10, 2, [-4]), "negative id"),
    (json.dumps({"timestamp": "0", "input_length": 10, "output_length": 2, "hash_ids": [1]}),
     "timestamp='0'"),
    (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [1]}),
     "missing field 'output_length'"),
    (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": "1"}),
     "hash_ids is '1'"),
])
def test_mooncake_bad_line_names_its_line(tmp_path: Path, line: str, words: str) -> None:
    path = _write(tmp_path, [_moon(0, 10, 2, [1]), "", line])
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{re.escape(words)}"):
        load_mooncake(path, VOCAB)


@pytest.fixture(scope="module")
def real_lines() -> list[dict]:
    if not MOONCAKE.is_file():
        pytest.skip(f"{MOONCAKE} is not present")
    with MOONCAKE.open() as f:
        return [json.loads(next(f)) for _ in range(40)]


def test_mooncake_real_trace_shared_prefixes(real_lines: list[dict]) -> None:
    scale = 0.05
    per_block = round(512 * scale)
    trace = load_mooncake(MOONCAKE, 49152, scale_length=scale, limit=40)
    assert trace.num_sessions == len(trace.requests) == 40
    for raw, req in zip(real_lines, trace.requests):
        assert len(req.new_tokens) == max(1, round(raw["input_length"] * scale))
        assert req.output_tokens == max(1, round(raw["output_length"] * scale))
    # The first 40 requests all start with hash id 0: one shared block; where ids diverge,
    # the tokens diverge too.
    pairs = 0
    for i in range(len(real_lines)):
        for j in range(i + 1, len(real_lines)):
            a, b = real_lines[i]["hash_ids"], real_lines[j]["hash_ids"]
            k = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ta, tb = trace.requests[i].new_tokens, trace.requests[j].new_tokens
            shared = min(k * per_block, len(ta), len(tb))
            assert ta[:shared] == tb[:shared]
            if k < min(len(a), len(b)) - 1:
                assert ta[k * per_block:(k + 1) * per_block] \
                    != tb[k * per_block:(k + 1) * per_block]
            pairs += k > 0
    assert pairs > 0


def test_mooncake_real_trace_scales_lengths_and_time(real_lines: list[dict]) -> None:
    small = load_mooncake(MOONCAKE, 49152, scale_length=0.02, limit=40)
    smaller = load_mooncake(MOONCAKE, 49152, scale_length=0.01, limit=40)
    assert smaller.total_input_tokens < small.total_input_tokens
    slow = load_mooncake(MOONCAKE, 49152, scale_length=0.01, time_scale=3.0, limit=40)
    assert any(r.arrival_s > 0 for r in smaller.requests)
    for raw, base, stretched in zip(real_lines, smaller.requests, slow.requests):
        assert base.arrival_s == pytest.approx(raw["timestamp"] / 1000)
        assert stretched.arrival_s == pytest.approx(3 * base.arrival_s)
    assert load_trace(MOONCAKE, 49152, scale_length=0.01, limit=40).requests == smaller.requests
