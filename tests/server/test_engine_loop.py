"""The server's engine thread over a stand-in engine: health says stalled and dead when it
is, a failing step fails what is open and the loop goes on, and only repeated failures
kill it (then `on_death` runs and callers get an answer instead of a hang)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvtier.server.engine_loop import MAX_STEP_FAILURES, EngineLoop, RequestFailed


class StandIn:
    """What EngineLoop uses of an LLMEngine; `step` blocks on `gate` or raises `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.gate = threading.Event()
        self.error = error
        self.steps = 0
        self.stream_deltas: list[Any] = []
        self.closed = False

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[Any]:
        self.steps += 1
        if self.error is not None:
            raise self.error
        self.gate.wait(5)
        return []

    def abort(self, request_id: str) -> None:
        return None

    def close(self) -> None:
        self.closed = True


def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_health_says_stalled_while_work_waits_on_a_step_that_does_not_finish() -> None:
    engine = StandIn()
    loop = EngineLoop(engine, stall_s=0.2)  # type: ignore[arg-type]
    loop.start()
    assert loop.health() is None
    answer = loop.call(lambda: 42)  # queued behind the stuck step
    time.sleep(0.4)
    assert "no engine step has finished" in (loop.health() or "")
    engine.gate.set()
    assert answer.result(5) == 42
    wait_for(lambda: loop.health() is None)
    loop.shutdown(timeout=5)
    assert engine.closed


def test_repeated_step_failures_kill_the_loop_and_say_so() -> None:
    engine = StandIn(error=RuntimeError("boom"))
    died = threading.Event()
    loop = EngineLoop(engine, on_death=died.set)  # type: ignore[arg-type]
    loop.start()
    assert died.wait(5)
    assert engine.steps == MAX_STEP_FAILURES  # it tried again before giving up
    assert "the engine thread died: RuntimeError: boom" in (loop.health() or "")
    with pytest.raises(RequestFailed):
        loop.call(lambda: 1).result(1)  # an answer, not a hang
    loop.shutdown(timeout=5)
    assert engine.closed
