"""Tensor-parallel bookkeeping without vLLM: each rank's share of the tier (`Split`), and one
job's results from every rank combined into the one the manager applies (`RankResults`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.kit.parallel import Split
from kvtier.integrations.kit.ranks import RankResults
from kvtier.tier import Fingerprint, Result, TierConfig, configured_stores


def parallel(tp: int = 1, **sizes: int) -> SimpleNamespace:
    ones = dict.fromkeys(("pipeline_parallel_size", "prefill_context_parallel_size",
                          "decode_context_parallel_size"), 1)
    return SimpleNamespace(tensor_parallel_size=tp, **{**ones, **sizes})


def test_each_rank_takes_an_equal_share_and_its_own_disk_directory() -> None:
    config = TierConfig.of(kv_offloading_size=4.0, disk_kv_path="/var/kv", disk_kv_size=10.0)
    split = Split.of(parallel(tp=2))
    assert split.world_size == 2 and split.describe() == "tp=2"
    one = split.share(config, 1)
    assert one.kv_offloading_size == 2.0
    [disk] = configured_stores(one)
    assert (disk.knobs.size, disk.knobs.path) == (5.0, "/var/kv/rank1")
    assert Split.of(parallel(tp=1)).share(config, 0) is config  # one worker: unchanged
    with pytest.raises(ConfigError, match="rank 2 is outside a world of 2"):
        split.share(config, 2)


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "prefill_context_parallel_size",
                                  "decode_context_parallel_size"])
def test_other_splits_are_refused_by_name(name: str) -> None:
    with pytest.raises(ConfigError, match=f"does not serve {name}=2 yet"):
        Split.of(parallel(**{name: 2}))


def test_the_split_and_the_rank_change_the_namespace_but_not_the_chain() -> None:
    base = Fingerprint("w", "arch", "float32", 16, "")
    tp2 = Fingerprint("w", "arch", "float32", 16, "", parallel="tp=2")
    assert len({base.namespace(), tp2.namespace(), tp2.of_shard("rank=0").namespace(),
                tp2.of_shard("rank=1").namespace()}) == 4
    assert tp2.of_shard("rank=1").namespace("s") != tp2.namespace("s")


def ok(job: int, *blocks: bool, nbytes: int = 100, seconds: float = 0.1) -> Result:
    return Result(job, blocks, tuple("" if b else "checksum" for b in blocks), nbytes, seconds,
                  finished_at=seconds)


def test_a_job_is_applied_once_every_rank_reported_it_even_in_a_later_step() -> None:
    ranks = RankResults(2)
    assert ranks.add(0, [ok(7, True, True), ok(8, True)]) == []
    assert ranks.pending == 2
    [eight] = ranks.add(1, [ok(8, True, seconds=0.3)])
    assert (eight.job_id, eight.ok, eight.nbytes, eight.seconds) == (8, (True,), 100, 0.3)
    [seven] = ranks.add(1, [ok(7, True, True)])  # a later step: rank 1's I/O thread was slower
    assert seven.success and ranks.pending == 0


def test_a_block_failing_on_one_rank_fails_on_all_with_its_reason() -> None:
    ranks = RankResults(2)
    ranks.add(0, [ok(3, True, True, True)])
    [r] = ranks.add(1, [ok(3, True, False, True)])
    assert r.ok == (True, False, True) and r.reasons == ("", "checksum", "")
    assert not r.success


def test_one_rank_is_passed_through_and_a_rank_reporting_twice_is_an_error() -> None:
    single = RankResults(1)
    result = ok(1, True)
    assert single.add(0, [result]) == [result]
    ranks = RankResults(2)
    ranks.add(0, [ok(5, True)])
    with pytest.raises(ValueError, match="job 5: rank 0 reported it twice"):
        ranks.add(0, [ok(5, True)])
    with pytest.raises(ValueError, match="rank 3 of a world of 2"):
        ranks.add(3, [ok(6, True)])
