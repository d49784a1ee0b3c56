"""`load_policy`: the planner, or a fixed rule to hold it against, deciding whether a prefix
found in the tier is loaded (tiny numbers, no torch: the test answers the jobs)."""

import pytest
from test_manager import BS, CHUNKS, KEYS, manager, run

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig
from kvtier.tier.books.manager import FETCHING
from kvtier.tier.keys import Medium
from kvtier.tier.load_policy import GPU_SHARE_CHARGE, Ahead, Decline, LoadPolicy, LoadRule
from kvtier.tier.planner import Calibration, Planner

FAST_CAL = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)
SLOW_LINK = Calibration(link_gbps=1e-9, transfer_overhead_s=0.0, prefill_tokens_per_s=1e9)


def stored(policy: str, calibration: Calibration | None = None, slots: int = 8):
    """A manager under `policy` whose host holds blocks 0-3."""
    m = manager(slots=slots, load_policy=policy,
                **({"calibration": calibration} if calibration else {}))
    m.store([1, 2, 3, 4], KEYS[:4], CHUNKS[:4])
    run(m)
    return m


@pytest.mark.parametrize(("text", "policy"), [
    ("auto", LoadPolicy()), ("always", LoadPolicy(LoadRule.ALWAYS)),
    (" Never ", LoadPolicy(LoadRule.NEVER)),
    ("threshold:1024:8", LoadPolicy(LoadRule.THRESHOLD, 1024, 8))])
def test_the_policies_parse(text: str, policy: LoadPolicy) -> None:
    assert LoadPolicy.parse(text) == policy


@pytest.mark.parametrize(("text", "message"), [
    ("sometimes", "is not one of auto"), ("threshold", "two whole numbers"),
    ("threshold:1k:8", "two whole numbers"), ("threshold:-1:8", "TOKENS must be >= 0"),
    ("threshold:1024:0", "INFLIGHT >= 1"), ("always:3", "takes no arguments"),
    (7, "is not a string")])
