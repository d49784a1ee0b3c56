"""Property: any interleaving of new sessions, turns, idle demotions, evictions and
preemptions gives the same greedy tokens and logits as an unlimited device pool, with host
restores actually happening. And a stress run: many wakes while others decode."""

from __future__ import annotations

import random
import time

from conftest import exact_engine, output_key
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model.loader import LoadedModel
from kvtier.sequence import SamplingParams

ACTIONS = st.lists(
    st.tuples(st.sampled_from(["new", "turn", "turn", "idle", "burst"]), st.integers(0, 10**6)),
    min_size=4, max_size=14,
)


@settings(max_examples=12, deadline=None)
@given(actions=ACTIONS, blocks=st.integers(8, 16), mode=st.sampled_from(["auto", "swap"]),
       load_mode=st.sampled_from(["async", "layerwise"]))
def test_any_interleaving_matches_an_unlimited_pool(
    tiny: LoadedModel, actions: list[tuple[str, int]], blocks: int, mode: str, load_mode: str,
) -> None:
    e = exact_engine(tiny, num_device_blocks=blocks, kv_offloading_size=0.02,
                     preemption_mode=mode, load_mode=load_mode, idle_offload_s=0.005,
                     max_num_batched_tokens=48)
    ref = exact_engine(tiny, num_device_blocks=1024)
    sessions: list[list[int]] = []
    try:
        for action, seed in actions:
            rng = random.Random(seed)
            if action == "new" or not sessions:
                sessions.append([rng.randrange(1, 380) for _ in range(rng.randrange(17, 60))])
                batch = [len(sessions) - 1]
            elif action == "idle":
                time.sleep(0.01)  # every cached block is now idle long enough to demote
                continue
            elif action == "burst":  # several sessions at once: forces preemption
                batch = rng.sample(range(len(sessions)), min(len(sessions), 4))
            else:
                batch = [rng.randrange(len(sessions))]
            params = SamplingParams(max_tokens=rng.randrange(3, 12), temperature=0.0,
                                    ignore_eos=True, logprobs=2)
            for i in batch:  # a conversation that would outgrow the small pool starts over
                if len(sessions[i]) + params.max_tokens + 5 > e.max_model_len:
                    sessions[i] = [rng.randrange(1, 380) for _ in range(17)]
            prompts = [sessions[i] for i in batch]
            rids = [e.add_request(p, params) for p in prompts]
            got = e.run_to_completion(rids)
            for i, rid in zip(batch, rids):
                r = ref.add_request(sessions[i], params)
                want = ref.run_to_completion([r])[r]
                assert output_key(got[rid]) == output_key(want)
                sessions[i] = sessions[i] + got[rid].token_ids + [rng.randrange(1, 380)
                                                                    for _ in range(5)]
        for _ in range(3):
            e.step()  # let in-flight stores land
        assert not e.scheduler.running and e.pool.num_used == 0
        e.pool.check_invariants()
    finally:
        e.close()
    if sum(1 for a, _ in actions if a in ("turn", "burst")) >= 4:
        # every full block a turn left on the device went to host (write-through)
        assert e.tier.report().transfers.stored_blocks > 0


def test_many_wakes_while_others_decode(tiny: LoadedModel) -> None:
    # 12 sessions: 4 long decodes run while the other 8 wake from host with a new turn
    rng = random.Random(11)
    e = exact_engine(tiny, num_device_blocks=24, kv_offloading_size=0.02)
    ref = exact_engine(tiny, num_device_blocks=1024)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=2)
    sessions = [[rng.randrange(1, 380) for _ in range(40)] for _ in range(12)]
    first = e.run_to_completion([e.add_request(s, short) for s in sessions])
    sessions = [s + first[r].token_ids + [7, 8, 9]
                for s, r in zip(sessions, sorted(first, key=lambda x: int(x.split("-")[1])))]
    rids = {e.add_request(sessions[i], long): (i, long) for i in range(4)}
    for _ in range(5):
        e.step()  # the long ones are decoding now
    rids.update({e.add_request(sessions[i], short): (i, short) for i in range(4, 12)})
    got = e.run_to_completion(list(rids))
    woken = 0
    for rid, (i, params) in rids.items():
        r = ref.add_request(sessions[i], params)
        assert output_key(got[rid]) == output_key(ref.run_to_completion([r])[r]), i
        woken += got[rid].residency == "host"
    assert woken >= 4
    e.close()
