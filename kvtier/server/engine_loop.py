"""The engine's one background thread, and the asyncio side that HTTP handlers talk to.

Primitives: `start()`, `submit(...) -> RequestStream` (validated before it returns, so a bad
request becomes a 4xx, never a half-started stream), `RequestStream` (async iterator of
`StreamDelta`s, then the final `RequestOutput`), `call(fn)` (run a read of engine state on
the engine thread), `shutdown()`. Only the engine thread touches the engine: handlers
never block it, and it never waits on a handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.llm_engine import LLMEngine, PromptType
from kvtier.errors import KvtierError
from kvtier.output import RequestOutput, StreamDelta
from kvtier.sequence import SamplingParams

IDLE_WAIT_S = 0.05  # an idle engine still steps this often (idle demotion, transfers)


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
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: deque[Callable[[], None]] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self.finished: list[RequestOutput] = []  # for stats; read through call()

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the engine thread between steps; a future of its result."""
        future: Future[Any] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, not lost
                future.set_exception(e)

        self._inbox.append(job)
        self._wake.set()
        return future

    async def submit(self, prompt: PromptType, params: SamplingParams, cache_salt: str = ""
                     ) -> RequestStream:
        """Queue a request; raises the engine's validation error (a KvtierError) at once."""
        if self._stopping:
            raise KvtierError("the server is shutting down")
        rid = f"cmpl-{next(self._ids)}"
        stream = RequestStream(rid, asyncio.get_running_loop())

        def add() -> str:
            self._streams[rid] = stream
            try:
                return self.engine.add_request(prompt, params, request_id=rid,
                                               cache_salt=cache_salt, stream=True,
                                               strict_length=True)
            except BaseException:
                del self._streams[rid]
                raise

        await asyncio.wrap_future(self.call(add))
        return stream

    def abort(self, request_id: str) -> None:
        """The client went away: free its blocks at once (between two steps)."""
        self.call(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _run(self) -> None:
        while not self._stopping:
            while self._inbox:
                self._inbox.popleft()()
            if not self.engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                if not self._inbox:
                    self.engine.step()  # idle demotion and transfer completion go on
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # fail every open request rather than hang them
                for stream in list(self._streams.values()):
                    self._send(stream, e)
                self._streams.clear()
                raise
            for delta in self.engine.stream_deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    self._send(stream, delta)
            self.engine.stream_deltas.clear()
            for out in outputs:
                self.finished.append(out)
                stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    self._send(stream, out)

    @staticmethod
    def _send(stream: RequestStream, event: Any) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)

    def shutdown(self, timeout: float = 10.0) -> int:
        """Abort what is still running, stop the thread, release the pools; how many were
        aborted."""
        aborted = 0

        def abort_all() -> None:
            nonlocal aborted
            for rid in list(self._streams):
                stream = self._streams.pop(rid)
                out = self.engine.abort(rid)
                aborted += 1
                if out is not None:
                    self._send(stream, out)

        if self._thread.is_alive():
            # The loop may already be gone (it raised): shut down regardless.
            with contextlib.suppress(Exception):
                self.call(abort_all).result(timeout)
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()
        return aborted
