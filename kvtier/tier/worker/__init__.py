"""The only code in kvtier that moves KV bytes: `TierWorker` and what it is made of.

`worker.py` routes each job by medium: device <-> host to the link (`link.py`,
`TransferEngine`: one copy thread on CPU, side streams and events on CUDA), host <-> the
tiers below to the I/O thread (`io.py`, over `stores.py`'s `SecondaryStore`s: `disk_store.py`
and `redis_store.py`, blocks framed by `block_format.py`, 8-bit encodings by `codec.py`);
`probes.py` measures the link and the tiers at start. Every job is the tier's own `Job`, every
outcome its `Result`. The link's primitives:
  HostPool.from_size(gib, layout)  the host tier's memory, allocated once (pinned on CUDA)
  TransferEngine.submit(job)       queue a DEVICE <-> HOST job (loads always go before stores)
  TransferEngine.poll()            Results finished since the last poll (never blocks)
  TransferEngine.wait(job_id)      block until one job is complete
  TransferEngine.wait_layer(job_id, layer)   a layerwise load's layer has arrived (or False)
  TransferEngine.stats()           bytes, busy seconds, jobs, failures, link utilisation
From submit until its result is delivered, a job's device blocks and host slots are pinned:
the caller neither reuses nor frees them. A failed job's partial writes are the caller's to
discard; it is a miss, never a load.
"""

from kvtier.tier.worker.host_pool import HostPool
from kvtier.tier.worker.link import InjectedFault, TransferEngine
from kvtier.tier.worker.link_stats import DirectionStats, TransferStats

__all__ = [
    "DirectionStats",
    "HostPool",
    "InjectedFault",
    "TransferEngine",
    "TransferStats",
]
