"""`FetchUp.plan`: the whole verdict on a prefix found after the device's, in one call (how
many blocks come up from which tier, load or recompute, and why), from tiny numbers."""

from test_manager import BS, NBYTES, manager

from kvtier.tier.keys import Medium
from kvtier.tier.load_policy import Ahead, Decline
from kvtier.tier.planner import Calibration

# prefill 100 tokens/s: a block (BS tokens) recomputes in BS / 100 s; the link is fast
CAL = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)
NOTHING_AHEAD = lambda via: Ahead()  # noqa: E731


def plan_for(disk_gbps: float, host: int, below: list[Medium], preempted: bool = False,
             **knobs):
    m = manager(below=True, slots=8, calibration=CAL, **knobs)
    m.planner.calibration.tier_gbps["disk"] = disk_gbps
    return m.fetch_up.plan(host, host * BS, below, NOTHING_AHEAD, preempted)


def test_what_lies_below_comes_up_first_when_reading_it_beats_recomputing_it() -> None:
    plan = plan_for(10.0, host=2, below=[Medium.DISK] * 3)
    assert (plan.fetch, plan.via, plan.declined) == (3, Medium.DISK, ())
    assert not plan.load and plan.decision is None  # the request asks again after the fetch


def test_a_fetch_slower_than_its_recompute_is_declined_and_the_host_blocks_still_load() -> None:
    # the disk reads a block a second: a 1.5 s deadline leaves one block to ask for, and
    # even that one reads far slower than its prefill (40 ms)
    plan = plan_for(1e-6, host=2, below=[Medium.DISK] * 3, fetch_deadline_s=1.5)
    assert plan.fetch == 0
    assert plan.declined == ((Decline.DEADLINE, 2 * BS), (Decline.SLOWER, BS))
    assert plan.load and plan.load_declined is None
    assert plan.decision is not None and plan.decision.nbytes == 2 * NBYTES


def test_the_deadline_caps_the_fetch_and_names_the_rest() -> None:
    # a disk that brings up a block in 10 ms (its recompute: 40 ms) and a 15 ms deadline:
    # one block comes up, the other three are recomputed as past the deadline
    rate = NBYTES / 0.01 / 1e9
    plan = plan_for(rate, host=0, below=[Medium.DISK] * 4, fetch_deadline_s=0.015)
    assert plan.fetch == 1 and plan.declined == ((Decline.DEADLINE, 3 * BS),)


def test_nothing_found_below_leaves_the_host_verdict_alone() -> None:
    plan = plan_for(10.0, host=3, below=[])
    assert plan.fetch == 0 and plan.declined == () and plan.load
    nothing = plan_for(10.0, host=0, below=[])
    assert nothing == type(nothing)()  # no fetch, no load, no decision


def test_a_preempted_requests_own_state_is_swapped_in_as_judged() -> None:
    plan = plan_for(10.0, host=2, below=[], preempted=True)
    assert plan.load and plan.decision is not None and plan.decision.choice == "restore"


def test_never_declines_the_fetch_and_the_load_by_policy() -> None:
    plan = plan_for(10.0, host=2, below=[Medium.DISK] * 2, load_policy="never")
    assert plan.fetch == 0 and plan.declined == ((Decline.POLICY, 2 * BS),)
    assert not plan.load and plan.load_declined is Decline.POLICY
