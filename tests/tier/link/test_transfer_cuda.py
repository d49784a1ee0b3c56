"""The transfer engine on CUDA: pinned pool, exact round trips, copies ordered against compute.

Marked `gpu`; skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.tier import Job, Medium
from kvtier.tier.link import HostPool, TransferEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM spinning: compute still running at submit


def cuda_kv(num_blocks: int = 24) -> torch.Tensor:
    # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim], 1536 B per block
    gen = torch.Generator().manual_seed(0)
    return torch.randn(num_blocks, 3, 4, 2, 2, 8, generator=gen).cuda()


def test_host_pool_is_pinned_at_exactly_its_size() -> None:
    pool = HostPool.like(cuda_kv(), 10)
    assert pool.pinned and pool.tensor.is_pinned()
    assert pool.stats()["pinned_bytes"] == pool.allocated_bytes == 10 * 1536


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-blocks", "layerwise"])
def test_round_trip_is_byte_exact_on_cuda(layerwise: bool) -> None:
    blocks, slots = [17, 2, 9, 3, 4, 11, 0], [5, 0, 13, 1, 2, 8, 21]
    fresh = [1, 5, 6, 7, 12, 13, 19]
    kv = cuda_kv()
    source = kv.clone()
    with TransferEngine(kv, HostPool.like(kv, 24), blocks_per_chunk=3) as engine:
        assert engine.wait(engine.submit(
            Job(0, Medium.DEVICE, Medium.HOST, tuple(slots), device_blocks=tuple(blocks))),
            timeout=10).success
        assert torch.equal(engine.host.tensor[slots], source[blocks].cpu())
        job = engine.submit(Job(1, Medium.HOST, Medium.DEVICE, tuple(slots),
                                device_blocks=tuple(fresh), layerwise=layerwise))
        assert engine.wait(job, timeout=10).success
        stats = engine.stats()
    assert torch.equal(kv[fresh], source[blocks])
    assert stats.store.busy_s > 0 and stats.load.bytes == 7 * 1536


def test_store_reads_blocks_only_after_the_compute_streams_prior_writes() -> None:
    # compute: spin ~0.1 s, then write 7.0 into blocks 1 and 5; the store is submitted while
    # the spin still runs and must copy the 7.0s, not the zeros that were there before
    kv = torch.zeros(8, 3, 4, 2, 2, 8, device="cuda")
    with TransferEngine(kv, HostPool.like(kv, 8)) as engine:
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        kv[1].fill_(7.0)
        kv[5].fill_(7.0)
        job = engine.submit(Job(0, Medium.DEVICE, Medium.HOST, (0, 3), device_blocks=(1, 5)))
        marker = torch.cuda.Event()
        marker.record()
        assert not marker.query(), "compute finished before submit: the test proves nothing"
        result = engine.wait(job, timeout=30)
    assert result.success
    assert bool((engine.host.tensor[[0, 3]] == 7.0).all())


def test_a_load_waits_for_compute_still_reading_its_blocks() -> None:
    # compute: spin, then read block 3; a load into block 3 submitted meanwhile must not
    # overwrite it before that read
    kv = cuda_kv(8)
    before = kv[3].clone()
    with TransferEngine(kv, HostPool.like(kv, 4)) as engine:
        engine.host.tensor[0] = -1.0
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        seen = kv[3].clone()  # queued behind the spin on the compute stream
        job = engine.submit(Job(0, Medium.HOST, Medium.DEVICE, (0,), device_blocks=(3,)))
        assert engine.wait(job, timeout=30).success
    assert torch.equal(seen, before)
    assert bool((kv[3] == -1.0).all())


def test_compute_after_wait_layer_sees_that_layer_without_blocking_the_host() -> None:
    # the load is submitted from a side stream that first spins ~0.1 s, so its copies start
    # late; the default stream reads each layer right after wait_layer and must still see
    # the loaded bytes (it waits on the layer's event), while the host never waited for them
    kv = torch.zeros(64, 3, 4, 2, 2, 8, device="cuda")
    blocks = tuple(range(63, -1, -1))  # reversed: 64 separate copies per layer
    index = torch.tensor(blocks, device="cuda")  # built now: no host sync while reading
    side = torch.cuda.Stream()
    with TransferEngine(kv, HostPool.like(kv, 64)) as engine:
        engine.host.tensor.copy_(torch.randn(64, 3, 4, 2, 2, 8))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            spun = torch.cuda.Event()
            spun.record()
            job = engine.submit(Job(0, Medium.HOST, Medium.DEVICE, tuple(range(64)),
                                    device_blocks=blocks, layerwise=True))
        seen = []
        for layer in range(3):
            assert engine.wait_layer(job, layer, timeout=30)
            seen.append(kv[:, layer].index_select(0, index))  # [64, 4, 2, 2, 8]
        assert not spun.query(), "wait_layer blocked the host until the copies were done"
        assert engine.wait(job, timeout=30).success
        torch.cuda.synchronize()
        for layer in range(3):
            assert torch.equal(seen[layer].cpu(), engine.host.tensor[:, layer])
