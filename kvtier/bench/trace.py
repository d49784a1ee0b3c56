"""Multi-turn session traces: what `kvtier bench` sends, when, and with which token ids.

A trace is a list of `TraceRequest`s grouped by session. Turn 0 of a session is sent
`arrival_s` seconds after the trace starts; a later turn is sent `arrival_s` seconds (the
think time) after the previous turn of the same session FINISHED, so the idle gaps that
make state go cold survive however slow the engine is. Each turn appends `new_tokens` (the
user message) to the conversation; the replay sends the whole conversation so far.

Sources, all deterministic under their seed:

- `generate(...)`: synthetic sessions (Poisson arrivals, lognormal think times).
- `load_jsonl(path, vocab_size)`: kvtier's own schema, one request per line::

      {"session": "s1", "turn": 0, "arrival_s": 0.0, "input_tokens": 120, "output_tokens": 32}

  `session`: string. `turn`: 0, 1, 2... in file order within a session (sessions may
  interleave). `arrival_s`: seconds >= 0 (from the trace start for turn 0, think time after
  the previous turn finished otherwise). `input_tokens`: int >= 1, length of this turn's new
  message (ids drawn from the seed). `output_tokens`: int >= 1, the turn's max_tokens.
  Optional `tokens`: the exact message ids, each in [0, vocab_size); `input_tokens` may
  then be omitted and, if given, must equal len(tokens). Other fields are ignored.
- `load_mooncake(path, vocab_size)`: the public Mooncake format (`timestamp` in ms,
  `input_length`, `output_length`, `hash_ids`: one id per 512-token block, equal ids = a
  shared prefix block). Each request is its own single-turn session.
- `load_trace(path, vocab_size, fmt="auto")`: either, detected from the first request line.

In every file, blank lines and lines starting with `#` are skipped, and a malformed line
raises `TraceError("path:line: what is wrong; what is expected")`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError

FIRST_TOKEN_ID = 100  # drawn ids start here: low ids are usually special tokens
Z90 = 1.2815515655446004  # standard normal 90th percentile: sigma = ln(p90 / median) / Z90
FORMATS = ("auto", "jsonl", "mooncake")


class TraceError(KvtierError):
    """A trace file or generator setting is unusable: the message names where and the fix."""


@dataclass(frozen=True)
class TraceRequest:
    """One turn of one session: when it is sent, what it appends, how much it generates."""

    session_id: str
    turn: int
    arrival_s: float  # turn 0: from trace start; turn > 0: think time after the previous turn
    new_tokens: tuple[int, ...]
    output_tokens: int


@dataclass
class Trace:
    """Requests ordered by session then turn, plus where they came from."""

    requests: list[TraceRequest]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    def sessions(self) -> dict[str, list[TraceRequest]]:
        """Session id -> its turns in order, sessions in first-appearance order."""
        out: dict[str, list[TraceRequest]] = {}
        for req in self.requests:
            out.setdefault(req.session_id, []).append(req)
        return out

    @property
    def num_sessions(self) -> int:
        return len({r.session_id for r in self.requests})

    @property
    def total_input_tokens(self) -> int:
        return sum(len(r.new_tokens) for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)


def _draw(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n ids in [FIRST_TOKEN_ID, vocab_size); sequential, so a longer draw extends a shorter."""
    return rng.choices(range(FIRST_TOKEN_ID, vocab_size), k=n)


def _check_vocab(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or vocab_size <= FIRST_TOKEN_ID:
        raise TraceError(f"vocab_size={vocab_size!r}: expected an integer > {FIRST_TOKEN_ID} "
                         f"(ids below {FIRST_TOKEN_ID} are left to special tokens)")


def _check_range(name: str, pair: tuple[int, int], minimum: int) -> tuple[int, int]:
    try:
        lo, hi = pair
    except (TypeError, ValueError):
        raise TraceError(f"{name}={pair!r}: expected a pair (lo, hi)") from None
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) \
            or not minimum <= lo <= hi:
        raise TraceError(f"{name}={pair!r}: expected integers with {minimum} <= lo <= hi")
    return lo, hi