def test_a_bad_policy_is_a_clear_error(text, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LoadPolicy.parse(text)
    with pytest.raises(ConfigError):
        TierConfig.of(kv_offloading_size=1, load_policy=text).validate()


def test_always_restores_what_the_planner_would_recompute_and_never_the_reverse() -> None:
    # a link so slow the planner recomputes: "always" restores anyway; with a fast link the
    # planner restores: "never" recomputes, counted as declined
    m = stored("always", SLOW_LINK)
    assert m.match("r", KEYS[:4], CHUNKS[:4]).load_keys == tuple(KEYS[:4])
    assert stored("auto", SLOW_LINK).match("r", KEYS[:4], CHUNKS[:4]).load_keys == ()
    never = stored("never").match("r", KEYS[:4], CHUNKS[:4])
    assert never.load_keys == () and never.declined_tokens == 4 * BS
    assert never.decision is not None and never.decision.choice == "recompute"


def test_threshold_loads_long_prefixes_while_few_loads_are_in_flight() -> None:
    # threshold:8:1 -> a 4-token prefix is recomputed; an 8-token one is loaded; a second
    # one while that load is in flight is recomputed; once it lands, loaded again
    m = stored("threshold:8:1")
    assert m.match("short", KEYS[:1], CHUNKS[:1]).load_keys == ()
    first = m.match("a", KEYS[:2], CHUNKS[:2])
    assert first.load_keys == tuple(KEYS[:2])
    m.allocated("a", first, [5, 6])
    assert m.loads_in_flight == 1
    assert m.match("b", KEYS[:3], CHUNKS[:3]).load_keys == ()
    run(m)  # a's load lands
    assert m.loads_in_flight == 0
    assert m.match("c", KEYS[:3], CHUNKS[:3]).load_keys == tuple(KEYS[:3])


def test_the_policy_decides_fetches_below_host_too() -> None:
    # blocks on disk only: "never" starts no fetch; "always" does
    for policy, fetches in (("never", False), ("always", True)):
        m = manager(below=True, slots=4, load_policy=policy)
        m.store([1, 2], KEYS[:2], CHUNKS[:2])
        run(m)
        run(m)  # the writes down land
        m.host.remove(KEYS[:2])
        got = m.match("r", KEYS[:2], CHUNKS[:2])
        assert (got is FETCHING) == fetches
        jobs = m.take_jobs()
        assert bool(jobs) == fetches and all(j.src is Medium.DISK for j in jobs)


def test_the_planner_charges_loads_already_in_flight_to_the_next_restore() -> None:
    # a link of 80 KB/s, prefill 200 tokens/s: 2 blocks restore in 25 ms against 40 ms of
    # recompute (charged 60 ms) -> restored alone; behind a 4-block load still in flight
    # (50 ms ahead) the same restore would end at 75 ms -> recomputed; once that load
    # landed, restored again
    link = Calibration(link_gbps=8e-5, transfer_overhead_s=0.0, prefill_tokens_per_s=200.0)
    m = stored("auto", link)
    m.store([5, 6, 7, 8], KEYS[4:8], CHUNKS[4:8])
    run(m)
    a = m.match("a", KEYS[:4], CHUNKS[:4])
    assert a.load_keys == tuple(KEYS[:4])
    m.allocated("a", a, [11, 12, 13, 14])
    behind = m.match("b", KEYS[4:6], CHUNKS[4:6])
    assert behind.load_keys == () and behind.declined_by == ((Decline.INFLIGHT, 2 * BS),)
    assert behind.decision.restore_s == pytest.approx(0.075)
    assert behind.decision.recompute_s == pytest.approx(0.04)  # the prediction, uncharged
    run(m)  # a's load lands
    assert m.match("c", KEYS[4:6], CHUNKS[4:6]).load_keys == tuple(KEYS[4:6])


def test_a_fetch_is_charged_the_fetches_queued_ahead_on_its_tier() -> None:
    # disk at 60 KB/s, prefill 100 tokens/s: a 1-block fetch (17 ms + the link) beats 40 ms
    # of recompute (charged 60 ms) alone, not behind a 4-block fetch from the same disk
    # (67 ms ahead)
    m = manager(below=True, slots=8,
                calibration=Calibration(link_gbps=10.0, transfer_overhead_s=0.0,
                                        prefill_tokens_per_s=100.0))
    m.planner.calibration.tier_gbps["disk"] = 6e-5
    m.store([1, 2, 3, 4, 5], KEYS[:5], CHUNKS[:5])
    run(m)
    run(m)  # the writes down land
    m.host.remove(KEYS[:5])
    assert m.match("a", KEYS[:4], CHUNKS[:4]) is FETCHING  # 67 ms of disk vs 160 ms
    decided = m.match("b", KEYS[4:5], CHUNKS[4:5])
    assert decided is not FETCHING and decided.declined_by == ((Decline.QUEUE, BS),)


def test_prefill_waiting_for_compute_makes_a_slower_link_worth_its_wait() -> None:
    # a link of 40 KB/s, prefill 200 tokens/s: one block restores in 25 ms against 20 ms of
    # recompute -> declined as slower; with 4 prompt tokens admitted before it and not yet
    # computed (20 ms), the recompute has the prefix only at 40 ms -> restored
    link = Calibration(link_gbps=4e-5, transfer_overhead_s=0.0, prefill_tokens_per_s=200.0)
    m = stored("auto", link)
    alone = m.match("a", KEYS[:1], CHUNKS[:1])
    assert alone.declined_by == ((Decline.SLOWER, BS),)
    behind = m.match("b", KEYS[:1], CHUNKS[:1], compute_ahead=4)
    assert behind.load_keys == (KEYS[0],)
    assert behind.decision.recompute_s == pytest.approx(0.04)


def test_the_loads_in_flight_are_bounded_by_what_the_link_finishes_within_the_horizon() -> None:
    # 14.9 ms a load (its overhead), one block recomputes in 40 ms, charged 60 ms: the link
    # finishes 4 such loads within that horizon, so with 3 in flight a fourth is taken and a
    # fifth declined, though each alone (15 ms + the bytes) beats its recompute; once one
    # lands, taken again
    cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0149, prefill_tokens_per_s=100.0)
    m = stored("auto", cal, slots=8)
    for i in range(4):
        got = m.match(f"r{i}", KEYS[i:i + 1], CHUNKS[i:i + 1])
        assert got.load_keys == (KEYS[i],), i
        m.allocated(f"r{i}", got, [20 + i])
    assert m.loads_in_flight == 4
    over = m.match("r4", KEYS[:1], CHUNKS[:1])
    assert over.load_keys == () and over.declined_by == ((Decline.INFLIGHT, BS),)
    assert over.decision.restore_s < over.decision.recompute_s  # alone it was worth it
    run(m)
    assert m.match("r5", KEYS[:1], CHUNKS[:1]).load_keys == (KEYS[0],)


