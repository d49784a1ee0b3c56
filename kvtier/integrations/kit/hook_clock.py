"""HookClock: the connector's own seconds in each of vLLM's hooks, beside the step they ran
in, so what kvtier costs when nothing hits is a share measured inside the engine process
rather than a difference between two vLLM processes (which differ by up to 30% run to run).

On the scheduler side a step begins at the first hook of vLLM's `schedule()` that reaches
the connector (a lookup, an allocation, or `build_connector_meta`) and ends at
`get_kv_connector_stats`, which vLLM calls once at the end of every step's update: an idle
engine between requests is not a step. That span leaves out vLLM's own scheduling before
the first hook and its output building after the last, so the share it gives is, if
anything, too high. Hooks vLLM calls once per layer with nothing for kvtier to do
(`wait_for_layer_load`, `save_kv_layer`) are not timed: timing them would cost more than
they do.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class HookClock:
    """Seconds per hook, and (scheduler side) step seconds, since the last `take`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.step_seconds = 0.0
        self._depth = 0  # a hook that calls another is timed once, as the outer one
        self._step_began: float | None = None

    def enter(self, begins_step: bool) -> float:
        now = time.perf_counter()
        self._depth += 1
        if begins_step and self._step_began is None:
            self._step_began = now
        return now

    def leave(self, hook: str, entered: float) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds[hook] += time.perf_counter() - entered

    def end_step(self) -> None:
        """vLLM's update of this step is under way (`get_kv_connector_stats`)."""
        if self._step_began is not None:
            self.step_seconds += time.perf_counter() - self._step_began
            self._step_began = None

    def take(self) -> tuple[dict[str, float], float]:
        """(seconds per hook, step seconds) since the last call."""
        seconds, step = dict(self.seconds), self.step_seconds
        self.seconds.clear()
        self.step_seconds = 0.0
        return seconds, step


class _Timed(Protocol):
    clock: HookClock


def timed(begins_step: bool = False) -> Callable[[F], F]:
    """Time a connector method into its `clock` under the method's name; `begins_step`: a
    hook vLLM calls from its `schedule()` (the step has begun once it runs)."""

    def wrap(method: F) -> F:
        name = method.__name__

        @functools.wraps(method)
        def hook(self: _Timed, *args: Any, **kwargs: Any) -> Any:
            clock = self.clock
            entered = clock.enter(begins_step)
            try:
                return method(self, *args, **kwargs)
            finally:
                clock.leave(name, entered)

        return hook  # type: ignore[return-value]

    return wrap