def _check_scale(name: str, value: float, allow_zero: bool) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise TraceError(f"{name}={value!r}: expected a finite number {bound}")


def _check_limit(limit: int | None) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise TraceError(f"limit={limit!r}: expected None (all requests) or an integer >= 1")


def generate(num_sessions: int, turns: tuple[int, int], arrival_rate: float,
             think_s: tuple[float, float], first_tokens: tuple[int, int],
             turn_tokens: tuple[int, int], output_tokens: tuple[int, int], vocab_size: int,
             seed: int) -> Trace:
    """Synthetic multi-turn sessions, fully determined by `seed`.

    Sessions arrive as a Poisson process of `arrival_rate` per second (the first at t=0);
    each has a uniform number of turns in `turns` [lo, hi]. Think times between turns are
    lognormal with `think_s` = (median, p90) seconds: heavy-tailed like real users, so some
    gaps are long enough for state to go cold; (0, 0) means back to back (no idle gaps).
    Turn 0 appends a message of uniform length in `first_tokens`, later turns one in
    `turn_tokens`; each turn generates up to uniform `output_tokens`. Ids are drawn in
    [100, vocab_size) from `random.Random(seed)`.
    """
    _check_vocab(vocab_size)
    if isinstance(num_sessions, bool) or not isinstance(num_sessions, int) or num_sessions < 1:
        raise TraceError(f"num_sessions={num_sessions!r}: expected an integer >= 1")
    turns = _check_range("turns", turns, 1)
    first_tokens = _check_range("first_tokens", first_tokens, 1)
    turn_tokens = _check_range("turn_tokens", turn_tokens, 1)
    output_tokens = _check_range("output_tokens", output_tokens, 1)
    if not arrival_rate > 0:
        raise TraceError(f"arrival_rate={arrival_rate!r}: expected sessions per second > 0 "
                         "(inf sends every session at t=0)")
    median, p90 = think_s
    if not (math.isfinite(median) and math.isfinite(p90) and 0 <= median <= p90) \
            or (median == 0 and p90 != 0):
        raise TraceError(f"think_s={think_s!r}: expected (median, p90) seconds with "
                         "0 < median <= p90, or (0, 0) for no think time")
    mu = math.log(median) if median > 0 else 0.0
    sigma = math.log(p90 / median) / Z90 if median > 0 else 0.0

    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    start = 0.0
    for i in range(num_sessions):
        if i:
            start += rng.expovariate(arrival_rate)
        for turn in range(rng.randint(*turns)):
            think = rng.lognormvariate(mu, sigma) if turn and median > 0 else 0.0
            arrival = start if turn == 0 else think
            size = rng.randint(*(first_tokens if turn == 0 else turn_tokens))
            tokens = tuple(_draw(rng, size, vocab_size))
            requests.append(TraceRequest(f"s{i}", turn, arrival, tokens,
                                         rng.randint(*output_tokens)))
    meta = {"format": "generated", "num_sessions": num_sessions, "turns": list(turns),
            "arrival_rate": arrival_rate, "think_s": {"median": median, "p90": p90,
                                                      "distribution": "lognormal"},
            "first_tokens": list(first_tokens), "turn_tokens": list(turn_tokens),
            "output_tokens": list(output_tokens), "vocab_size": vocab_size, "seed": seed}
    return Trace(requests, f"generated(seed={seed})", meta)


def _lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every request line; missing, unreadable or empty is an error."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file; pass the path of a kvtier JSONL "
                         "or Mooncake trace") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text ({e.reason}); expected JSON lines") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror})") from None
    lines = [(n, s.strip()) for n, s in enumerate(text.splitlines(), start=1)]
    lines = [(n, s) for n, s in lines if s and not s.startswith("#")]
    if not lines:
        raise TraceError(f"{path}: empty trace (no request lines); expected one JSON object "
                         "per line")
    return lines


