"""The link measured before the tier serves: host <-> device GB/s and the per-job overhead
(a few blocks), the planner's starting point. Each store measures its own read rate
(`stores/<name>/probe.py`)."""

from __future__ import annotations

from kvtier.tier.jobs import Job
from kvtier.tier.keys import Medium
from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.transfer import TransferEngine
from kvtier.tier.planner import Calibration

CALIBRATION_BLOCKS = 8


def measure_link(link: TransferEngine, host: HostPool, prefill_tokens_per_s: float,
                 blocks: int = CALIBRATION_BLOCKS) -> Calibration:
    """This machine's link before serving (the planner's start): a store of a few blocks,
    then two whole loads and a one-block load, timed; stats are reset after."""
    n = min(blocks, link.layout.num_blocks, host.num_slots)
    ids = tuple(range(n))
    # Negative ids: the manager's count from 0, these are delivered before it starts, and a
    # test's link faults (for serving) pass them by.
    link.wait(link.submit(Job(-1, Medium.DEVICE, Medium.HOST, ids, device_blocks=ids)))
    for i in range(2):
        full = link.wait(link.submit(Job(-2 - i, Medium.HOST, Medium.DEVICE, ids,
                                         device_blocks=ids)))
    one = link.wait(link.submit(Job(-4, Medium.HOST, Medium.DEVICE, ids[:1],
                                    device_blocks=ids[:1])))
    link.poll()
    link.reset_stats()
    block_bytes = link.layout.block_nbytes
    per_block = max((full.seconds - one.seconds) / max(n - 1, 1), 1e-9)
    gbps = block_bytes / per_block / 1e9
    overhead = max(one.seconds - block_bytes / (gbps * 1e9), 0.0)
    return Calibration(link_gbps=gbps, transfer_overhead_s=overhead,
                       prefill_tokens_per_s=prefill_tokens_per_s)
