"""A request's asks in vLLM's kv_transfer_params (retention, expect-return) through the
connector's scheduler half, with plain values (no vLLM): tenants are cache_salts, answers
come back with the request's end, and a bad value is refused, never raised."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_scheduler_side import BS, FAST, FP, finish_jobs

from kvtier.integrations.kit.counters import tier_counters
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.tier import Prefetch, TierConfig
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.books.tenancy import Quotas, Tenancy
from kvtier.tier.catalog import RETENTION_REFUSED, Label
from kvtier.tier.planner import Planner

PROMPT = list(range(10, 23))  # 13 tokens: 3 full blocks


def side(slots: int = 8, quotas: Quotas | None = None, max_s: float = 3600.0
         ) -> SchedulerSide:
    tenancy = Tenancy(quotas, max_s)
    host, ids = HostTier(slots, tenancy=tenancy), job_ids()
    manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(FAST), 1000,
                          BelowHost(host, [], 1000, ids), ids)
    return SchedulerSide(manager, BS, FP.namespace)


def finish(s: SchedulerSide, rid: str, prompt: list[int], tenant: str,
           asks: dict[str, Any] | None, land: bool = True) -> dict[str, Any]:
    """One request computed in one step and finished as vLLM does: in its last step's
    update, before that step's stores have landed (`land`: they land after)."""
    assert s.matched_tokens(rid, prompt, tenant, 0, tenant=tenant) == 0
    s.allocated(rid, [[1, 2, 3, 4]], 0)
    jobs = s.step([Scheduled(rid, [[1, 2, 3, 4]], len(prompt))])
    answers = s.answer(rid, asks)
    s.finished(rid)
    if land:
        finish_jobs(s, jobs)
    return without_usage(answers)


USAGE = ("kvtier_read_tokens", "kvtier_retention_kept", "kvtier_cache_breakpoints_kept")


def without_usage(answers: dict[str, Any]) -> dict[str, Any]:
    """The answers to the asks themselves (the usage words have a test of their own)."""
    return {k: v for k, v in answers.items() if k not in USAGE}


def test_a_retention_asked_while_the_blocks_are_still_storing_is_granted() -> None:
    s = side()
    answers = finish(s, "a", PROMPT, "victim", {"kvtier_retention_s": 60})
    assert answers == {"kvtier_retention_s": 60.0}
    tenants = s.manager.report().tenants
    assert tenants["victim"].retained["host"] == 3 and tenants["victim"].held["host"] == 3
    stats = s.take_stats()
    assert stats["retention_granted"] == {"victim": 1}
    assert "retention_granted" not in s.take_stats()  # reported once


@pytest.mark.parametrize("bad", [-5, 0, math.nan, math.inf, "60", True, None, [60]])
def test_a_bad_value_is_refused_invalid_and_nothing_is_retained(bad: object) -> None:
    s = side()
    answers = finish(s, "a", PROMPT, "t", {"kvtier_retention_s": bad,
                                          "kvtier_expect_return_s": bad})
    assert answers == {"kvtier_retention_s": "refused:invalid",
                       "kvtier_expect_return_s": "refused:invalid"}
    assert s.manager.report().tenants["t"].retained == {}
    assert len(s.manager.returns) == 0
    assert tier_counters(s.manager.report())[RETENTION_REFUSED, ("t", "invalid")] == 1


def test_refusals_come_from_the_tier_with_their_reason_and_are_counted() -> None:
    s = side(quotas=Quotas(named={"capped": {"host": 2}}))
    assert finish(s, "a", PROMPT, "capped", {"kvtier_retention_s": 60}) == {
        "kvtier_retention_s": "refused:quota"}
    assert finish(s, "b", [1, *PROMPT], "t", {"kvtier_retention_s": 1e9}) == {
        "kvtier_retention_s": "refused:over_max"}
    assert finish(s, "c", PROMPT[:3], "t", {"kvtier_retention_s": 60}) == {
        "kvtier_retention_s": "refused:not_stored"}  # no full block
    counters = tier_counters(s.manager.report())
    assert counters[RETENTION_REFUSED, ("capped", "quota")] == 1
    assert counters[RETENTION_REFUSED, ("t", "over_max")] == 1
    assert counters[RETENTION_REFUSED, ("t", "not_stored")] == 1
    assert finish(s, "d", [2, *PROMPT], "", None) == {}  # no asks: no answers


