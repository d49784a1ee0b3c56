"""Whether a restore runs inside the step that admits its request, or beside the steps of
the others while its request waits (vLLM's asynchronous load, `WAITING_FOR_REMOTE_KVS`).

A load inside the step holds up every request decoding in it by the load's time: free on a
fast link, a stall in every running stream's TPOT where the link is the bottleneck (a slow
PCIe, `max_load_gbps`, many wakes at once). A load beside the steps costs its own request
a step or two more (it is scheduled once the load has landed) and nobody else anything.
`auto` takes the second where the load would stretch a step that others are in by more
than `STALL_SHARE` of it, and the first otherwise (nobody else to hold up, or a load too
short to matter).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from kvtier.errors import ConfigError

STALL_SHARE = 0.1  # auto: a load longer than this share of a step goes beside the steps
SMOOTHING = 0.2  # weight of a new step's period in the running estimate
MAX_PERIOD_S = 10.0  # a gap longer than this between steps is idleness, not a step


class AsyncLoading(enum.Enum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"

    @classmethod
    def parse(cls, text: str) -> AsyncLoading:
        try:
            return cls(text)
        except ValueError:
            raise ConfigError(f"async_loading={text!r} is unknown; choose one of "
                              f"{', '.join(m.value for m in cls)}") from None


class StepPeriod:
    """The engine's step period: a running estimate of the time between two steps in a row
    that both compute something (None until such a pair was seen)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.seconds: float | None = None
        self._last: float | None = None  # when the last step that computes began

    def stepped(self, computing: bool) -> None:
        """A step begins; `computing`: it has tokens to compute."""
        now = self.clock()
        if computing and self._last is not None and now - self._last < MAX_PERIOD_S:
            period = now - self._last
            self.seconds = (period if self.seconds is None
                            else (1 - SMOOTHING) * self.seconds + SMOOTHING * period)
        self._last = now if computing else None


def loads_async(mode: AsyncLoading, restore_s: float, step_s: float | None,
                others_running: int) -> bool:
    """Whether a load predicted to take `restore_s` runs beside the steps of the
    `others_running` requests (see the module doc)."""
    if mode is not AsyncLoading.AUTO:
        return mode is AsyncLoading.ALWAYS
    if others_running == 0:
        return False
    return restore_s > STALL_SHARE * (step_s if step_s is not None else 0.0)
