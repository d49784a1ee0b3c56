"""Percentiles as the reports compute them: nearest rank."""

from kvtier.engine.stats import percentile


def test_nearest_rank_percentiles() -> None:
    assert percentile([1, 2, 3, 4, 5, 6], 50) == 3
    assert percentile(list(range(1, 11)), 90) == 9
    assert percentile([1, 2], 50) == 1
    assert percentile([5], 99) == 5 and percentile([], 50) is None
    assert percentile(list(range(1, 101)), 99) == 99
