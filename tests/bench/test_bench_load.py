"""Saturation and the time split in the report: a trace offered at 3x what the machine serves
is flagged saturated and one at 0.3x is not, `--time-scale auto` lands near its target, the
bimodal flag names the part that makes two classes differ, refused requests are listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.load import (
    auto_time_scale,
    nominal_span_s,
    probe_sample,
    probe_time_scale,
    rescale,
    saturation,
    saturation_message,
    span_at,
)
from kvtier.bench.report import summarize_config
from kvtier.bench.run import run_config
from kvtier.bench.trace import TraceError, generate
from kvtier.cli import main
from kvtier.model.loader import LoadedModel

KNOBS = {"num_device_blocks": 128, "max_num_batched_tokens": 1024, "kv_offloading_size": 0.0}


def trace_of(tiny: LoadedModel, sessions: int = 24) -> Any:
    return generate(num_sessions=sessions, turns=(2, 3), arrival_rate=1.0, think_s=(1.0, 2.0),
                    first_tokens=(150, 300), turn_tokens=(20, 60), output_tokens=(8, 24),
                    vocab_size=tiny.spec.vocab_size, seed=0)


def replay(tiny: LoadedModel, trace: Any, factor: float) -> dict[str, Any]:
    scaled = rescale(trace, factor)
    run = run_config(tiny, scaled, "x", KNOBS)
    return saturation(run.records, run.engine["busy_s"], run.wall_s, nominal_span_s(scaled),
                      factor)


@pytest.fixture(scope="module")
def measured(tiny: LoadedModel) -> tuple[Any, dict[str, Any]]:
    """The trace and the probe's verdict: the factor that offers 70% of what it serves."""
    trace = trace_of(tiny)
    said: list[str] = []
    auto = probe_time_scale(trace, lambda t: run_config(tiny, t, "p", KNOBS), 0.7,
                            said.append)
    assert len(said) == 3 and auto["first_guess"] > 0
    return trace, auto


def test_time_scale_auto_lands_near_its_target_utilisation(
        tiny: LoadedModel, measured: tuple[Any, dict[str, Any]]) -> None:
    trace, auto = measured
    # The median of three replays, from 25% under the target to 30% over it. The probe and
    # each replay are about one second of engine time on 2 shared cores, and a replay's
    # utilisation is its busy time (which grows when the machine is slower than during the
    # probe) over a wall time fixed by the arrivals. Alone it reads 0.69-0.87 here; in CI the
    # median read 0.848 and 0.844 (two runs of the full suite), 3% under a 25% bound (0.875).
    # Above, "not saturated" holds it under 0.9 anyway; a factor off by 2x reads 0.35 or >1.
    runs = sorted((replay(tiny, trace, auto["factor"]) for _ in range(3)),
                  key=lambda r: r["utilisation"])
    got = runs[1]
    assert 0.7 * 0.75 <= got["utilisation"] <= 0.7 * 1.3, (auto, runs)
    assert not got["saturated"]


def test_three_times_capacity_is_saturated_and_a_third_is_not(
        tiny: LoadedModel, measured: tuple[Any, dict[str, Any]]) -> None:
    trace, auto = measured
    hot = replay(tiny, trace, auto["factor"] * 0.7 / 3.0)
    cold = replay(tiny, trace, auto["factor"] * 0.7 / 0.3)
    assert hot["saturated"] and not cold["saturated"], (hot, cold)
    assert hot["queue_share"] > cold["queue_share"]
    assert hot["overload"] > 1.2 and hot["suggested_time_scale"] > auto["factor"] * 0.7 / 3.0
    assert cold["utilisation"] < hot["utilisation"]


def test_the_probe_takes_whole_sessions_sent_at_once(tiny: LoadedModel) -> None:
    trace = trace_of(tiny, sessions=12)
    sample = probe_sample(trace)
    sessions = sample.sessions()
    assert 0 < len(sample.requests) <= 16
    assert all(r.arrival_s == 0.0 for r in sample.requests)
    full = trace.sessions()
    assert all(len(turns) == len(full[sid]) for sid, turns in sessions.items())
    assert nominal_span_s(rescale(trace, 3.0)) == pytest.approx(3 * nominal_span_s(trace))
    with pytest.raises(TraceError, match="target-utilisation"):
        auto_time_scale(trace, 1.0, sample, 1.5)
    # each turn's service lengthens the replay, so a slower service needs a smaller stretch
    fast = auto_time_scale(trace, 10.0, sample, 0.7)
    slow = auto_time_scale(trace, 10.0, sample, 0.7, service_s=0.5)
    assert slow["factor"] < fast["factor"]
    for auto in (fast, slow):
        demand = auto["busy_s_per_token"] * (trace.total_input_tokens + trace.total_output_tokens)
        span = span_at(trace, auto["factor"], auto["service_s"])
        assert demand / span == pytest.approx(0.7, rel=1e-6)


