"""The transfer engine on CPU: exact round trips, layer-wise arrival, loads first, faults, close."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tier import Job, Medium, Result
from kvtier.tier.link import HostPool, TransferEngine
from kvtier.tier.link.copy import block_runs

BLOCK_BYTES = 3 * 4 * 2 * 2 * 8 * 4  # 3 layers x 4 tokens x (k, v) x 2 heads x 8 dims x fp32


def make_kv(num_blocks: int = 24, seed: int = 0) -> torch.Tensor:
    # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]
    return torch.randn(num_blocks, 3, 4, 2, 2, 8, generator=torch.Generator().manual_seed(seed))


IDS = itertools.count()  # the caller's job ids, as a manager's


def store(blocks: list[int], slots: list[int]) -> Job:
    return Job(next(IDS), Medium.DEVICE, Medium.HOST, tuple(slots), device_blocks=tuple(blocks))


def load(blocks: list[int], slots: list[int], layerwise: bool = False) -> Job:
    return Job(next(IDS), Medium.HOST, Medium.DEVICE, tuple(slots), device_blocks=tuple(blocks),
               layerwise=layerwise)


def poll_until(engine: TransferEngine, n: int, timeout: float = 5.0) -> list[Result]:
    results: list[Result] = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += engine.poll()
        time.sleep(0.001)
    return results


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-blocks", "layerwise"])
def test_store_then_load_round_trip_is_byte_exact(layerwise: bool) -> None:
    # 7 scattered blocks, [3, 4] -> [1, 2] a run of two; chunks of 3 -> 3 + 3 + 1
    blocks, slots = [17, 2, 9, 3, 4, 11, 0], [5, 0, 13, 1, 2, 8, 21]
    kv = make_kv()
    source = kv.clone()
    with TransferEngine(kv, HostPool.like(kv, 24), blocks_per_chunk=3) as engine:
        stored = engine.wait(engine.submit(store(blocks, slots)), timeout=5)
        assert stored.success and stored.reasons == ("",) * 7
        assert stored.nbytes == 7 * BLOCK_BYTES
        assert torch.equal(engine.host.tensor[slots], source[blocks])
        # bring them back into other blocks: [1, 5, 6, 7, 12, 13, 19] (6, 7 a run)
        fresh = [1, 5, 6, 7, 12, 13, 19]
        loaded = engine.wait(engine.submit(load(fresh, slots, layerwise)), timeout=5)
        assert loaded.success and loaded.nbytes == 7 * BLOCK_BYTES
    assert torch.equal(kv[fresh], source[blocks])
    untouched = [b for b in range(24) if b not in fresh]
    assert torch.equal(kv[untouched], source[untouched])


def test_wait_layer_returns_once_that_layer_is_present() -> None:
    # a 3-layer load of blocks [4, 0] from slots [2, 6]; the worker is held before layer 2
    kv = make_kv()
    engine = TransferEngine(kv, HostPool.like(kv, 8))
    engine.host.tensor[[2, 6]] = torch.randn(2, 3, 4, 2, 2, 8)
    kv[[4, 0]] = 0.0
    release = threading.Event()
    engine.fault = lambda spec, step: step == 2 and not release.wait(5)
    job = engine.submit(load([4, 0], [2, 6], layerwise=True))
    assert engine.wait_layer(job, 0, timeout=5) is True
    assert engine.wait_layer(job, 1, timeout=5) is True
    # at this moment layers 0 and 1 have arrived and layer 2 has not
    assert torch.equal(kv[[4, 0], :2], engine.host.tensor[[2, 6], :2])
    assert not kv[[4, 0], 2].any()
    release.set()
    assert engine.wait_layer(job, 2, timeout=5) is True
    assert torch.equal(kv[[4, 0]], engine.host.tensor[[2, 6]])
    assert engine.wait(job, timeout=5).success
    assert engine.wait_layer(job, 2) is True  # a delivered job still answers
    engine.close()


def test_loads_go_before_queued_stores() -> None:
    # three stores of 8 blocks in chunks of 2 are queued; the worker is held inside the first
    # chunk of store 1 while a load arrives -> the load finishes before stores 1, 2 and 3
    kv = make_kv(40)
    with TransferEngine(kv, HostPool.like(kv, 40), blocks_per_chunk=2) as engine:
        inside, release = threading.Event(), threading.Event()
        first = store(list(range(8)), list(range(8)))

        def hold_first_chunk(spec: Job, step: int) -> bool:
            if spec is first and step == 0:
                inside.set()
                release.wait(5)
            return False

        engine.fault = hold_first_chunk
        s1 = engine.submit(first)
        s2 = engine.submit(store(list(range(8, 16)), list(range(8, 16))))
        s3 = engine.submit(store(list(range(16, 24)), list(range(16, 24))))
        assert inside.wait(5)
        ld = engine.submit(load(list(range(30, 34)), list(range(30, 34))))
        release.set()
        order = [r.job_id for r in poll_until(engine, 4)]
    assert order == [ld, s1, s2, s3]


def test_fault_in_chunk_1_of_3_fails_the_job_and_the_next_one_succeeds() -> None:
    # 6 blocks in chunks of 2 -> chunks 0, 1, 2; chunk 1 raises inside the worker
    kv = make_kv()
    bad = store([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    with TransferEngine(kv, HostPool.like(kv, 12), blocks_per_chunk=2,
                        fault=lambda spec, step: spec is bad and step == 1) as engine:
        failed = engine.wait(engine.submit(bad), timeout=5)
        assert not failed.success
        assert "injected fault in step 1" in failed.reasons[0]
        assert failed.nbytes == 2 * BLOCK_BYTES  # chunk 0 landed; the caller discards it
        good = engine.wait(engine.submit(store([6, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11])), 5)
        assert good.success
        assert torch.equal(engine.host.tensor[6:12], kv[6:12])
        stats = engine.stats().store
        assert (stats.jobs, stats.failures) == (2, 1)
        assert stats.bytes == 8 * BLOCK_BYTES


def test_a_layerwise_load_that_fails_at_layer_1_reports_which_layers_arrived() -> None:
    kv = make_kv()
    with TransferEngine(kv, HostPool.like(kv, 4),
                        fault=lambda spec, step: step == 1) as engine:
        job = engine.submit(load([5, 6], [0, 1], layerwise=True))
        assert engine.wait_layer(job, 0, timeout=5) is True
        assert engine.wait_layer(job, 2, timeout=5) is False  # recompute these tokens
        result = engine.wait(job, timeout=5)
        assert not result.success and engine.stats().load.failures == 1


def test_close_with_jobs_pending_returns_promptly_and_fails_them() -> None:
    # a slow link: every chunk takes 50 ms; 4 stores of 6 chunks would take 1.2 s
    kv = make_kv()
    engine = TransferEngine(kv, HostPool.like(kv, 24), blocks_per_chunk=1,
                            fault=lambda spec, step: bool(time.sleep(0.05)))
    jobs = [engine.submit(store(list(range(i, i + 6)), list(range(i, i + 6))))
            for i in (0, 6, 12, 18)]
    time.sleep(0.02)
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 0.5
    results = {r.job_id: r for r in engine.poll()}
    assert set(results) == set(jobs)
    assert not any(r.success for r in results.values())
    assert "closed" in results[jobs[-1]].reasons[0]
    assert all(engine.is_done(j) for j in jobs)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(store([0], [0]))
    engine.close()  # twice is fine


def test_each_result_is_delivered_once_and_poll_never_blocks() -> None:
    kv = make_kv()
    with TransferEngine(kv, HostPool.like(kv, 4)) as engine:
        assert engine.poll() == []
        a = engine.submit(store([1], [0]))
        b = engine.submit(store([2], [1]))
        assert engine.wait(b, timeout=5).success
        assert [r.job_id for r in poll_until(engine, 1)] == [a]  # b went to wait()
        assert engine.poll() == []
        with pytest.raises(ValueError, match="already delivered"):
            engine.wait(a)
        with pytest.raises(ValueError, match="unknown"):
            engine.is_done(99)


def test_wait_times_out_while_the_job_is_held() -> None:
    kv = make_kv()
    release = threading.Event()
    with TransferEngine(kv, HostPool.like(kv, 4),
                        fault=lambda spec, step: not release.wait(5)) as engine:
        job = engine.submit(store([0], [0]))
        with pytest.raises(TimeoutError):
            engine.wait(job, timeout=0.05)
        assert not engine.is_done(job)
        release.set()
        assert engine.wait(job, timeout=5).success


def test_stats_count_bytes_busy_time_and_utilisation() -> None:
    kv = make_kv()
    with TransferEngine(kv, HostPool.like(kv, 8), blocks_per_chunk=3) as engine:
        engine.wait(engine.submit(store([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])), 5)
        engine.wait(engine.submit(load([9, 10], [0, 1])), 5)
        stats = engine.stats()
        assert (stats.store.bytes, stats.store.jobs) == (5 * BLOCK_BYTES, 1)
        assert (stats.load.bytes, stats.load.jobs) == (2 * BLOCK_BYTES, 1)
        assert stats.store.busy_s > 0 and 0 < stats.store.utilisation < 1
        assert stats.as_dict()["load_bytes"] == 2 * BLOCK_BYTES
        engine.reset_stats()
        assert engine.stats().store.bytes == 0 and engine.stats().load.jobs == 0


def test_bad_specs_and_mismatched_pools_are_refused() -> None:
    kv = make_kv(4)
    with pytest.raises(ConfigError, match="do not match"):
        TransferEngine(kv, HostPool.like(make_kv(4)[:, :2].contiguous(), 2))
    with TransferEngine(kv, HostPool.like(kv, 2)) as engine:
        with pytest.raises(ValueError, match="lengths must match"):
            engine.submit(store([0, 1], [0]))
        with pytest.raises(ValueError, match="loads only"):
            engine.submit(Job(next(IDS), Medium.DEVICE, Medium.HOST, (0,), device_blocks=(0,),
                              layerwise=True))
        with pytest.raises(ValueError, match="repeat an id"):
            engine.submit(load([1, 1], [0, 1]))
        with pytest.raises(ValueError, match="device and host only"):
            engine.submit(Job(next(IDS), Medium.HOST, Medium.DISK, (0,)))
        held = engine.submit(store([0], [0]))
        with pytest.raises(ValueError, match="already in flight"):
            engine.submit(Job(held, Medium.DEVICE, Medium.HOST, (1,), device_blocks=(1,)))
        assert engine.wait(held, timeout=5).success
        with pytest.raises(ValueError, match="host slot 2"):
            engine.submit(store([0], [2]))
        with pytest.raises(ValueError, match="device block 4"):
            engine.submit(load([4], [0]))
        with pytest.raises(ValueError, match="layer 3"):
            engine.wait_layer(engine.submit(load([0], [0], layerwise=True)), 3)


def test_block_runs_group_consecutive_pairs() -> None:
    # blocks [3, 4, 5, 9] -> slots [7, 8, 2, 3]: (3, 7) x2, (5, 2), (9, 3)
    assert block_runs([3, 4, 5, 9], [7, 8, 2, 3]) == [(3, 7, 2), (5, 2, 1), (9, 3, 1)]
    assert block_runs([], []) == []



@pytest.mark.parametrize("placement", ["contiguous", "per-layer", "one-allocation"])
def test_a_load_shared_by_a_copy_team_is_byte_exact(placement: str) -> None:
    from kvtier.tier.layout import KVLayout
    from kvtier.tier.link.copy import TEAM_MIN_BYTES, CopyTeam, _share, stacked_layers

    kv = torch.randn(64, 3, 64, 2, 2, 32)  # 96 KiB blocks: 48 of them are worth a team
    per_layer = placement != "contiguous"
    if placement == "one-allocation":  # vLLM's CPU cache: layers side by side in one buffer
        layers = list(kv.transpose(0, 1).contiguous().unbind(0))
    else:
        layers = [kv[:, i].clone() for i in range(3)]
    device = KVLayout.from_layers(layers) if per_layer else KVLayout.from_contiguous(kv)
    # the one-allocation layers are copied one run of blocks at a time, all layers at once
    assert (stacked_layers(device) is not None) == (placement == "one-allocation")

    def block(b: int) -> list[torch.Tensor]:
        return [t[b].clone() for t in layers] if per_layer else [kv[b].clone()]

    blocks = list(range(48))
    source = [block(b) for b in blocks]
    assert 48 * kv[0].numel() * 4 >= TEAM_MIN_BYTES
    with TransferEngine(device, HostPool.like(device, 64), load_threads=2) as engine:
        assert engine.wait(engine.submit(store(blocks, blocks)), timeout=5).success
        fresh = [63, *range(10, 40), 1, 5, 7, *range(41, 55)]  # scattered, runs among them
        assert engine.wait(engine.submit(load(fresh, blocks)), timeout=5).success
    for want, b in zip(source, fresh):
        assert all(torch.equal(x, y) for x, y in zip(block(b), want))
    # one run alone is split between the threads: the pieces cover it once
    dst = torch.zeros(10, 1000)
    groups = _share([(dst, torch.randn(10, 1000))], 2)
    assert [sum(p[0].shape[0] for p in g) for g in groups] == [5, 5]
    team = CopyTeam(2)
    src = torch.randn(10, 1 << 20)
    big = torch.zeros_like(src)
    team.run([(big, src)])
    team.close()
    assert torch.equal(big, src)


def test_layers_not_evenly_spaced_in_one_allocation_are_copied_layer_by_layer() -> None:
    from kvtier.tier.layout import KVLayout
    from kvtier.tier.link.copy import copy_blocks, stacked_layers

    buf = torch.randn(3 * 48 + 5)  # three [4, 2, 6] layers at offsets 0, 48, 101
    layers = [buf[o : o + 48].view(4, 2, 6) for o in (0, 48, 101)]
    device = KVLayout.from_layers(layers)
    assert stacked_layers(device) is None
    host = torch.randn(3, 3, 2, 6)
    want = [t.clone() for t in layers]
    copy_blocks(device, host, [2, 0], [1, 2], store=False)
    for i, t in enumerate(layers):
        want[i][2], want[i][0] = host[1, i], host[2, i]
        assert torch.equal(t, want[i])


def test_loads_are_paced_to_max_load_gbps_and_stay_exact() -> None:
    # 8 blocks of 1,536 bytes in 0.2 s: two whole loads of 4 and one layer-wise load of 4
    # take at least 0.2 s and 0.1 s, whatever this machine's memory copies could do
    cap = 8 * BLOCK_BYTES / 0.2 / 1e9
    kv = make_kv()
    source = kv.clone()
    with TransferEngine(kv, HostPool.like(kv, 24), load_gbps=cap) as engine:
        engine.wait(engine.submit(store(list(range(12)), list(range(12)))), 5)
        began = time.perf_counter()
        a = engine.submit(load([12, 13, 14, 15], [0, 1, 2, 3]))
        b = engine.submit(load([16, 17, 18, 19], [4, 5, 6, 7]))
        assert engine.wait(a, 5).success and engine.wait(b, 5).success
        assert time.perf_counter() - began >= 0.2 * 0.99
        began = time.perf_counter()
        c = engine.submit(load([20, 21, 22, 23], [8, 9, 10, 11], layerwise=True))
        assert engine.wait(c, 5).success
        assert time.perf_counter() - began >= 0.1 * 0.99
        assert engine.stats().load.bytes == 12 * BLOCK_BYTES
    assert torch.equal(kv[12:24], source[:12])


def test_close_does_not_wait_out_a_paced_load() -> None:
    # the step's copy is done and its pacing cut short: it ends as its current step, whole
    kv = make_kv()
    engine = TransferEngine(kv, HostPool.like(kv, 8), load_gbps=BLOCK_BYTES / 30.0 / 1e9)
    engine.host.tensor[3] = torch.randn(3, 4, 2, 2, 8)
    job = engine.submit(load([0], [3]))  # 30 s at the cap
    time.sleep(0.05)
    began = time.perf_counter()
    engine.close()
    assert time.perf_counter() - began < 3.0
    assert engine.wait(job, timeout=1).success and torch.equal(kv[0], engine.host.tensor[3])
