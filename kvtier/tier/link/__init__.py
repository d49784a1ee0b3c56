"""Device <-> host memory: the host pool and the transfer engine that copies between them.

`../worker.py` routes each job by medium: device <-> host here (`engine.py`, `TransferEngine`:
one copy thread on CPU, side streams and events on CUDA; `copy.py` the copies, `codec.py` the
8-bit encodings, `host_pool.py` the rows), host <-> the stores below to the I/O thread
(`../io/`). `probe.py` measures the link at start. Every job is the tier's own `Job`, every
outcome its `Result`. The primitives:
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

from kvtier.tier.link.host_pool import HostPool
from kvtier.tier.link.stats import DirectionStats, TransferStats
from kvtier.tier.link.transfer import InjectedTransferFault, TransferEngine

__all__ = [
    "DirectionStats",
    "HostPool",
    "InjectedTransferFault",
    "TransferEngine",
    "TransferStats",
]
