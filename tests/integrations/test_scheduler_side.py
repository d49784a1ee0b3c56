"""The vLLM connector's scheduler half, driven with plain values (no vLLM, no torch):
vLLM's block size 4 here, a host of 8 slots, requests as token lists."""

from kvtier.integrations.kit.groups import Window
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.tier import Fingerprint, Medium, Result, TierConfig
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.planner import Calibration, Planner

BS = 4
FP = Fingerprint("w", "arch", "bf16", BS, "")


FAST = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)


def side(slots: int = 8, windows: tuple[Window | None, ...] = (None,),
         cal: Calibration = FAST) -> SchedulerSide:
    host, ids = HostTier(slots), job_ids()
    manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(cal), 1000,
                          BelowHost(host, [], 1000, ids), ids)
    return SchedulerSide(manager, BS, FP.namespace, windows=windows)


def finish_jobs(s: SchedulerSide, jobs, ok: bool = True) -> None:
    s.apply([Result.whole(j.id, j.num_blocks, ok, 1000 * j.num_blocks, 1e-4) for j in jobs])


def serve(s: SchedulerSide, rid: str, prompt: list[int], salt: str = "",
          ok: bool = True) -> None:
    """One request with no hit: computed in one step, its full blocks stored, finished."""
    s.matched_tokens(rid, prompt, salt, 0)
    s.allocated(rid, [[1, 2, 3, 4]], 0)
    finish_jobs(s, s.step([Scheduled(rid, [[1, 2, 3, 4]], len(prompt))]), ok=ok)
    s.finished(rid)


def test_a_prompt_is_stored_as_it_is_computed_then_restored_for_the_next_request() -> None:
    s = side()
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks and a partial one
    assert s.matched_tokens("a", prompt, "", 0) == 0
    assert s.allocated("a", [[1, 2, 3, 4]], 0) is None
    # step 1 computes 8 tokens (chunked prefill): blocks 0 and 1 become full -> stored
    [store] = s.step([Scheduled("a", [[1, 2, 3, 4]], 8)])
    assert (store.src, store.dst, store.device_blocks) == (Medium.DEVICE, Medium.HOST, (1, 2))
    finish_jobs(s, [store])
    # step 2 computes the rest: block 2 becomes full; the partial block 3 is never stored
    [store] = s.step([Scheduled("a", [[1, 2, 3, 4]], 14)])
    assert store.device_blocks == (3,)
    finish_jobs(s, [store])
    assert s.finished("a")["kvtier_restored_tokens"] == 0
    # b has the same prompt plus a follow-up: vLLM's own cache has block 0 (4 tokens)
    follow = [*prompt, 99, 98]  # 16 tokens: 3 full blocks may load, at least one token computes
    assert s.matched_tokens("b", follow, "", 4) == 8  # blocks 1 and 2
    job = s.allocated("b", [[7, 8, 9, 10]], 8)
    # this step loads blocks 1-2 and computes the rest, which fills block 3: it is stored
    load, store = s.step([Scheduled("b", [[7, 8, 9, 10]], 16)])
    assert load.id == job and load.device_blocks == (8, 9) and load.dst is Medium.DEVICE
    assert store.device_blocks == (10,) and store.dst is Medium.HOST
    finish_jobs(s, [load, store])
    params = s.finished("b")
    assert params["kvtier_residency"] == "host" and params["kvtier_restored_tokens"] == 8


def test_another_salt_or_other_tokens_never_hit() -> None:
    s = side()
    prompt = list(range(30, 43))
    serve(s, "a", prompt, "tenant-a")
    assert s.matched_tokens("b", prompt, "tenant-b", 0) == 0
    assert s.matched_tokens("c", [1, *prompt[1:]], "tenant-a", 0) == 0
    assert s.matched_tokens("d", prompt, "tenant-a", 0) == 12


def test_a_failed_store_is_not_a_hit_and_a_failed_load_is_not_counted_restored() -> None:
    s = side()
    prompt = list(range(50, 63))
    serve(s, "a", prompt, ok=False)
    assert s.matched_tokens("b", prompt, "", 0) == 0
    serve(s, "b", prompt)
    assert s.matched_tokens("c", prompt, "", 0) == 12
    s.allocated("c", [[5, 6, 7, 8]], 12)
    finish_jobs(s, s.step([Scheduled("c", [[5, 6, 7, 8]], 13)]), ok=False)
    assert s.finished("c")["kvtier_restored_tokens"] == 0
    assert s.manager.host.stats.pinned == 0


def test_vllm_taking_less_than_offered_loads_nothing() -> None:
    s = side()
    prompt = list(range(70, 83))
    serve(s, "a", prompt)
    assert s.matched_tokens("b", prompt, "", 0) == 12
    assert s.allocated("b", [[5, 6, 7, 8]], 4) is None
    assert s.manager.host.stats.pinned == 0