@dataclass(frozen=True)
class _Line:
    """One parsed request line; its getters raise TraceError naming the line."""

    where: str
    obj: dict[str, Any]

    @classmethod
    def parse(cls, path: Path, lineno: int, text: str) -> _Line:
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                             "expected one JSON object per line") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: got a JSON {type(obj).__name__}; expected an object "
                             "with the request's fields")
        return cls(where, obj)

    def fail(self, what: str) -> TraceError:
        return TraceError(f"{self.where}: {what}")

    def get(self, key: str, expected: str) -> Any:
        if key not in self.obj:
            raise self.fail(f"missing field {key!r}; expected {expected}")
        return self.obj[key]

    def integer(self, key: str, minimum: int, meaning: str) -> int:
        expected = f"an integer >= {minimum} ({meaning})"
        value = self.get(key, expected)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{key}={value!r} is invalid; expected {expected}")
        return value

    def number(self, key: str, meaning: str) -> float:
        expected = f"a number >= 0 ({meaning})"
        value = self.get(key, expected)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise self.fail(f"{key}={value!r} is invalid; expected {expected}")
        return float(value)

    def int_list(self, key: str, expected: str) -> list[int]:
        value = self.get(key, expected)
        if not isinstance(value, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in value):
            raise self.fail(f"{key} is {_short(value)}; expected {expected}")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_jsonl(path: str | Path, vocab_size: int, seed: int = 0, time_scale: float = 1.0,
               limit: int | None = None) -> Trace:
    """kvtier's JSONL schema (module docstring); counts become ids drawn from `seed`.

    `time_scale` multiplies every arrival and think time; `limit` keeps the first N lines.
    """
    path = Path(path)
    _check_vocab(vocab_size)
    _check_scale("time_scale", time_scale, allow_zero=True)
    _check_limit(limit)
    rng = random.Random(seed)
    sessions: dict[str, list[TraceRequest]] = {}
    for lineno, text in _lines(path)[:limit]:
        line = _Line.parse(path, lineno, text)
        session = line.get("session", "a session id string")
        if not isinstance(session, str) or not session:
            raise line.fail(f"session={session!r} is invalid; expected a non-empty string")
        turn = line.integer("turn", 0, "0 for a session's first turn")
        done = sessions.setdefault(session, [])
        if turn != len(done):
            raise line.fail(f"turn {turn} of session {session!r} comes after {len(done)} "
                            f"turn(s); expected turn {len(done)} (turns run 0, 1, 2... in "
                            "file order)")
        arrival = line.number("arrival_s", "seconds from the trace start for turn 0, "
                                           "think time after the previous turn otherwise")
        output = line.integer("output_tokens", 1, "the turn's max_tokens")
        tokens = _jsonl_tokens(line, rng, vocab_size)
        done.append(TraceRequest(session, turn, arrival * time_scale, tokens, output))
    requests = [r for turns in sessions.values() for r in turns]
    meta = {"format": "jsonl", "path": str(path), "seed": seed, "time_scale": time_scale,
            "limit": limit, "vocab_size": vocab_size}
    return Trace(requests, str(path), meta)


def _jsonl_tokens(line: _Line, rng: random.Random, vocab_size: int) -> tuple[int, ...]:
    if "tokens" not in line.obj:
        size = line.integer("input_tokens", 1, "tokens in this turn's new message")
        return tuple(_draw(rng, size, vocab_size))
    expected = f"a non-empty list of token ids in [0, {vocab_size})"
    tokens = line.int_list("tokens", expected)
    if not tokens:
        raise line.fail(f"tokens is empty; expected {expected}")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise line.fail(f"token id {bad} is out of range; expected {expected}")
    if "input_tokens" in line.obj and line.obj["input_tokens"] != len(tokens):
        raise line.fail(f"input_tokens={line.obj['input_tokens']!r} but tokens has "
                        f"{len(tokens)} ids; expected them equal (or drop input_tokens)")
    return tuple(tokens)


