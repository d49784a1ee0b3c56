"""Where a test makes the tier fail: one object, passed to `build()` (and to the worker side).

  link   (job, step) -> True      that step of a device <-> host copy raises (the job fails,
                                  its partial bytes are discarded: a recompute, never a load)
  below  (job, index) -> Reason   that block of a job below host fails with that reason
  slow   (job, index) -> seconds  that block of a fetch is that much later to read (a slow
                                  medium, at most MAX_DELAY_S); not waited for once the
                                  fetch's deadline has passed, and a miss if it ends past it
`Faults.from_env()` is the one reader of the environment, for tests that drive a real process
(a server, vLLM): KVTIER_FAULT_LOADS=1 fails every host -> device load, and
KVTIER_FAULT_SLOW_FETCH_S=s reads every fetched block s seconds late; with KVTIER_FAULT_RANK=r
as well, only in worker rank r (tensor parallel: one rank's failure must be a miss on all).
Everything is off by default; nothing here runs unless a test asked for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.tier.jobs import Job, Reason
from kvtier.tier.keys import Medium

LinkFault = Callable[[Job, int], bool]
BelowFault = Callable[[Job, int], Reason | str | None]
DelayFault = Callable[[Job, int], float]
MAX_DELAY_S = 10.0  # a delay fault is a slow medium, never a hang
LOADS_ENV = "KVTIER_FAULT_LOADS"
RANK_ENV = "KVTIER_FAULT_RANK"
SLOW_FETCH_ENV = "KVTIER_FAULT_SLOW_FETCH_S"


def no_link_fault(job: Job, step: int) -> bool:
    return False


def no_below_fault(job: Job, index: int) -> Reason | None:
    return None


def no_delay(job: Job, index: int) -> float:
    return 0.0


def every_load(job: Job, step: int) -> bool:
    return job.dst is Medium.DEVICE


@dataclass(frozen=True)
class Faults:
    """The tier's fault hooks; a test passes its own callables (closures may read its state)."""

    link: LinkFault = no_link_fault
    below: BelowFault = no_below_fault
    slow: DelayFault = no_delay

    @classmethod
    def from_env(cls, rank: int = 0) -> Faults:
        """Off unless a test process set KVTIER_FAULT_LOADS=1 (every load fails) or
        KVTIER_FAULT_SLOW_FETCH_S=s (every block fetched from below host is read s seconds
        late, at most MAX_DELAY_S); with KVTIER_FAULT_RANK set, only in that worker rank."""
        only = os.environ.get(RANK_ENV, "").strip()
        if only and only != str(rank):
            return cls()
        link = every_load if os.environ.get(LOADS_ENV) == "1" else no_link_fault
        try:
            late = float(os.environ.get(SLOW_FETCH_ENV, "0") or 0)
        except ValueError:
            late = 0.0
        return cls(link=link, slow=_late(late) if late > 0 else no_delay)


def _late(seconds: float) -> DelayFault:
    def late(job: Job, index: int) -> float:
        return seconds

    return late


NO_FAULTS = Faults()
