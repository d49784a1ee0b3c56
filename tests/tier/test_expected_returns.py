"""Expect-return hints stay cheap and fair on a shared server: one tenant's flood of hints
cannot push out another's, a new hint costs a heap push however many are kept, and a step
checks a bounded number of due ones."""

from __future__ import annotations

import pytest

import kvtier.tier.books.returns as returns_module
from kvtier.tier.books.returns import ExpectedReturns
from kvtier.tier.books.tenancy import Grant, Refusal
from kvtier.tier.match import Prefetch


def hint(returns: ExpectedReturns, i: int, tenant: str, after_s: float = 60.0) -> Grant:
    return returns.expect(f"r{tenant}{i}", [i.to_bytes(16, "little")], [(i,)], after_s, 0.0,
                          tenant)


def test_one_tenants_flood_of_hints_is_refused_full_and_anothers_are_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, past 10,000 hints the soonest-due were kept: a flood of soon hints dropped
    another tenant's (and each new one re-selected all of them, 41-70 ms)."""
    monkeypatch.setattr(returns_module, "MAX_PENDING_PER_TENANT", 50)
    monkeypatch.setattr(returns_module, "MAX_PENDING", 80)
    returns = ExpectedReturns()
    assert hint(returns, 0, "victim", after_s=3600.0).refused is None
    answers = [hint(returns, i, "mallory", after_s=5.0) for i in range(200)]
    assert sum(a.refused is None for a in answers) == 50
    assert {a.refused for a in answers[50:]} == {Refusal.FULL}
    assert len(returns) == 51  # the victim's hint is still watched
    for i in range(29):  # others fill what is left of the global cap
        assert hint(returns, i, f"t{i}").refused is None
    assert hint(returns, 99, "late").refused is Refusal.FULL


def test_a_step_checks_a_bounded_number_of_due_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 due hints made 10,000 prefetch calls in one step; now a step takes at most
    MAX_CHECKS_PER_STEP, in due order, and the rest wait a step."""
    monkeypatch.setattr(returns_module, "MAX_PENDING_PER_TENANT", 10_000)
    returns = ExpectedReturns()
    for i in range(500):
        hint(returns, i, "t", after_s=2.0)
    calls: list[tuple[str, str]] = []

    def prefetch(fetch_id: str, keys: object, chunks: object, tenant: str) -> Prefetch:
        calls.append((fetch_id, tenant))
        return Prefetch()
    returns.stage(10.0, prefetch)
    assert len(calls) == returns_module.MAX_CHECKS_PER_STEP
    assert {t for _, t in calls} == {"t"}  # each staging is its tenant's prefetch
    returns.stage(10.0, prefetch)
    assert len(calls) == 2 * returns_module.MAX_CHECKS_PER_STEP


def test_a_hint_whose_watch_ends_frees_its_tenants_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(returns_module, "MAX_PENDING_PER_TENANT", 1)
    returns = ExpectedReturns()
    assert hint(returns, 0, "t", after_s=1.0).refused is None
    assert hint(returns, 1, "t", after_s=1.0).refused is Refusal.FULL
    returns.stage(1000.0, lambda *args: Prefetch())  # long past the return: watched no more
    assert len(returns) == 0
    assert hint(returns, 2, "t", after_s=1.0).refused is None