def split_rec(residency: str, queue: float, tier: float, compute: float,
              turn: int = 1) -> dict[str, Any]:
    return {"config": "c", "session_id": f"s{residency}{queue}{tier}", "turn": turn,
            "context_tokens": 100, "new_tokens": 20, "output_tokens": 8,
            "ttft_s": queue + tier + compute, "itl_s": 0.01, "residency": residency,
            "restored_tokens": 0, "recomputed_tokens": 0, "cached_tokens": 0,
            "restore_bytes": 0, "restore_s": 0.0, "queue_s": queue, "tier_s": tier,
            "compute_s": compute, "arrival_s": 0.0, "finish_s": 1.0}


def messages(summary: dict[str, Any], name: str) -> list[str]:
    return [f["message"] for f in summary["flags"] if f["name"] == name]


def test_the_bimodal_flag_names_the_restore_that_makes_the_difference() -> None:
    records = ([split_rec("host", 0.002, 0.610, 0.030) for _ in range(3)]
               + [split_rec("resident", 0.002, 0.0, 0.028) for _ in range(3)])
    s = summarize_config(records, {})
    [msg] = messages(s, "bimodal")
    assert "host and resident differ by 610 ms of restore" in msg, msg
    assert s["split_s"]["host"]["tier"]["p50"] == pytest.approx(0.610)


def test_a_queue_gap_in_a_saturated_run_says_so() -> None:
    records = ([split_rec("resident", 78.0, 0.0, 2.0) for _ in range(3)]
               + [split_rec("new", 0.1, 0.0, 2.2, turn=0) for _ in range(3)])
    # the run took 100 s, 2.7x the 37 s the trace lasts on an infinitely fast server
    load = saturation(records, busy_s=99.0, wall_s=100.0, span_s=37.0, time_scale=4.0)
    s = summarize_config(records, {}, load)
    [msg] = messages(s, "bimodal")
    assert "resident and new differ by 77900 ms of queue wait" in msg, msg
    assert "the run is saturated" in msg
    [sat] = messages(s, "saturated")
    assert sat.startswith("queue wait is 95% of TTFT and the engine was busy 99% of the run; "
                          "the offered load is 2.7x what this machine served; try "
                          "--time-scale 15.4"), sat


def test_a_queue_under_a_light_average_load_is_put_down_to_bursts() -> None:
    records = [split_rec("new", 3.0, 0.0, 1.0, turn=0) for _ in range(4)]
    load = saturation(records, busy_s=60.0, wall_s=100.0, span_s=95.0, time_scale=10.0)
    assert load["saturated"] and load["overload"] == pytest.approx(100 / 95)
    text = saturation_message(load)
    assert text.startswith("queue wait is 75% of TTFT although the engine was busy only 60% "
                           "of the run: the trace's arrivals come in bursts"), text
    assert "offered load" not in text  # 1.05x: not what explains the queue


def test_refused_requests_are_listed_with_a_hint_to_fit_them() -> None:
    refused = [{"request": f"r{k}/0", "reason": "the prompt has 9000 tokens but max_model_len "
                "is 2048", "prompt_tokens": 9000} for k in range(12)]
    s = summarize_config([split_rec("new", 0.1, 0.0, 1.0, turn=0)],
                         {"max_model_len": 2048}, None, refused, scale_length=0.0625)
    assert s["refused"]["count"] == 12 and len(s["refused"]["requests"]) == 10
    [msg] = messages(s, "refused")
    assert msg.startswith("12 requests refused") and "r0/0" in msg
    assert "--max-model-len" in msg and "--scale-length 0.0128" in msg


def test_bad_time_scales_are_clean_errors(tmp_path: Path, capsys: Any) -> None:
    code = main(["bench", "--model", "tiny", "--time-scale", "fast", "--out", str(tmp_path)])
    assert code == 2 and "--time-scale 'fast'" in capsys.readouterr().err
    trace = tmp_path / "burst.jsonl"  # every request at t=0: no scale changes the load
    trace.write_text("\n".join(json.dumps({"session": f"s{k}", "turn": 0, "arrival_s": 0,
                                           "input_tokens": 10, "output_tokens": 2})
                               for k in range(3)) + "\n")
    code = main(["bench", "--model", "tiny", "--trace", str(trace), "--time-scale", "auto",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "arrives at t=0" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
