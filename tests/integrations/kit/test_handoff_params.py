"""A P/D router's fields (`kit/handoff.py`): what a decode expects, what a prefill answers,
and a value no client means answered rather than raised; and vLLM's kv_role honoured by the
connector's scheduler half (a producer never loads, a consumer never stores)."""

from __future__ import annotations

import pytest

from kvtier.integrations.kit.handoff import expected, handed, invalid
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.tier import Fingerprint, Handoff, Job, Result, TierConfig
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.planner import Calibration, Planner

BS = 4


def test_a_decode_expects_what_its_prefill_handed_off_and_waits_its_own_bound() -> None:
    sent = {"do_remote_prefill": True, "kvtier_handoff_tokens": 896}
    assert expected(sent, None) == Handoff(896, None)
    assert expected(sent, 3.0) == Handoff(896, 3.0)  # the connector's kv_handoff_wait_s
    assert expected({**sent, "kvtier_handoff_wait_s": 0.5}, 3.0) == Handoff(896, 0.5)
    # sent before the prefill answered: every full block it asks for
    assert expected({"do_remote_prefill": True}, None) == Handoff(None, None)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False},
                                    {"do_remote_prefill": "yes"}, {"kvtier_handoff_tokens": 8},
                                    ["do_remote_prefill"]])
def test_a_request_that_is_not_a_decode_expects_nothing(params: object) -> None:
    assert expected(params, 1.0) is None  # type: ignore[arg-type]
    assert invalid(params) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [-1, "896", 1.5, True, None])
def test_a_count_no_client_means_is_named_and_the_decode_waits_for_every_block(
        tokens: object) -> None:
    sent = {"do_remote_prefill": True, "kvtier_handoff_tokens": tokens,
            "kvtier_handoff_wait_s": -2}
    assert expected(sent, 1.0) == Handoff(None, 1.0)
    assert invalid(sent) == ["kvtier_handoff_tokens", "kvtier_handoff_wait_s"]


def test_a_prefill_answers_its_handoff_and_says_so_where_no_store_is_shared() -> None:
    ask = {"do_remote_decode": True}
    assert handed(ask, 896, shared=True) == {"do_remote_prefill": True,
                                             "do_remote_decode": False,
                                             "kvtier_handoff_tokens": 896}
    assert handed(ask, 896, shared=False) == {"do_remote_prefill": False,
                                              "do_remote_decode": False,
                                              "kvtier_handoff_tokens": 0}
    assert handed(None, 1024, shared=True) == {"kvtier_handoff_tokens": 1024}
    assert handed(None, 1024, shared=False) == {}


def roled(loads: bool, stores: bool, manager: TierManager | None = None) -> SchedulerSide:
    if manager is None:
        host, ids = HostTier(8), job_ids()
        cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)
        manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(cal),
                              1000, BelowHost(host, [], 1000, ids), ids)
    namespace = Fingerprint("w", "arch", "bf16", BS, "").namespace
    return SchedulerSide(manager, BS, namespace, loads=loads, stores=stores)


def finish_jobs(s: SchedulerSide, jobs: list[Job]) -> None:
    s.apply([Result.whole(j.id, j.num_blocks, True, 1000 * j.num_blocks, 1e-4) for j in jobs])


def test_a_producer_stores_and_never_loads_a_consumer_loads_and_never_stores() -> None:
    prompt = list(range(10, 24))  # 3 full blocks
    producer = roled(loads=False, stores=True)
    assert producer.matched_tokens("p", prompt, "", 0) == 0
    producer.allocated("p", [[1, 2, 3, 4]], 0)
    stores = producer.step([Scheduled("p", [[1, 2, 3, 4]], 14)])
    assert [j.device_blocks for j in stores] == [(1, 2, 3)]
    finish_jobs(producer, stores)
    assert producer.handed_tokens("p") == 12
    producer.finished("p")
    assert producer.matched_tokens("p2", [*prompt, 1, 2], "", 0) == 0  # host has it: unused
    consumer = roled(loads=True, stores=False, manager=producer.manager)
    assert consumer.matched_tokens("c", [*prompt, 1, 2], "", 0) == 12
    consumer.allocated("c", [[5, 6, 7, 8]], 12)
    jobs = consumer.step([Scheduled("c", [[5, 6, 7, 8]], 16)])  # fills block 4: not stored
    assert [j.dst.value for j in jobs] == ["device"]
    assert consumer.handed_tokens("c") == 0
