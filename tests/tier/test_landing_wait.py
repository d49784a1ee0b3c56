"""The next turn before the last write landed: a request whose next blocks are still being
copied into host waits for them (asked again next step) rather than recomputing, at most
the time the planner says recomputing them takes; past that they are recomputed and
counted (`deadline`). Tiny numbers, no torch (issue 46)."""

from __future__ import annotations

from test_retained_fetch import CHUNKS, KEYS, answer, manager

from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.config import TierConfig
from kvtier.tier.load_policy import Decline
from kvtier.tier.planner import Calibration, Planner


def test_a_turn_that_comes_while_its_prefix_lands_waits_and_then_loads_it() -> None:
    m = manager()  # prefill at 1 token/s: recomputing 16 tokens would take 16 s
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4], tenant="a")  # the last turn's write
    assert m.match("next", KEYS[:4], CHUNKS[:4]) is None  # landing: ask again
    assert m.match("next", KEYS[:4], CHUNKS[:4]) is None
    answer(m)  # landed
    found = m.match("next", KEYS[:4], CHUNKS[:4])
    assert found is not None and list(found.load_keys) == KEYS[:4]
    assert found.restored_tokens == 16 and not found.declined_by


def test_a_wait_longer_than_the_recompute_is_not_taken() -> None:
    ids = job_ids()
    host = HostTier(10)
    fast = Planner(Calibration(link_gbps=10.0, transfer_overhead_s=0.0,
                               prefill_tokens_per_s=1e12))  # recomputing costs nothing
    m = TierManager(TierConfig.of(kv_offloading_size=1), 4, host, fast, 1000,
                    BelowHost(host, [], 1000, ids), ids)
    m.store([0, 1, 2, 3], KEYS[:4], CHUNKS[:4])
    assert m.match("next", KEYS[:4], CHUNKS[:4]) is None  # the first ask starts the wait
    declined = m.match("next", KEYS[:4], CHUNKS[:4])  # already past what recomputing costs
    assert declined is not None and not declined.load_keys
    assert dict(declined.declined_by) == {Decline.DEADLINE: 16}
