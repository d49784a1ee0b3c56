"""The discrete-event replay: idle gaps demote sessions, a busy link delays wakes, and every
TTFT splits into queue + tier + compute."""


import pytest

from kvtier.engine.stats import percentile
from kvtier.errors import ConfigError
from kvtier.plan.analysis import HOST_USABLE_FRACTION, planner_for
from kvtier.plan.hardware import GIB, HARDWARE, Hardware
from kvtier.plan.models import MODELS
from kvtier.plan.simulate import SimConfig, SimTurn, simulate

MODEL = MODELS["llama-3.1-8b"]
H100 = HARDWARE["h100-sxm"]



def trace(think_s: list[float] | float, sessions: int = 4, turns: int = 3,
          start_gap_s: float = 1.0, prompt: int = 4000) -> list[SimTurn]:
    """Session i starts at i * start_gap_s with `prompt` tokens, then 200-token follow-ups."""
    thinks = think_s if isinstance(think_s, list) else [think_s] * sessions
    return [SimTurn(f"s{i}", k, i * start_gap_s if k == 0 else thinks[i],
                 (1,) * (prompt if k == 0 else 200), 100)
            for i in range(sessions) for k in range(turns)]


def test_long_think_times_wake_from_host_and_back_to_back_never_does() -> None:
    # device holds 2 sessions; 4 sessions that idle 60 s between turns evict one another
    idle = simulate(trace(60.0), MODEL, H100, config=SimConfig(device_sessions=2))
    assert idle.ttft["host"]["count"] == 8 and idle.restores == 8
    assert idle.ttft["new"]["count"] == 4 and idle.ttft["resident"]["count"] == 0
    # no think time: every follow-up finds its session still on the device
    busy = simulate(trace(0.0), MODEL, H100, config=SimConfig(device_sessions=2))
    assert busy.ttft["host"]["count"] == 0 and busy.restores == 0
    assert busy.ttft["resident"]["count"] == 8
    # a host wake pays the link; a resident turn prefills 200 tokens only
    assert idle.ttft["host"]["p50"] > busy.ttft["resident"]["p50"]


def test_simultaneous_wakes_raise_host_ttft() -> None:
    # 32k-token sessions (4.3 GB, ~86 ms on the link); find when each first turn ends, then
    # wake all of them at the same instant (contended) or 10 s apart (spread); with room for
    # one session on the device, the contended wakes wait for it (queue) and for the link
    def sessions(think: list[float] | float, turns: int) -> list[SimTurn]:
        return trace(think, sessions=6, turns=turns, start_gap_s=5.0, prompt=32000)

    base = simulate(sessions(0.0, 1), MODEL, H100)
    finish = {r.session_id: r.finish_s for r in base.records}
    aligned = [200.0 - finish[f"s{i}"] for i in range(6)]
    spread = [200.0 + 10 * i - finish[f"s{i}"] for i in range(6)]
    contended = simulate(sessions(aligned, 2), MODEL, H100,
                         config=SimConfig(device_sessions=1))
    calm = simulate(sessions(spread, 2), MODEL, H100, config=SimConfig(device_sessions=1))
    assert contended.ttft["host"]["count"] == calm.ttft["host"]["count"] == 6
    assert contended.ttft["host"]["p99"] > 2 * calm.ttft["host"]["p99"]
    assert max(r.link_wait_s + r.queue_s for r in contended.records) > 0.3
    assert max(r.queue_s for r in calm.records) < 0.05


