"""The engine's one background thread, and the asyncio side that HTTP handlers talk to.

Primitives: `start()`, `submit(...) -> RequestStream` (validated before it returns, so a bad
request becomes a 4xx, never a half-started stream), `RequestStream` (async iterator of
`StreamDelta`s, then the final `RequestOutput`), `call(fn)` (run a read of engine state on
the engine thread), `health()`, `shutdown()`. Only the engine thread touches the engine:
handlers never block it, and it never waits on a handler.

A request the engine fails alone ends with finish_reason "error"; a step that fails as a
whole fails the requests still open (their blocks freed) and the loop serves on. Only
MAX_STEP_FAILURES failing steps in a row kill the thread: then `on_death` runs (the server
exits non-zero, for its supervisor to restart it) and `health()` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.engine.llm_engine import LLMEngine, PromptType
from kvtier.errors import KvtierError
from kvtier.output import RequestOutput, StreamDelta
from kvtier.sequence import KvHints, SamplingParams

IDLE_WAIT_S = 0.05  # an idle engine still steps this often (idle demotion, transfers)
MAX_STEP_FAILURES = 3  # failing steps in a row before the engine is declared dead
STALL_S = 60.0  # work queued and no step finished for this long: unhealthy
log = logging.getLogger(__name__)


class RequestFailed(KvtierError):
    """The engine could not serve this request: not the caller's fault (500), or the server
    is going away (503)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RequestStream:
    """Events of one request, delivered on the handler's event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamDelta | RequestOutput | BaseException] = field(
        default_factory=asyncio.Queue)
    output: RequestOutput | None = None

    async def events(self) -> AsyncIterator[StreamDelta | RequestOutput]:
        while True:
            event = await self.queue.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, RequestOutput):
                self.output = event
                return


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_death: Callable[[], None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 stall_s: float = STALL_S) -> None:
        self.engine = engine
        self.on_death = on_death  # the engine thread died: the process should exit
        self.on_finished = on_finished  # every request's end: done, failed or aborted
        self.draining = False  # shutting down: nothing new is admitted
        self.stall_s = stall_s
        self.dead: BaseException | None = None
        self.last_step = time.monotonic()  # when the last step (idle ones too) finished
        self._inbox: deque[Callable[[], None]] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._failures = 0  # failing steps in a row
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def health(self) -> str | None:
        """None when serving; else why not (dead, stopped, or stalled with work queued)."""
        if self.dead is not None:
            return f"the engine thread died: {type(self.dead).__name__}: {self.dead}"
        if not self._thread.is_alive():
            return "the engine thread is not running"
        if self.draining:
            return "the server is shutting down"
        stalled = time.monotonic() - self.last_step
        if (self._streams or self._inbox) and stalled > self.stall_s:
            return f"no engine step has finished for {stalled:.0f} s with work queued"
        return None

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread between steps; a future of its result."""
        future: Future[Any] = Future()
        if self.dead is not None or self._stopping:
            future.set_exception(RequestFailed("the engine is not running"))
            return future

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, not lost
                future.set_exception(e)

        self._inbox.append(job)
        self._wake.set()
        return future

    async def submit(self, prompt: PromptType, params: SamplingParams, cache_salt: str = "",
                     hints: KvHints | None = None) -> RequestStream:
        """Queue a request; raises the engine's validation error (a KvtierError) at once, or
        RequestFailed (503) while the server drains or after the engine died."""
        if self._stopping or self.draining:
            raise RequestFailed("the server is shutting down; retry on another replica", 503)
        rid = uuid.uuid4().hex  # unique across restarts, as OpenAI's ids are
        stream = RequestStream(rid, asyncio.get_running_loop())

        def add() -> str:
            self._streams[rid] = stream
            try:
                return self.engine.add_request(prompt, params, request_id=rid,
                                               cache_salt=cache_salt, stream=True,
                                               strict_length=True, hints=hints)
            except BaseException:
                del self._streams[rid]
                raise

        await asyncio.wrap_future(self.call(add))
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: free its blocks at once (between two steps); a handler
        still waiting on the stream gets its aborted output."""
        self.call(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        out = self.engine.abort(request_id)
        if out is not None:
            self._finished(out)
            if stream is not None:
                self._send(stream, out)

    def fail_open(self, message: str, status: int = 503) -> None:
        """End every open request with `message` (the drain period of a shutdown is over)."""
        self.call(lambda: self._fail_open(RequestFailed(message, status)))

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            with contextlib.suppress(Exception):  # a metrics bug never stops the engine
                self.on_finished(out)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._serve_once()
        except BaseException as e:  # nothing is served any more: say so, and everywhere
            self.dead = e
            log.exception("kvtier: the engine thread died; the server stops")
            self._fail_open(RequestFailed(f"the engine stopped ({type(e).__name__}: {e})"))
            while self._inbox:  # calls queued behind the failure must not hang their callers
                self._inbox.popleft()()
            if self.on_death is not None:
                self.on_death()

    def _serve_once(self) -> None:
        while self._inbox:
            self._inbox.popleft()()
        try:
            outputs = self._step()
        except Exception as e:
            self._failures += 1
            log.exception("kvtier: an engine step failed (%d in a row); failing the requests "
                          "still open", self._failures)
            self._fail_open(RequestFailed(f"the engine failed while serving this request "
                                          f"({type(e).__name__}: {e})"))
            if self._failures >= MAX_STEP_FAILURES:
                raise
            return
        self._failures = 0
        self.last_step = time.monotonic()
        self._deliver(outputs)

    def _step(self) -> list[RequestOutput]:
        if self.engine.has_unfinished():
            return self.engine.step()
        self._wake.wait(IDLE_WAIT_S)
        self._wake.clear()
        if not self._inbox:
            self.engine.step()  # idle demotion and transfer completion go on
        return []

    def _fail_open(self, error: RequestFailed) -> None:
        """Every open request ends with `error`; their blocks go back to the pool."""
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                out = self.engine.abort(rid)
                if out is not None:
                    self._finished(replace(out, finish_reason="error", error=str(error)))
            self._send(stream, error)
        self._streams.clear()
        self.engine.stream_deltas.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for delta in self.engine.stream_deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                self._send(stream, delta)
        self.engine.stream_deltas.clear()
        for out in outputs:
            self._finished(out)
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                self._send(stream, out)

    @staticmethod
    def _send(stream: RequestStream, event: Any) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    def shutdown(self, timeout: float = 10.0) -> int:
        """End what is still open (503), stop the thread, write the tiers down, release the
        pools; how many requests were still open."""
        still_open = len(self._streams)
        if self._thread.is_alive():
            # The loop may already be gone (it raised): shut down regardless.
            with contextlib.suppress(Exception):
                self.call(lambda: self._fail_open(RequestFailed(
                    "the server is shutting down", 503))).result(timeout)
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()
        return still_open