def load_mooncake(path: str | Path, vocab_size: int, scale_length: float = 1.0,
                  time_scale: float = 1.0, limit: int | None = None, block_tokens: int = 512,
                  seed: int = 0) -> Trace:
    """A public Mooncake trace; each request is a single-turn session.

    Arrival = timestamp / 1000 * `time_scale`. Tokens are built block by block: the block
    with hash id h gets round(block_tokens * scale_length) ids from
    `random.Random(h * 1_000_003 + seed)` (stable across processes), so equal ids are equal
    token runs, i.e. a shared prefix. The prompt is cut (or its last block extended from the
    same stream) to round(input_length * scale_length) tokens, min 1; output_tokens =
    max(1, round(output_length * scale_length)). `limit` keeps the first N requests.
    """
    path = Path(path)
    _check_vocab(vocab_size)
    _check_scale("scale_length", scale_length, allow_zero=False)
    _check_scale("time_scale", time_scale, allow_zero=True)
    _check_limit(limit)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise TraceError(f"block_tokens={block_tokens!r}: expected an integer >= 1 "
                         "(Mooncake's published traces use 512)")
    per_block = max(1, round(block_tokens * scale_length))
    runs: dict[int, list[int]] = {}  # hash id -> the longest token run drawn for it so far
    refs = 0

    def block(h: int, n: int) -> list[int]:
        run = runs.get(h)
        if run is None or len(run) < n:
            run = _draw(random.Random(h * 1_000_003 + seed), n, vocab_size)
            runs[h] = run
        return run[:n]

    requests: list[TraceRequest] = []
    for lineno, text in _lines(path)[:limit]:
        line = _Line.parse(path, lineno, text)
        stamp = line.number("timestamp", "milliseconds since the trace start")
        input_length = line.integer("input_length", 1, "prompt tokens")
        output_length = line.integer("output_length", 0, "generated tokens")
        expected = f"a list of integer block ids >= 0, one per {block_tokens}-token block"
        hash_ids = line.int_list("hash_ids", expected)
        needed = math.ceil(input_length / block_tokens)
        if len(hash_ids) < needed:
            raise line.fail(f"hash_ids has {len(hash_ids)} ids ({len(hash_ids) * block_tokens}"
                            f" tokens) but input_length is {input_length}; expected "
                            f"{needed} ids, one per {block_tokens}-token block")
        if any(h < 0 for h in hash_ids):
            raise line.fail(f"hash_ids holds a negative id; expected {expected}")
        target = max(1, round(input_length * scale_length))
        tokens: list[int] = []
        for k, h in enumerate(hash_ids[:needed]):
            if len(tokens) >= target:
                break
            last = k == needed - 1
            tokens.extend(block(h, max(per_block, target - len(tokens)) if last else per_block))
            refs += 1
        requests.append(TraceRequest(f"r{len(requests)}", 0, stamp / 1000 * time_scale,
                                     tuple(tokens[:target]),
                                     max(1, round(output_length * scale_length))))
    meta = {"format": "mooncake", "path": str(path), "scale_length": scale_length,
            "time_scale": time_scale, "limit": limit, "block_tokens": block_tokens,
            "seed": seed, "vocab_size": vocab_size, "unique_blocks": len(runs),
            "block_refs": refs}
    return Trace(requests, str(path), meta)


def detect_format(path: str | Path) -> str:
    """'mooncake' if the first request line has `hash_ids`, else 'jsonl'."""
    path = Path(path)
    _, text = _lines(path)[0]
    try:
        first = json.loads(text)
    except json.JSONDecodeError:
        return "jsonl"  # the JSONL loader reports the bad line
    return "mooncake" if isinstance(first, dict) and "hash_ids" in first else "jsonl"


def load_trace(path: str | Path, vocab_size: int, fmt: str = "auto", **kw: Any) -> Trace:
    """Load a trace file as `fmt` ('auto' detects it); `kw` goes to that format's loader.

    A kvtier JSONL trace gives exact lengths, so it accepts `scale_length` only as 1.0.
    """
    if fmt not in FORMATS:
        raise TraceError(f"fmt={fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "mooncake":
        return load_mooncake(path, vocab_size, **kw)
    scale = kw.pop("scale_length", 1.0)
    kw.pop("block_tokens", None)
    if scale != 1.0:
        raise TraceError(f"{path}: scale_length={scale} applies to Mooncake traces only; a "
                         "kvtier JSONL trace gives exact lengths (drop scale_length)")
    return load_jsonl(path, vocab_size, **kw)
