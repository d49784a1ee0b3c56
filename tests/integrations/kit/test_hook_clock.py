"""The connector's own clock (no vLLM): seconds per hook, a nested hook counted once, steps
from the first schedule-side hook to vLLM's stats call, idle time between steps left out."""

from __future__ import annotations

import time

from kvtier.integrations.kit.hook_clock import HookClock, timed


class Hooks:
    """Stands in for the connector: the same decorator on methods of the same names."""

    def __init__(self) -> None:
        self.clock = HookClock()

    @timed(begins_step=True)
    def get_num_new_matched_tokens(self, pause: float) -> int:
        time.sleep(pause)
        return 0

    @timed()
    def request_finished(self) -> None:
        self.request_finished_all_groups()  # calls another hook: timed once, as the outer

    @timed()
    def request_finished_all_groups(self) -> None:
        time.sleep(0.01)

    @timed()
    def has_pending_push_work(self) -> bool:
        return False

    @timed()
    def get_kv_connector_stats(self) -> None:
        self.clock.end_step()


def test_hooks_and_steps_are_timed_and_idle_time_is_not_a_step() -> None:
    h = Hooks()
    h.get_num_new_matched_tokens(0.02)  # the step begins here
    time.sleep(0.03)  # vLLM's forward pass: inside the step, not in any hook
    h.request_finished()
    h.get_kv_connector_stats()  # the step ends here
    h.has_pending_push_work()  # the engine checks for work, then idles: not a step
    time.sleep(0.25)
    hooks, step = h.clock.take()
    assert 0.02 <= hooks["get_num_new_matched_tokens"] < 0.2
    assert 0.01 <= hooks["request_finished"] < 0.2
    assert "request_finished_all_groups" not in hooks  # inside request_finished
    assert set(hooks) == {"get_num_new_matched_tokens", "request_finished",
                          "has_pending_push_work", "get_kv_connector_stats"}
    assert 0.06 <= step < 0.25  # 20 + 30 + 10 ms of step, not the 250 ms idle after it
    assert h.clock.take() == ({}, 0.0)  # taken: nothing twice
    assert h.get_num_new_matched_tokens(0.0) == 0  # a hook's value passes through