def test_the_bound_counts_bytes_as_well_as_loads() -> None:
    # 100 bytes a millisecond, prefill 100 tokens/s: a 4-token block (1000 bytes) is 10 ms of
    # link against 40 ms of recompute, charged 60 ms; 4999 bytes ahead let it land in time,
    # 5000 do not
    planner = Planner(Calibration(link_gbps=1e-4, transfer_overhead_s=0.0,
                                  prefill_tokens_per_s=100.0))
    policy = LoadPolicy()
    _, fits = policy.decide(planner, 4, 1000, Ahead(loads=1, link_bytes=4999))
    _, over = policy.decide(planner, 4, 1000, Ahead(loads=1, link_bytes=5000))
    assert fits is None and over is Decline.INFLIGHT


def test_auto_charges_a_recompute_for_the_compute_every_other_request_loses_to_it() -> None:
    # prefill 100 tokens/s: 4 tokens recompute in 40 ms; at 100 KB/s a 1000-byte block
    # restores in 10 ms. Behind 4500 bytes of loads it lands at 55 ms, after the recompute
    # would be ready, but within the recompute charged half again (60 ms) for the compute
    # the others lose to it: restored
    planner = Planner(Calibration(link_gbps=1e-4, transfer_overhead_s=0.0,
                                  prefill_tokens_per_s=100.0))
    assert GPU_SHARE_CHARGE == 0.5
    taken, why = LoadPolicy().decide(planner, 4, 1000, Ahead(loads=1, link_bytes=4500))
    assert why is None and taken.choice == "restore"
    assert taken.restore_s == pytest.approx(0.055)
    assert taken.recompute_s == pytest.approx(0.04)  # the prediction scored, uncharged


def test_a_restore_slower_than_its_recompute_alone_is_not_charged_others_compute() -> None:
    # the same 40 ms recompute: a 5000-byte restore (50 ms) is within 60 ms, but alone it
    # loses to the recompute, so it is declined as slower: never slower than recomputing
    planner = Planner(Calibration(link_gbps=1e-4, transfer_overhead_s=0.0,
                                  prefill_tokens_per_s=100.0))
    decision, why = LoadPolicy().decide(planner, 4, 5000)
    assert why is Decline.SLOWER and decision.choice == "recompute"


@pytest.mark.parametrize(("policy", "reason"), [
    ("never", Decline.POLICY), ("threshold:100:8", Decline.POLICY), ("auto", None)])
def test_a_fixed_rule_declines_as_policy(policy: str, reason: Decline | None) -> None:
    decision, got = LoadPolicy.parse(policy).decide(Planner(FAST_CAL), 8, 2000)
    assert got is reason
    assert decision.choice == ("restore" if reason is None else "recompute")


def test_declines_are_counted_once_per_request_when_it_is_admitted() -> None:
    # vLLM asks again while a request waits: three lookups, one admission, one count; the
    # tokens past a fetch's deadline and the planner's own decline both name their reason
    m = stored("never")
    for _ in range(3):
        got = m.match("r", KEYS[:4], CHUNKS[:4])
    assert m.report().declined == {}
    m.allocated("r", got, [])
    assert m.report().declined == {"policy": 1}
    m.allocated("r", got, [])  # a request admitted again (after a preemption) counts again
    assert m.report().declined == {"policy": 2}
