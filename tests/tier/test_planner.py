"""The restore-vs-recompute arithmetic against hand-computed cases."""

import pytest

from kvtier.tier.planner import Calibration, Planner


def seed_planner() -> Planner:
    # the seed's 70B example: 80 layers, 8 KV heads, head dim 128, fp16 -> 327,680 B/token;
    # 25 GB/s PCIe Gen4 x16; ~8,000 tokens/s of prefill
    return Planner(Calibration(link_gbps=25.0, transfer_overhead_s=0.0,
                               prefill_tokens_per_s=8000.0))


def test_seed_arithmetic_8000_tokens_on_a_70b_model() -> None:
    p = seed_planner()
    nbytes = 8000 * 2 * 80 * 8 * 128 * 2  # 2.62 GB
    assert nbytes == 2_621_440_000
    d = p.decide(8000, nbytes)
    assert d.restore_s == pytest.approx(0.1048576)  # ~100 ms
    assert d.recompute_s == pytest.approx(1.0)  # about a second
    assert d.choice == "restore"


def test_small_gqa_model_on_a_busy_link_flips_to_recompute() -> None:
    # 0.5 GB/s effective link (saturated), 20,000 tokens/s prefill, 40 KiB/token
    p = Planner(Calibration(link_gbps=0.5, transfer_overhead_s=0.002,
                            prefill_tokens_per_s=20000.0))
    d = p.decide(1000, 1000 * 40960)
    assert d.restore_s == pytest.approx(1000 * 40960 / 0.5e9 + 0.002)
    assert d.choice == "recompute"
    assert p.crossover_tokens(40960) is None  # the link never wins at this speed


def test_crossover_and_forced_modes() -> None:
    # 10 GB/s, 1 ms overhead, 1,000 tokens/s, 1 MB/token: gain/token = 1e-3 - 1e-4 = 9e-4 s
    p = Planner(Calibration(10.0, 0.001, 1000.0))
    assert p.crossover_tokens(1e6) == pytest.approx(0.001 / 9e-4)
    assert p.decide(1, 10**6).choice == "recompute"  # 1.1 ms restore vs 1 ms recompute
    assert p.decide(1, 10**6, mode="swap").choice == "restore"
    assert p.decide(10**6, 1, mode="recompute").choice == "recompute"


def test_online_updates_and_error_report() -> None:
    p = Planner(Calibration(10.0, 0.0, 1000.0), smoothing=0.5)
    p.observe_transfer(2 * 10**9, 0.1, predicted_s=0.2)  # 20 GB/s measured, predicted 0.2 s
    assert p.calibration.link_gbps == pytest.approx(15.0)
    p.observe_prefill(3000, 1.0, predicted_s=3.0)
    assert p.calibration.prefill_tokens_per_s == pytest.approx(2000.0)
    report = p.error_report()
    assert report["restore"]["count"] == 1
    assert report["restore"]["median_rel_error"] == pytest.approx(1.0)  # |0.2 - 0.1| / 0.1
    assert report["recompute"]["median_rel_error"] == pytest.approx(2.0)



def test_a_restore_that_waited_behind_others_is_scored_on_its_whole_wait() -> None:
    # predicted 0.2 s (0.1 s of copy behind 0.1 s of loads ahead); copied in 0.1 s, landed
    # 0.2 s after it was decided: scored exact, and the link is refined from the copy alone
    p = Planner(Calibration(10.0, 0.0, 1000.0), smoothing=0.5)
    p.observe_transfer(2 * 10**9, 0.1, predicted_s=0.2, waited_s=0.2)
    assert p.error_report()["restore"]["median_rel_error"] == pytest.approx(0.0)
    assert p.calibration.link_gbps == pytest.approx(15.0)
