"""What the field's load harnesses report, read into one shape per load level: `vllm bench
serve`'s result file (--save-result --save-detailed) and GuideLLM's JSON report, with the
answer each request got, so that configurations can be checked against each other.

TPOT here is vLLM's definition for both: the time between output tokens after the first
(GuideLLM's own "time_per_output_token" includes the TTFT; its inter-token latency is this).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class HarnessOutputError(ValueError):
    """A harness's report lacks what the runner reads: the harness changed, or failed."""


@dataclass(frozen=True)
class LoadPoint:
    """One harness run at one load level (concurrent streams) against one server."""

    harness: str
    load: int
    finished: int
    failed: int
    ttft_ms: Mapping[str, float]  # mean, p50, p90, p99
    tpot_ms: Mapping[str, float]  # p50, p99
    output_tok_s: float
    answers: Mapping[str, str] = field(default_factory=dict)  # request key -> its answer

    @property
    def empty_answers(self) -> int:
        return sum(1 for text in self.answers.values() if not text)


@dataclass(frozen=True)
class AnswerCheck:
    """Answers of one configuration held against the reference's, request by request."""

    compared: int
    differing: tuple[str, ...]  # request keys whose answers differ
    unmatched: int  # requests the reference never sent (multi-turn histories that diverged)


def _get(doc: Mapping[str, Any], *path: str) -> Any:
    node: Any = doc
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise HarnessOutputError(f"the report has no {'/'.join(path)}")
        node = node[key]
    return node


def vllm_bench_point(doc: Mapping[str, Any]) -> LoadPoint:
    """`vllm bench serve` run with --percentile-metrics ttft,tpot --metric-percentiles
    50,90,99 --save-detailed: requests keyed by their place in the (seeded) data set."""
    try:
        ttft = {"mean": float(doc["mean_ttft_ms"]), "p50": float(doc["p50_ttft_ms"]),
                "p90": float(doc["p90_ttft_ms"]), "p99": float(doc["p99_ttft_ms"])}
        tpot = {"p50": float(doc["p50_tpot_ms"]), "p99": float(doc["p99_tpot_ms"])}
        texts = doc.get("generated_texts") or []
        errors = doc.get("errors") or [""] * len(texts)
        return LoadPoint(
            "vllm-bench", int(doc["max_concurrency"] or 0), int(doc["completed"]),
            int(doc["failed"]), ttft, tpot, float(doc["output_throughput"]),
            {str(i): t for i, (t, e) in enumerate(zip(texts, errors)) if not e})
    except KeyError as e:
        raise HarnessOutputError(f"vllm bench serve's result has no {e.args[0]} (run it with "
                                 "--percentile-metrics ttft,tpot --metric-percentiles "
                                 "50,90,99 --save-result --save-detailed)") from None


def guidellm_points(doc: Mapping[str, Any]) -> list[LoadPoint]:
    """One point per benchmark of a GuideLLM report (a concurrent profile: one per
    stream count); requests keyed by a digest of the prompt they sent."""
    points = []
    for bench in _get(doc, "benchmarks"):
        m = _get(bench, "metrics")
        ttft = _get(m, "time_to_first_token_ms", "successful")
        itl = _get(m, "inter_token_latency_ms", "successful")
        pct, ipct = _get(ttft, "percentiles"), _get(itl, "percentiles")
        requests = _get(bench, "requests")
        done = requests.get("successful") or []
        failed = len(requests.get("errored") or []) + len(requests.get("incomplete") or [])
        duration = float(_get(bench, "duration"))
        tokens = sum(int(r.get("output_tokens") or 0) for r in done)
        points.append(LoadPoint(
            "guidellm", int(_get(bench, "config", "strategy", "streams")), len(done), failed,
            {"mean": float(ttft["mean"]), "p50": float(pct["p50"]), "p90": float(pct["p90"]),
             "p99": float(pct["p99"])},
            {"p50": float(ipct["p50"]), "p99": float(ipct["p99"])},
            tokens / duration if duration > 0 else 0.0,
            {prompt_key(r.get("request_args")): r.get("output") or "" for r in done}))
    if not points:
        raise HarnessOutputError("the GuideLLM report holds no benchmark")
    return points


def prompt_key(request_args: str | Mapping[str, Any] | None) -> str:
    """A short digest of what a request asked (its prompt, or its chat messages)."""
    args = json.loads(request_args) if isinstance(request_args, str) else request_args or {}
    body = args.get("body") or {}
    asked = body.get("prompt", body.get("messages"))
    return hashlib.blake2b(json.dumps(asked, sort_keys=True).encode(),
                           digest_size=8).hexdigest()


def compare_answers(reference: Mapping[str, str], other: Mapping[str, str]) -> AnswerCheck:
    """Requests both sent, and those whose answers differ (temperature 0: none should)."""
    shared = sorted(set(reference) & set(other))
    return AnswerCheck(len(shared), tuple(k for k in shared if reference[k] != other[k]),
                       len(set(other) - set(reference)))


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_REASON = re.compile(r'reason="([^"]*)"')


def counter_totals(metrics_text: str, families: Sequence[str]) -> dict[str, float]:
    """Prometheus counters summed over their labels but `reason` ("name{reason}" apart):
    what a server's /metrics says, to be taken before and after a run."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        found = _SAMPLE.match(line)
        if found is None or found.group(1) not in families:
            continue
        name, labels, value = found.groups()
        reason = _REASON.search(labels or "")
        key = f"{name}{{{reason.group(1)}}}" if reason else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the counters grew by between two scrapes."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