def test_no_tenant_counts_as_default_and_tenant_labels_are_bounded() -> None:
    s = side(slots=16)
    s.manager.config = TierConfig.of(kv_offloading_size=1, kv_tenant_labels=1)
    finish(s, "a", PROMPT, "", None)
    finish(s, "b", [1, *PROMPT], "x|y", None)
    finish(s, "c", [2, *PROMPT], "z", None)
    labels = {values[0] for family, values in tier_counters(s.manager.report())
              if Label.TENANT in family.labels}
    assert len(s.manager.report().tenants) == 2 and labels <= {"default", "x|y", "z", "other"}


def test_an_expect_return_hint_is_watched_until_the_return_then_forgotten() -> None:
    s = side()
    answers = finish(s, "a", PROMPT, "t", {"kvtier_expect_return_s": 0.02})
    assert answers == {"kvtier_expect_return_s": 0.02} and len(s.manager.returns) == 1
    assert finish(s, "b", [1, *PROMPT], "t", {"kvtier_expect_return_s": 1e6}) == {
        "kvtier_expect_return_s": "refused:over_max"}
    time.sleep(0.02)
    s.step([])  # due: on host already, so nothing to fetch and nothing left behind
    assert not s.manager.returns.staging and not s.busy
    time.sleep(0.03)  # past the return (and its grace): no longer watched
    s.step([])
    assert len(s.manager.returns) == 0


def test_a_session_back_while_its_staging_is_in_flight_asks_again_after_it_lands() -> None:
    s = side()
    finish(s, "a", PROMPT, "t", {"kvtier_expect_return_s": 0.02})
    s.manager.prefetch = lambda *_: Prefetch(fetching_blocks=3)  # as if it were on disk
    time.sleep(0.02)
    s.step([])
    assert set(s.manager.returns.staging) == {"expect-a"}
    assert s.matched_tokens("b", [*PROMPT, 1], "t", 0, tenant="t") is None
    assert s.manager.returns.landed("expect-a") and not s.manager.returns.staging
    assert s.matched_tokens("b", [*PROMPT, 1], "t", 0, tenant="t") == 12


# -- vLLM's typed KV hints: an envelope of versioned actions (vllm.v1.kv_hints) --------------


def envelope(*actions: tuple[str, str, str, Any]) -> SimpleNamespace:
    """What vLLM hands the connector as `Request.kv_hints` (msgspec structs, same fields)."""
    return SimpleNamespace(protocol_version="1", message_id="m-1", actions=[
        SimpleNamespace(action_id=i, action_type=t, action_version=v, payload=p)
        for i, t, v, p in actions])


def finish_with(s: SchedulerSide, rid: str, prompt: list[int], hints: Any,
                asks: dict[str, Any] | None = None, usage: bool = False) -> dict[str, Any]:
    assert s.matched_tokens(rid, prompt, "t", 0, tenant="t") == 0
    s.allocated(rid, [[1, 2, 3, 4, 5, 6]], 0)
    jobs = s.step([Scheduled(rid, [[1, 2, 3, 4, 5, 6]], len(prompt))])
    answers = s.answer(rid, asks, hints)
    s.finished(rid)
    finish_jobs(s, jobs)
    return answers if usage else without_usage(answers)


LONG = list(range(10, 32))  # 22 tokens: five full blocks of 4, and two tokens


