"""Scheduler scenarios with tiny numbers: chunked prefill, prefix hits, preemption, no loss."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.cache.block_pool import BlockPool
from kvtier.config import OffloadPolicy, SchedulerConfig
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.tier_client import NullTier
from kvtier.sequence import SamplingParams, Sequence

NS = b"\x00" * 16


def make(num_blocks: int, block_size: int = 4, **cfg: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockPool(num_blocks), block_size,
                     NullTier(OffloadPolicy()))


def seq(rid: str, n: int, max_tokens: int = 4, first: int = 0) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token: int = 7) -> tuple[dict[str, int], list[Sequence]]:
    """Schedule, pretend the model sampled `token` for each sampling chunk, finish at max."""
    out = s.schedule()
    sampled = {c.seq.request_id: token for c in out.scheduled if c.samples}
    s.update(out, sampled)
    done = [c.seq for c in out.scheduled if c.seq.request_id in sampled
            and len(c.seq.output_token_ids) >= c.seq.params.max_tokens]
    s.finish(done)
    return {c.seq.request_id: c.num_new_tokens for c in out.scheduled}, done


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    # budget 8: a 20-token prompt takes 8 + 8 + 4, then decodes one token per step
    s = make(16, max_num_batched_tokens=8)
    s.add(seq("a", 20), NS)
    assert [run_step(s)[0]["a"] for _ in range(4)] == [8, 8, 4, 1]


def test_prefix_hit_skips_cached_blocks_but_recomputes_the_last_token() -> None:
    # block 4: "a" (8 tokens) caches 2 blocks; "b" with the same 8 tokens reuses only 1 block
    # (the last prompt token must be computed to sample) and computes 4 tokens
    s = make(16)
    s.add(seq("a", 8, max_tokens=1), NS)
    run_step(s)
    b = seq("b", 8, max_tokens=1)
    s.add(b, NS)
    assert run_step(s)[0] == {"b": 4}
    assert b.num_cached_tokens == 4
    s.kv.pool.check_invariants()


def test_pool_exhaustion_preempts_the_newest_and_everything_finishes_once() -> None:
    # 4 blocks of 4 tokens: two 6-token prompts that each grow to 12 tokens cannot coexist
    s = make(4, max_num_seqs=4)
    a, b = seq("a", 6, max_tokens=6), seq("b", 6, max_tokens=6, first=100)
    s.add(a, NS)
    s.add(b, NS)
    finished: list[str] = []
    for _ in range(50):
        if not s.has_unfinished():
            break
        finished += [d.request_id for d in run_step(s)[1]]
    assert sorted(finished) == ["a", "b"]
    assert s.stats.num_preemptions >= 1 and b.num_preemptions >= 1
    assert len(a.output_token_ids) == len(b.output_token_ids) == 6
    assert s.kv.pool.num_used == 0
    s.kv.pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 10), min_size=8, max_size=8),
    num_blocks=st.integers(10, 24),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_random_load_on_a_small_pool_loses_and_duplicates_nothing(
    lengths: list[int], max_tokens: list[int], num_blocks: int, budget: int, max_seqs: int,
    seed: int,
) -> None:
    # every request fits alone: prompt + output <= 40 tokens = 10 blocks of 4
    rng = random.Random(seed)
    s = make(num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    seqs = []
    for i, n in enumerate(lengths):
        shared = rng.choice([0, 1000])  # half the prompts share a prefix
        seqs.append(seq(f"r{i}", n, max_tokens=max_tokens[i], first=shared))
        s.add(seqs[-1], NS)
    finished: list[str] = []
    for _ in range(2000):
        if not s.has_unfinished():
            break
        finished += [d.request_id for d in run_step(s)[1]]
        s.kv.pool.check_invariants()
    assert sorted(finished) == sorted(x.request_id for x in seqs)
    for x in seqs:
        assert len(x.output_token_ids) == x.params.max_tokens
    assert s.kv.pool.num_used == 0


class SeeingTier(NullTier):
    """A tier with nothing in it that records the prefill each lookup was told is ahead."""

    def __init__(self) -> None:
        super().__init__(OffloadPolicy())
        self.ahead: dict[str, int] = {}

    def match(self, request_id, keys, tokens, preempted, compute_ahead=0, parent=None,
              tail=()):
        self.ahead[request_id] = compute_ahead
        return super().match(request_id, keys, tokens, preempted, compute_ahead, parent, tail)


def test_a_lookup_is_told_the_prompt_tokens_running_sequences_have_not_computed() -> None:
    # budget 12: "a" (20 tokens) has computed 12 when "b" is looked up -> 8 ahead of it
    tier = SeeingTier()
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=12), BlockPool(16), 4, tier)
    s.add(seq("a", 20), NS)
    run_step(s)
    s.add(seq("b", 4, first=100), NS)
    run_step(s)
    assert tier.ahead == {"a": 0, "b": 8}
