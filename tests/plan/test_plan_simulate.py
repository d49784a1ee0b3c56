"""The discrete-event replay: idle gaps demote sessions, a busy link delays wakes."""

from dataclasses import dataclass

import pytest

from kvtier.errors import ConfigError
from kvtier.plan.hardware import HARDWARE
from kvtier.plan.models import MODELS
from kvtier.plan.simulate import simulate

MODEL = MODELS["llama-3.1-8b"]
H100 = HARDWARE["h100-sxm"]


@dataclass(frozen=True)
class Turn:
    session_id: str
    turn: int
    arrival_s: float
    new_tokens: tuple[int, ...]
    output_tokens: int


def trace(think_s: list[float] | float, sessions: int = 4, turns: int = 3,
          start_gap_s: float = 1.0, prompt: int = 4000) -> list[Turn]:
    """Session i starts at i * start_gap_s with `prompt` tokens, then 200-token follow-ups."""
    thinks = think_s if isinstance(think_s, list) else [think_s] * sessions
    return [Turn(f"s{i}", k, i * start_gap_s if k == 0 else thinks[i],
                 (1,) * (prompt if k == 0 else 200), 100)
            for i in range(sessions) for k in range(turns)]


def test_long_think_times_wake_from_host_and_back_to_back_never_does() -> None:
    # device holds 2 sessions; 4 sessions that idle 60 s between turns evict one another
    idle = simulate(trace(60.0), MODEL, H100, device_sessions=2)
    assert idle.ttft["host"]["count"] == 8 and idle.restores == 8
    assert idle.ttft["new"]["count"] == 4 and idle.ttft["resident"]["count"] == 0
    # no think time: every follow-up finds its session still on the device
    busy = simulate(trace(0.0), MODEL, H100, device_sessions=2)
    assert busy.ttft["host"]["count"] == 0 and busy.restores == 0
    assert busy.ttft["resident"]["count"] == 8
    # a host wake pays the link; a resident turn prefills 200 tokens only
    assert idle.ttft["host"]["p50"] > busy.ttft["resident"]["p50"]


def test_link_contention_raises_host_ttft() -> None:
    # 32k-token sessions (4.3 GB, ~86 ms on the link); find when each first turn ends, then
    # wake all of them at the same instant (contended) or 10 s apart (spread)
    def sessions(think: list[float] | float, turns: int) -> list[Turn]:
        return trace(think, sessions=6, turns=turns, start_gap_s=5.0, prompt=32000)

    base = simulate(sessions(0.0, 1), MODEL, H100)
    finish = {r.session_id: r.finish_s for r in base.records}
    aligned = [200.0 - finish[f"s{i}"] for i in range(6)]
    spread = [200.0 + 10 * i - finish[f"s{i}"] for i in range(6)]
    contended = simulate(sessions(aligned, 2), MODEL, H100, device_sessions=1)
    calm = simulate(sessions(spread, 2), MODEL, H100, device_sessions=1)
    assert contended.ttft["host"]["count"] == calm.ttft["host"]["count"] == 6
    assert contended.ttft["host"]["p99"] > 2 * calm.ttft["host"]["p99"]
    assert max(r.link_wait_s for r in contended.records) > 0.3


def test_deterministic_and_classes_when_the_host_tier_is_too_small() -> None:
    a = simulate(trace(30.0, sessions=5), MODEL, H100, device_sessions=2)
    b = simulate(trace(30.0, sessions=5), MODEL, H100, device_sessions=2)
    assert a == b
    tiny_host = H100.with_overrides(host_gib=1.0)  # 1/8 GiB per replica: nothing fits
    c = simulate(trace(30.0, sessions=5), MODEL, tiny_host, device_sessions=2)
    assert c.ttft["host"]["count"] == 0 and c.ttft["recomputed"]["count"] > 0
    assert c.ttft["recomputed"]["p50"] > a.ttft["host"]["p50"]
    forced = simulate(trace(30.0, sessions=5), MODEL, H100, device_sessions=2, mode="recompute")
    assert forced.ttft["host"]["count"] == 0 and forced.ttft["recomputed"]["count"] > 0
    with pytest.raises(ConfigError, match="device_sessions=0"):
        simulate(trace(1.0), MODEL, H100, device_sessions=0)


def test_shared_compute_makes_a_short_prefill_wait_for_and_share_decode_steps() -> None:
    # the same trace on a CPU-like machine (prefill and decode share one resource): every
    # turn costs at least one weight stream, and turns that arrive while other sessions
    # decode wait for, and share, their steps
    cpu = H100.with_overrides(shared_compute=True)
    alone = simulate(trace(0.05, sessions=1), MODEL, cpu, device_sessions=4)
    crowded = simulate(trace(0.05, sessions=4, start_gap_s=0.0), MODEL, cpu,
                       device_sessions=4)
    floor = MODEL.weights_bytes / (H100.hbm_gbps * 1e9)
    assert all(r.ttft_s >= floor for r in alone.records)
    assert crowded.ttft["resident"]["p50"] > alone.ttft["resident"]["p50"]
    assert len(crowded.records) == 12  # every turn still finishes