def test_each_action_is_answered_accepted_clipped_deferred_or_rejected_with_its_reason(
        ) -> None:
    s = side(slots=16)
    out = finish_with(s, "a", LONG, envelope(
        ("keep", "kv.retain", "1", {"ttl_s": 600, "token_range": [0, 8]}),
        ("mid", "kv.retain", "1", {"ttl_s": 60, "token_range": [0, 14]}),
        ("all", "kv.retain", "1", {"ttl_s": 30}),
        ("back", "kv.prefetch", "1", {"after_s": 5}),
        ("pin", "kv.pin", "1", {}),
        ("v2", "kv.retain", "2", {"ttl_s": 60}),
        ("bad", "kv.retain", "1", {"ttl_s": "an hour"}),
        ("tail", "kv.retain", "1", {"ttl_s": 60, "token_range": [4, 12]}),
        ("tiny", "kv.retain", "1", {"ttl_s": 60, "token_range": [0, 3]}),
        ("again", "kv.prefetch", "1", {"after_s": 9})))
    answers = {a["action_id"]: a for a in out["kvtier_kv_hints"]["actions"]}
    assert out["kvtier_kv_hints"]["message_id"] == "m-1"
    assert answers["keep"] == {"action_id": "keep", "action_type": "kv.retain",
                               "status": "accepted", "ttl_s": 600, "tokens": 8, "blocks": 2}
    assert answers["mid"]["status"] == "clipped" and answers["mid"]["tokens"] == 12
    assert "whole blocks of 4 tokens" in answers["mid"]["reason"]
    assert answers["all"]["status"] == "clipped" and answers["all"]["tokens"] == 20
    assert answers["back"] == {"action_id": "back", "action_type": "kv.prefetch",
                               "status": "deferred", "after_s": 5}
    rejected = {k: a["reason"] for k, a in answers.items() if a["status"] == "rejected"}
    assert set(rejected) == {"pin", "v2", "bad", "tail", "tiny", "again"}
    assert "unknown action type 'kv.pin'" in rejected["pin"]
    assert "version '2'" in rejected["v2"] and "ttl_s" in rejected["bad"]
    assert "prefix" in rejected["tail"] and "no whole block" in rejected["tiny"]
    assert "asked already" in rejected["again"]
    assert "kvtier_expect_return_s" not in out  # the action asked it: answered there
    retained = s.manager.report().tenants["t"].retained["host"]
    assert retained == 5  # the longest accepted range: five blocks
    assert len(s.manager.returns) == 1


def test_a_refused_retain_says_the_tiers_reason_and_the_request_is_served() -> None:
    s = side(slots=16, max_s=100)
    out = finish_with(s, "a", LONG, envelope(("long", "kv.retain", "1", {"ttl_s": 1e6}),
                                            ("ok", "kv.retain", "1", {"ttl_s": 50})),
                      {"kvtier_retention_s": 10})
    answers = out["kvtier_kv_hints"]["actions"]
    assert [a["status"] for a in answers] == ["rejected", "clipped"]
    assert answers[0]["reason"] == "over_max"
    assert out["kvtier_retention_s"] == 10  # the params' own ask, answered beside


@pytest.mark.parametrize("hints", [None, SimpleNamespace(), "not an envelope",
                                   SimpleNamespace(actions=None),
                                   SimpleNamespace(actions=[object()])])
def test_a_missing_or_malformed_envelope_never_fails_the_request(hints: Any) -> None:
    s = side(slots=16)
    out = finish_with(s, "a", LONG, hints)
    if hints is None or not getattr(hints, "actions", None):
        assert out == {}
    else:
        [answer] = out["kvtier_kv_hints"]["actions"]
        assert answer["status"] == "rejected"


def test_cache_breakpoints_in_the_params_keep_their_prefixes_each_answered() -> None:
    s = side(slots=16)
    out = finish_with(s, "a", LONG, None, {"kvtier_cache_breakpoints": [
        [9, 600], [20, 60], [12, -1], "x", [True, 5]]})
    assert out == {"kvtier_cache_breakpoints_s": [600.0, 60.0, "refused:invalid",
                                                  "refused:invalid"]}  # four at most
    assert s.manager.report().tenants["t"].retained["host"] == 5


def test_a_request_that_asked_caching_is_told_what_it_read_and_how_far_each_grant_keeps() -> None:
    # what vllm serve's middleware turns into the APIs' usage (integrations/vllm/cache_usage)
    s = side(slots=16)
    out = finish_with(s, "a", LONG, None, {"kvtier_retention_s": 60,
                                           "kvtier_cache_breakpoints": [[9, 600], [20, 60],
                                                                        [12, -1]]}, usage=True)
    assert out["kvtier_read_tokens"] == 0  # nothing of it was cached before
    assert out["kvtier_retention_kept"] == 20  # the whole prompt's five full blocks
    assert out["kvtier_cache_breakpoints_kept"] == [8, 20, 0]  # to a block edge; refused: 0
    assert "kvtier_read_tokens" not in finish_with(s, "c", [3, *LONG], None, None, usage=True)
