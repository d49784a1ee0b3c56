"""A handoff through a shared store (issue 46): a request whose prompt another engine
prefilled waits, bounded, for the blocks that engine is still writing, then fetches them;
what does not come by its deadline is recomputed and counted `deadline`; a request that
names no handoff never waits. Tiny numbers, no torch."""

from __future__ import annotations

import time

import pytest
from test_fetch_deadline import BS, CHUNKS, KEYS, NBYTES, answer

from kvtier.tier.books import manager as manager_module
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import FETCHING, TierManager, job_ids
from kvtier.tier.books.presence import SharedBooks, SharedPresence
from kvtier.tier.catalog import WAIT_SECONDS, WAITED, rows
from kvtier.tier.config import TierConfig
from kvtier.tier.handoff import Handoff, Wait
from kvtier.tier.keys import BlockKey, Medium
from kvtier.tier.load_policy import Decline
from kvtier.tier.match import Match
from kvtier.tier.planner import Calibration, Planner


@pytest.fixture(autouse=True)
def ask_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "HANDOFF_POLL_S", 0.0)


def consumer(present: set[BlockKey], prefill: float = 1.0) -> TierManager:
    """An empty host over a shared store holding `present` (another engine's writes land
    there as the test adds them); recomputing a block of 4 takes 4 s unless `prefill`."""
    ids = job_ids()
    host = HostTier(8)
    store = SharedBooks(SharedPresence(lambda keys: [k in present for k in keys]))
    cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=prefill,
                      tier_gbps={"remote": 10.0})
    return TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(cal), NBYTES,
                       BelowHost(host, [store], NBYTES, ids), ids)


def ask(m: TierManager, handoff: Handoff | None, n: int = 4, tries: int = 50
        ) -> Match | None:
    """The match once the store has answered (a presence answer may take a step)."""
    for _ in range(tries):
        found = m.match("decode", KEYS[:n], CHUNKS[:n], handoff=handoff)
        if found is not None:
            return found
        time.sleep(0.002)
    return None


def fetched_and_loaded(m: TierManager, handoff: Handoff | None) -> Match:
    found = ask(m, handoff)
    assert found is FETCHING
    answer(m)  # the fetch lands in host
    loaded = m.match("decode", KEYS[:4], CHUNKS[:4], handoff=handoff)
    assert loaded is not None
    return loaded


def test_a_decode_that_comes_before_the_prefill_wrote_waits_and_then_loads() -> None:
    present: set[BlockKey] = set()
    m = consumer(present)
    handoff = Handoff(tokens=16, wait_s=30.0)
    for _ in range(3):  # the producer has written nothing yet: ask again
        assert m.match("decode", KEYS[:4], CHUNKS[:4], handoff=handoff) is None
    present.update(KEYS[:2])  # half of it landed: still waiting for the rest
    assert ask(m, handoff, tries=5) is None
    present.update(KEYS[2:4])
    loaded = fetched_and_loaded(m, handoff)
    assert list(loaded.load_keys) == KEYS[:4] and loaded.source is Medium.REDIS
    assert loaded.restored_tokens == 16 and not loaded.declined_by
    m.allocated("decode", loaded, [0, 1, 2, 3])
    assert m.outcome("decode").waited_s > 0
    counted = {(r.family, r.labels): r.value for r in rows(m.report())}
    assert counted[WAITED, (Wait.HANDOFF,)] == 1 and counted[WAIT_SECONDS, (Wait.HANDOFF,)] > 0


def test_what_has_not_come_by_the_deadline_is_recomputed_and_counted() -> None:
    present = set(KEYS[:2])  # the producer died after two blocks
    m = consumer(present)
    handoff = Handoff(tokens=16, wait_s=0.05)
    assert ask(m, handoff, tries=3) is None  # waiting
    time.sleep(0.06)
    loaded = fetched_and_loaded(m, handoff)
    assert list(loaded.load_keys) == KEYS[:2]  # what landed whole is served
    assert dict(loaded.declined_by) == {Decline.DEADLINE: 8}
    m.allocated("decode", loaded, [0, 1])
    assert m.report().declined == {"deadline": 1} and m.report().waited == {"handoff": 1}


def test_without_a_deadline_it_waits_no_longer_than_recomputing_takes() -> None:
    m = consumer(set(), prefill=1e12)  # recomputing costs nothing: not worth a wait
    found = ask(m, Handoff(tokens=16))
    assert found is not None and not found.load_keys
    assert dict(found.declined_by) == {Decline.DEADLINE: 16}


def test_a_handoff_of_unknown_length_waits_for_every_block_asked() -> None:
    present = set(KEYS[:3])
    m = consumer(present)
    handoff = Handoff(tokens=None, wait_s=30.0)  # the router sent the decode first
    assert ask(m, handoff, tries=5) is None
    present.add(KEYS[3])
    assert list(fetched_and_loaded(m, handoff).load_keys) == KEYS[:4]


def test_a_handoff_counts_from_the_blocks_the_engine_holds() -> None:
    assert Handoff(tokens=16).after(8) == Handoff(tokens=8)
    assert Handoff(tokens=None, wait_s=1.0).after(8) == Handoff(None, 1.0)
    assert Handoff(tokens=6).blocks(4, BS) == 1 and Handoff().blocks(4, BS) == 4


def test_a_request_that_names_no_handoff_never_waits_for_the_store() -> None:
    m = consumer(set())
    found = ask(m, None)
    assert found is not None and not found.load_keys and not found.declined_by
    assert m.report().waited == {}


def test_an_aborted_wait_is_counted_when_the_request_goes() -> None:
    m = consumer(set())
    assert ask(m, Handoff(tokens=16, wait_s=30.0), tries=3) is None
    m.finished("decode")
    assert m.report().waited == {"handoff": 1}