def test_a_turn_waits_for_device_room_held_by_running_sessions() -> None:
    # room for one session: the second session's first turn, sent while the first decodes,
    # is admitted only when the first finishes, and that wait is its queue part
    two = trace(0.0, sessions=2, turns=1, start_gap_s=0.001, prompt=2000)
    sim = simulate(two, MODEL, H100, config=SimConfig(device_sessions=1))
    first, second = sorted(sim.records, key=lambda r: r.arrival_s)
    assert second.queue_s == pytest.approx(first.finish_s - second.arrival_s)
    assert first.queue_s == 0.0
    assert second.queue_s + second.tier_s + second.compute_s == pytest.approx(second.ttft_s)
    roomy = simulate(two, MODEL, H100, config=SimConfig(device_sessions=2))
    # what is left is the wait for the compute server (the first prefill, ~67 ms)
    assert max(r.queue_s for r in roomy.records) < second.queue_s / 5


def test_deterministic_and_classes_when_the_host_tier_is_too_small() -> None:
    a = simulate(trace(30.0, sessions=5), MODEL, H100, config=SimConfig(device_sessions=2))
    b = simulate(trace(30.0, sessions=5), MODEL, H100, config=SimConfig(device_sessions=2))
    assert a == b
    tiny_host = H100.with_overrides(host_gib=1.0)  # 1/8 GiB per replica: nothing fits
    c = simulate(trace(30.0, sessions=5), MODEL, tiny_host,
                 config=SimConfig(device_sessions=2))
    assert c.ttft["host"]["count"] == 0 and c.ttft["recomputed"]["count"] > 0
    assert c.ttft["recomputed"]["p50"] > a.ttft["host"]["p50"]
    forced = simulate(trace(30.0, sessions=5), MODEL, H100,
                      config=SimConfig(device_sessions=2, preemption_mode="recompute"))
    assert forced.ttft["host"]["count"] == 0 and forced.ttft["recomputed"]["count"] > 0
    with pytest.raises(ConfigError, match="device_sessions=0"):
        simulate(trace(1.0), MODEL, H100, config=SimConfig(device_sessions=0))


def test_shared_compute_makes_a_short_prefill_wait_for_and_share_decode_steps() -> None:
    # the same trace on a CPU-like machine (prefill and decode share one resource): every
    # turn costs at least one weight stream, and turns that arrive while other sessions
    # decode wait for, and share, their steps
    cpu = H100.with_overrides(shared_compute=True)
    alone = simulate(trace(0.05, sessions=1), MODEL, cpu, config=SimConfig(device_sessions=4))
    crowded = simulate(trace(0.05, sessions=4, start_gap_s=0.0), MODEL, cpu,
                       config=SimConfig(device_sessions=4))
    floor = MODEL.weights_bytes / (H100.hbm_gbps * 1e9)
    assert all(r.ttft_s >= floor for r in alone.records)
    assert crowded.ttft["resident"]["p50"] > alone.ttft["resident"]["p50"]
    assert len(crowded.records) == 12  # every turn still finishes


def one_session_host(hardware: Hardware, shared: bool) -> Hardware:
    """One GPU per node whose host pool holds about one 4.4k-token session."""
    per_session = 4400 * MODEL.kv_bytes_per_token("fp16")
    return hardware.with_overrides(gpus=1, host_gib=per_session / GIB / HOST_USABLE_FRACTION,
                                   shared_compute=shared or None)


