"""The only code in kvtier that moves KV bytes: `TierWorker` and what it is made of.

`worker.py` routes each job by medium: device <-> host to the link (`link.py`,
`TransferEngine`: one copy thread on CPU, side streams and events on CUDA), host <-> disk /
Redis to the I/O thread (`io.py`, over `disk_store.py` and `redis_store.py`, blocks framed
by `block_format.py`, 8-bit encodings by `codec.py`); `probes.py` measures the link and the
tiers at start. The link's own primitives:
  HostPool.from_size(gib, layout)  the host tier's memory, allocated once (pinned on CUDA)
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

from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.link import TransferEngine
from kvtier.tier.worker.spec import (
    Direction,
    DirectionStats,
    InjectedFault,
    TransferResult,
    TransferSpec,
    TransferStats,
)

__all__ = [
    "Direction",
    "DirectionStats",
    "HostPool",
    "InjectedFault",
    "TransferEngine",
    "TransferResult",
    "TransferSpec",
    "TransferStats",
]
