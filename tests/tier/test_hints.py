"""One hint type for every client: kvtier serve's fields and vLLM's kv_transfer_params both
parse into the tier's `KvHints`, and one call answers it; a value no client means is the
edge's to refuse (serve: 400) or to answer refused (vLLM)."""

from __future__ import annotations

import math

import pytest

from kvtier.integrations.kit.kv_hints import parse
from kvtier.tier import Hint, HintReply, KvHints
from kvtier.tier.books.returns import MAX_EXPECT_RETURN_S
from kvtier.tier.books.tenancy import Grant, Refusal


@pytest.mark.parametrize("bad", [-1.0, 0, math.nan, math.inf, True, "60"])
@pytest.mark.parametrize("hint", list(Hint))
def test_a_value_no_client_means_is_a_problem_naming_its_field(hint: Hint, bad: object
                                                               ) -> None:
    problem = KvHints(**{hint.value: bad}).problem()  # type: ignore[arg-type]
    assert problem is not None and problem.startswith(f"kv_{hint.value}=")


def test_good_hints_have_no_problem_and_say_what_they_ask() -> None:
    hints = KvHints("alice", retention_s=60.0)
    assert hints.problem() is None and hints.stores
    assert hints.asks(Hint.RETENTION) and not hints.asks(Hint.EXPECT_RETURN)
    assert not KvHints().stores and KvHints().problem() is None
    far = KvHints(expect_return_s=MAX_EXPECT_RETURN_S * 2).problem()
    assert far is not None and "past the longest hint kept" in far


def test_vllms_params_parse_into_the_same_type_bad_values_named_not_raised() -> None:
    assert parse({"kvtier_retention_s": 30, "other": 1}, "t") == KvHints("t", retention_s=30.0)
    hints = parse({"kvtier_retention_s": "x", "kvtier_expect_return_s": 5}, "t")
    assert hints.invalid == {Hint.RETENTION} and hints.expect_return_s == 5.0
    assert hints.asks(Hint.RETENTION) and not hints.stores  # nothing to retain for
    assert parse(None, "t") == KvHints("t") == parse(["not", "a", "map"], "t")  # type: ignore[arg-type]


def test_a_reply_carries_only_what_was_asked() -> None:
    assert HintReply().answers() == {}
    reply = HintReply(retention=Grant(seconds=60.0), expect_return=Grant(refused=Refusal.QUOTA))
    assert reply.answers() == {Hint.RETENTION: 60.0, Hint.EXPECT_RETURN: "refused:quota"}


def test_a_breakpoint_with_a_value_no_client_means_is_a_problem() -> None:
    from kvtier.tier import PrefixRetention

    assert KvHints(prefixes=(PrefixRetention(32, 60.0),)).problem() is None
    assert KvHints(prefixes=(PrefixRetention(32, 60.0),)).stores  # its blocks must go down
    for bad in (PrefixRetention(-1, 60.0), PrefixRetention(32, 0.0),
                PrefixRetention(32, math.nan)):
        problem = KvHints(prefixes=(bad,)).problem()
        assert problem is not None and "cache breakpoint" in problem


def test_an_engine_without_a_tier_answers_every_asked_hint_with_one_grant() -> None:
    from kvtier.tier import PrefixRetention

    off = Grant(refused=Refusal.DISABLED)
    hints = KvHints(retention_s=5.0, prefixes=(PrefixRetention(16, 5.0),) * 2)
    assert HintReply.every(hints, off) == HintReply(off, None, (off, off))
    assert HintReply.every(KvHints(), off) == HintReply()