def test_a_lookup_is_counted_once_however_often_vllm_asks_again() -> None:
    s = side()
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks
    serve(s, "a", prompt)
    s.take_stats()
    # "b" waits for device room: vLLM asks again every step until it can allocate
    for _ in range(5):
        assert s.matched_tokens("b", prompt, "", 0) == 12
    s.allocated("b", [[5, 6, 7, 8]], 12)
    for _ in range(3):  # preempted and rescheduled: asked again, allocated again
        s.matched_tokens("b", prompt, "", 0)
        s.allocated("b", [[5, 6, 7, 8]], 0)
    stats = s.take_stats()
    assert stats["lookup_tokens"] == 12  # the 3 full blocks, once
    assert stats.get("declined_tokens", 0) == 0


def test_a_window_group_stores_only_the_window_before_the_prompts_hit_boundary() -> None:
    s = side(windows=(Window(8, 0, BS),))  # the next token reads the last 8 tokens: 2 blocks
    prompt = list(range(10, 34))  # 24 tokens: its own hit boundary is block 5
    blocks = list(range(1, 8))
    assert s.matched_tokens("a", prompt, "", 0, len(prompt)) == 0
    s.allocated("a", [blocks], 0)
    [store] = s.step([Scheduled("a", [blocks], len(prompt))])
    # a hit of 5 blocks reads blocks 3 and 4 (first_needed(5) = (20 - 8 + 1) // 4 = 3)
    assert store.device_blocks == (4, 5)
    finish_jobs(s, [store])
    s.finished("a")
    # the same prompt again: vLLM holds nothing; kvtier offers all 5 blocks, loads 2,
    # into the blocks vLLM allocated after its null block for the 3 it skips
    assert s.matched_tokens("b", prompt, "", 0, len(prompt)) == 20
    job = s.allocated("b", [[0, 0, 0, 11, 12, 13, 14]], 20)
    [load] = s.step([Scheduled("b", [[0, 0, 0, 11, 12, 13, 14]], 24)])
    assert load.id == job and load.device_blocks == (11, 12)
    finish_jobs(s, [load])
    assert s.take_invalid() == set()


def test_a_window_vllm_allocated_otherwise_is_recomputed_not_read() -> None:
    s = side(windows=(Window(8, 0, BS),))
    prompt = list(range(10, 34))
    serve_window = [Scheduled("a", [list(range(1, 8))], len(prompt))]
    s.matched_tokens("a", prompt, "", 0, len(prompt))
    s.allocated("a", [list(range(1, 8))], 0)
    finish_jobs(s, s.step(serve_window))
    s.finished("a")
    assert s.matched_tokens("b", prompt, "", 0, len(prompt)) == 20
    # no nulls where the rule puts them: nothing is loaded, every block vLLM thinks restored
    # is reported as a load error, so vLLM recomputes them
    assert s.allocated("b", [[21, 22, 23, 24, 25, 26, 27]], 20) is None
    assert s.take_invalid() == {21, 22, 23, 24, 25}


def test_a_window_only_partly_held_is_not_offered() -> None:
    s = side(windows=(Window(8, 0, BS),))
    prompt = list(range(10, 34))
    s.matched_tokens("a", prompt, "", 0, len(prompt))
    s.allocated("a", [list(range(1, 8))], 0)
    [store] = s.step([Scheduled("a", [list(range(1, 8))], len(prompt))])
    finish_jobs(s, [store], ok=False)  # the window never reached host
    s.finished("a")
    assert s.matched_tokens("b", prompt, "", 0, len(prompt)) == 0


def test_hybrid_groups_are_keyed_apart_and_a_hit_needs_every_group_whole() -> None:
    # group 0 full attention, group 1 a window of 8 tokens; one pool, a block table each
    s = side(slots=16, windows=(None, Window(8, 0, BS)))
    prompt = list(range(10, 34))  # 24 tokens: 6 full blocks, a hit of at most 5
    full, win = list(range(1, 8)), list(range(21, 28))
    s.matched_tokens("a", prompt, "", 0, len(prompt))
    s.allocated("a", [full, win], 0)
    [store] = s.step([Scheduled("a", [full, win], len(prompt))])
    # every full block of group 0; of group 1 only the window a 5-block hit reads
    assert store.device_blocks == (1, 2, 3, 4, 5, 6, 24, 25)
    assert len(set(s.requests["a"].group_keys[0]) & set(s.requests["a"].group_keys[1])) == 0
    finish_jobs(s, [store])
    s.finished("a")
    assert s.matched_tokens("b", prompt, "", 0, len(prompt)) == 20
    s.allocated("b", [[31, 32, 33, 34, 35, 36, 37], [0, 0, 0, 41, 42, 43, 44]], 20)
    [load] = s.step([Scheduled("b", [[31, 32, 33, 34, 35, 36, 37],
                                     [0, 0, 0, 41, 42, 43, 44]], 24)])
    assert load.device_blocks == (31, 32, 33, 34, 35, 41, 42)  # one job for both groups
    finish_jobs(s, [load])
    stats = s.take_stats()
    assert stats["restored_blocks"] == {"0:full": 5, "1:window=8": 2}
    assert s.finished("b")["kvtier_restored_tokens"] == 20


