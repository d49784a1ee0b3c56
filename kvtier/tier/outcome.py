"""What the tier did for one request (`TierManager.outcome`), and how a landed load changes it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.tier.keys import Medium


@dataclass(frozen=True)
class RequestOutcome:
    """What the tier did for one request, for every client to report (kv_transfer_params,
    a response's residency) instead of keeping its own copy."""

    restored_tokens: int = 0  # its prompt's tokens loaded from the tier (and landed)
    swapped_in_tokens: int = 0  # its own state after a preemption, loaded back
    nbytes: int = 0  # bytes those loads carried across the host link
    source: Medium | None = None  # where the restored state lived: host, disk or remote
    seconds: float = 0.0  # the loads' time, failed ones included
    lossy: bool = False  # its prompt was restored from 8-bit blocks
    failed: bool = False  # a load failed: its tokens were computed again
    waited_s: float = 0.0  # waiting for blocks still being written (`handoff.Wait`)


def landed(o: RequestOutcome, swap: bool, tokens: int, ok: bool, seconds: float, nbytes: int
           ) -> RequestOutcome:
    """A request's outcome once one of its loads (of `tokens`, a preempted request's own
    state if `swap`) landed: a failed one is a miss, never a load (its tokens and bytes
    come off, and its tokens are computed again)."""
    o = replace(o, seconds=o.seconds + seconds, failed=o.failed or not ok)
    if ok:
        return o
    if swap:
        o = replace(o, swapped_in_tokens=o.swapped_in_tokens - tokens)
    else:
        o = replace(o, restored_tokens=o.restored_tokens - tokens)
    return replace(o, nbytes=o.nbytes - nbytes, lossy=o.lossy and o.restored_tokens > 0)
