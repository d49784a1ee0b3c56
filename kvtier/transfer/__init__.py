"""The only code in kvtier that moves KV bytes: device blocks <-> host slots, asynchronously.

Primitives:
  HostPool.from_size(gib, kv)      the host tier's memory, allocated once (pinned on CUDA)
  TransferSpec(direction, device_blocks, host_slots, layerwise)   what one job copies
  TransferEngine.submit(spec)      queue a job -> job id (loads always go before stores)
  TransferEngine.poll()            TransferResults finished since the last poll (never blocks)
  TransferEngine.wait(job_id)      block until one job is complete
  TransferEngine.wait_layer(job_id, layer)   a layerwise load's layer has arrived (or False)
  TransferEngine.stats()           bytes, busy seconds, jobs, failures, link utilisation
From submit until its result is delivered, a job's device blocks and host slots are pinned:
the caller neither reuses nor frees them. A failed job's partial writes are the caller's to
discard; it is a miss, never a load.
"""

from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.host_memory import SAFE_RAM_SHARE, HostPool
from kvtier.transfer.spec import (
    Direction,
    DirectionStats,
    InjectedFault,
    TransferResult,
    TransferSpec,
    TransferStats,
)

__all__ = [
    "SAFE_RAM_SHARE",
    "Direction",
    "DirectionStats",
    "HostPool",
    "InjectedFault",
    "TransferEngine",
    "TransferResult",
    "TransferSpec",
    "TransferStats",
]