def test_a_request_finished_in_the_step_its_load_lands_is_told_it_was_restored() -> None:
    # max_tokens=1: vLLM finishes the request before it hands back that step's results
    s = side()
    prompt = list(range(10, 24))
    serve(s, "a", prompt)
    assert s.matched_tokens("b", prompt, "", 0) == 12
    s.allocated("b", [[5, 6, 7, 8]], 12)
    jobs = s.step([Scheduled("b", [[5, 6, 7, 8]], 14)])
    params = s.finished("b")
    assert params["kvtier_residency"] == "host" and params["kvtier_restored_tokens"] == 12
    finish_jobs(s, jobs)
    assert s.take_stats()["restored_tokens"] == 12


def test_a_finished_requests_window_at_its_final_boundary_is_stored_before_vllm_frees_it(
        ) -> None:
    s = side(slots=16, windows=(Window(8, 0, BS),))
    tokens = list(range(10, 34))  # a 24-token prompt; decoding appends to the live list
    blocks = list(range(1, 10))
    s.matched_tokens("a", tokens, "", 0, len(tokens))
    s.allocated("a", [blocks], 0)
    finish_jobs(s, s.step([Scheduled("a", [blocks], 24)]))  # the prompt's window: 3, 4
    tokens += list(range(90, 102))  # 12 tokens decoded: 36 computed at the end (35 + 1)
    held = s.finish_windows("a", [[0, 0, 0, 4, 5, 6, 7, 8, 9]], 35)
    assert held and s.take_sending() == ["a"]
    [store] = s.step([])  # the next step copies blocks 6 and 7 (first_needed(8) = 6)
    assert store.device_blocks == (7, 8)
    finish_jobs(s, [store])
    s.finished("a")
    # the follow-up carries the output: the window group serves a hit of 8 blocks now
    follow = [*tokens, 7, 7, 7]
    assert s.matched_tokens("b", follow, "", 0, len(follow)) == 32
    # nothing new to store for a request that ends at its prompt's boundary
    assert not s.finish_windows("b", [[0] * 10], 24)


def test_after_a_reset_nothing_cached_before_is_restored_and_live_requests_store_nothing(
        ) -> None:
    # a is stored on host; b is alive (matched, admitted) when vLLM resets its cache; after
    # the reset a's blocks are gone from host, b neither loads nor stores, and c (a's prompt
    # again) is computed, stored under the new identity, and restored for d
    from kvtier.integrations.kit.epochs import ChainIdentity

    chain = ChainIdentity(FP)
    cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0)
    host, ids = HostTier(8), job_ids()
    manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, host, Planner(cal), 1000,
                          BelowHost(host, [], 1000, ids), ids)
    s = SchedulerSide(manager, BS, chain.seed)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    serve(s, "a", prompt)
    assert s.matched_tokens("b", prompt, "", 0) == 12
    s.allocated("b", [[5, 6, 7, 8]], 0)  # vLLM took no external tokens
    chain.reset()
    assert s.reset() == 3 and host.stats.used == 0
    assert s.step([Scheduled("b", [[5, 6, 7, 8]], 13)]) == []  # b's KV may be the old weights'
    assert s.matched_tokens("b", prompt, "", 0) == 0  # asked again (preempted): still nothing
    s.finished("b")
    assert s.matched_tokens("c", prompt, "", 0) == 0  # a's blocks are never found again
    s.allocated("c", [[1, 2, 3, 4]], 0)
    finish_jobs(s, s.step([Scheduled("c", [[1, 2, 3, 4]], 13)]))
    s.finished("c")
    assert s.matched_tokens("d", prompt, "", 0) == 12  # stored under the new identity
    stats = s.take_stats()
    assert stats["cache_resets"] == 1 and stats["reset_dropped_host_blocks"] == 3


def test_a_lookup_sees_the_prefill_vllm_admitted_and_has_not_computed_yet() -> None:
    # a link of 40 KB/s, prefill 200 tokens/s: blocks 1-2 restore in 50 ms against 40 ms of
    # recompute -> declined ("slower", counted once b is admitted); while 8 prompt tokens vLLM
    # admitted are still to compute (40 ms ahead), the same lookup restores; once vLLM has
    # computed them, it declines again
    s = side(cal=Calibration(link_gbps=4e-5, transfer_overhead_s=0.0,
                             prefill_tokens_per_s=200.0))
    prompt = list(range(10, 24))
    serve(s, "a", prompt)
    follow = [*prompt, 99, 98]
    assert s.matched_tokens("b", follow, "", 4) == 0
    s.allocated("b", [[5, 6, 7, 8]], 0)
    assert s.take_stats()["declined"] == {"slower": 1}
    s.finished("b")  # (aborted: its own 12 tokens would be ahead of the next lookups)
    other = list(range(300, 309))  # 9 tokens, nothing stored: 8 to compute before the last
    assert s.matched_tokens("long", other, "", 0) == 0
    s.allocated("long", [[11, 12, 13]], 0)
    assert s.matched_tokens("c", follow, "", 4) == 8
    s.step([Scheduled("long", [[11, 12, 13]], 9)])
    assert s.matched_tokens("d", follow, "", 4) == 0
