"""The connector's counter reports as they cross vLLM's processes: nested by the catalog's
labels, summed level by level, walked back by the catalog (nothing parsed out of a string),
and written for vLLM's log line."""

from __future__ import annotations

from kvtier.integrations.kit.counters import Reported, flat, merge, nest, unnest
from kvtier.tier.catalog import (
    DECLINED,
    LOOKUP_TOKENS,
    MISS_BLOCKS,
    RESTORED_BLOCKS,
    TENANT_EVICTIONS,
)


def test_a_report_nests_one_level_per_label_and_leaves_zeros_out() -> None:
    data = nest({(LOOKUP_TOKENS, ()): 12, (MISS_BLOCKS, ("disk", "checksum")): 1,
                 (MISS_BLOCKS, ("disk", "io")): 2, (DECLINED, ("slower",)): 0,
                 (RESTORED_BLOCKS, ("1:window=8",)): 2})
    assert data == {"lookup_tokens": 12, "miss_blocks": {"disk": {"checksum": 1, "io": 2}},
                    "restored_blocks": {"1:window=8": 2}}


def test_reports_sum_level_by_level_and_walk_back_to_their_families() -> None:
    a = nest({(MISS_BLOCKS, ("disk", "checksum")): 1, (LOOKUP_TOKENS, ()): 4})
    b = nest({(MISS_BLOCKS, ("disk", "checksum")): 2, (MISS_BLOCKS, ("remote", "io")): 1,
              (TENANT_EVICTIONS, ("a|b", "host")): 3})
    total = merge(a, b)
    assert sorted(unnest(total), key=str) == sorted([
        (LOOKUP_TOKENS, (), 4.0), (MISS_BLOCKS, ("disk", "checksum"), 3.0),
        (MISS_BLOCKS, ("remote", "io"), 1.0), (TENANT_EVICTIONS, ("a|b", "host"), 3.0)],
        key=str)  # a tenant's name is a label value as it is, "|" and all


def test_a_key_or_a_depth_the_catalog_does_not_know_is_skipped() -> None:
    # a report from another version of kvtier: nothing raises, nothing is mislabelled
    data = {"no_such_family": 3, "miss_blocks": {"disk": 5}, "declined": {"slower": {"x": 1}},
            "lookup_tokens": {"a": 1}, "restored_tokens": 7}
    assert [(f.vllm, labels, n) for f, labels, n in unnest(data)] == [
        ("restored_tokens", (), 7.0)]


def test_the_log_line_names_each_label() -> None:
    data = nest({(MISS_BLOCKS, ("disk", "checksum")): 1, (LOOKUP_TOKENS, ()): 0.1234567})
    assert flat(data) == {"miss_blocks{tier=disk,reason=checksum}": 1,
                          "lookup_tokens": 0.123457}


def test_only_what_grew_is_reported_again() -> None:
    reported = Reported()
    key = (MISS_BLOCKS, ("disk", "checksum"))
    assert reported.take({key: 2}) == {key: 2}
    assert reported.take({key: 2}) == {}
    assert reported.take({key: 1}) == {}  # shrank (a tenant moved to "other"): nothing
    assert reported.take({key: 5}) == {key: 3}