@pytest.mark.parametrize("shared", [False, True])
def test_split_sums_to_ttft_for_every_class(shared: bool) -> None:
    # s0 answers back to back (resident); the others idle 60 s with room for 2 sessions on
    # the device and ~1 on the host: they wake from host or, pushed out of it, recompute
    hw = one_session_host(H100, shared)
    sim = simulate(trace([0.0, 60.0, 60.0, 60.0]), MODEL, hw, config=SimConfig(device_sessions=2))
    counts = {cls: sim.ttft[cls]["count"] for cls in ("resident", "host", "recomputed", "new")}
    assert all(n > 0 for n in counts.values()), counts
    for r in sim.records:
        assert r.queue_s + r.tier_s + r.compute_s == pytest.approx(r.ttft_s, abs=1e-12)
        assert min(r.queue_s, r.tier_s, r.compute_s) >= -1e-12
        # only a turn with prior state elsewhere spends tier time
        assert (r.tier_s > 0) == (r.residency in ("host", "recomputed")), r
    planner = planner_for(MODEL, hw, 1)
    for r in sim.records:
        if r.residency == "recomputed" and not shared:  # alone on the server, no queue
            assert r.tier_s == pytest.approx(planner.prefill_s(r.context, 0))
    host_tiers = [r.tier_s for r in sim.records if r.residency == "host"]
    assert sim.split["host"]["tier"] == {"p50": percentile(host_tiers, 50),
                                         "p90": percentile(host_tiers, 90)}
    assert sim.split["disk"]["queue"] == {"p50": None, "p90": None}
    assert 0 < sim.compute_utilisation <= 1
    assert sim.compute_busy_s == pytest.approx(sim.compute_utilisation * sim.makespan_s)
    assert set(sim.to_json()) >= {"split_s", "compute_busy_s", "compute_utilisation"}


def test_a_host_restores_tier_part_is_its_transfer_and_grows_with_context() -> None:
    # two sessions far apart, demoted long before they wake, so the link is idle then: the
    # tier part is transfer + wake overhead, proportional to the bytes
    turns = [SimTurn(f"s{i}", k, 30.0 * i if k == 0 else 60.0, (1,) * (n if k == 0 else 200), 100)
             for i, n in enumerate((4000, 32000)) for k in range(2)]
    sim = simulate(turns, MODEL, H100, config=SimConfig(idle_offload_s=5.0))
    host = {r.session_id: r for r in sim.records if r.residency == "host"}
    assert set(host) == {"s0", "s1"}
    for r in host.values():
        transfer = r.context * MODEL.kv_bytes_per_token("fp16") / (H100.link_gbps * 1e9)
        assert r.link_wait_s == 0
        assert r.tier_s == pytest.approx(transfer + H100.transfer_overhead_s)
    assert host["s1"].context > host["s0"].context
    assert host["s1"].tier_s > 5 * host["s0"].tier_s


def test_shared_mode_a_turn_arriving_during_a_step_queues_for_it() -> None:
    # a 4000-token prefill's step is running when a 200-token session arrives: it waits
    # (queue) for that step to end, then computes in the next one
    cpu = H100.with_overrides(shared_compute=True)
    turns = [SimTurn("long", 0, 0.0, (1,) * 4000, 1), SimTurn("short", 0, 0.001, (1,) * 200, 1)]
    sim = simulate(turns, MODEL, cpu)
    rec = {r.session_id: r for r in sim.records}
    assert rec["long"].queue_s == 0
    step_end = rec["long"].arrival_s + rec["long"].ttft_s
    assert rec["short"].queue_s == pytest.approx(step_end - 0.001)
    assert rec["short"].queue_s > 0 and rec["short"].tier_s == 0
    assert rec["short"].compute_s == pytest.approx(rec["short"].ttft_s - rec["short"].queue_s)


def test_idle_offload_demotes_sessions_that_think_longer_than_it() -> None:
    # the device holds everything: only idle_offload_s moves sessions to host
    keep = simulate(trace(10.0), MODEL, H100)
    assert keep.ttft["resident"]["count"] == 8 and keep.idle_demotions == 0
    demote = simulate(trace(10.0), MODEL, H100, config=SimConfig(idle_offload_s=5.0))
    assert demote.ttft["host"]["count"] == 8 and demote.restores == 8
    assert demote.idle_demotions >= 8 and demote.stores == demote.idle_demotions
    late = simulate(trace(10.0), MODEL, H100, config=SimConfig(idle_offload_s=20.0))
    assert late.ttft["resident"]["count"] == 8 and late.restores == 0
    with pytest.raises(ConfigError, match="idle_offload_s=-1"):
        simulate(trace(1.0), MODEL, H100, config=SimConfig(idle_offload_s=-1))
