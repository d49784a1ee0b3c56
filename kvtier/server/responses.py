"""An engine request as an HTTP response, for every generation route: `Responder.submit`
puts a prompt in, `reply` answers with the whole JSON or an SSE stream, framed by the API's
own shape (a `Framing`; OpenAI's routes go through `serve`). Every response carries
`x-kvtier-residency` (and `x-kvtier-lossy` when restored from 8-bit blocks), known from the
first event on; a client that goes away aborts its request at once, queued or mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import KvtierError
from kvtier.output import RequestOutput, StreamDelta
from kvtier.sequence import SamplingParams
from kvtier.server.engine_loop import EngineLoop, RequestFailed, RequestStream
from kvtier.server.metrics import Metrics
from kvtier.server.protocol import tenant_salt
from kvtier.server.request_body import ApiError
from kvtier.server.shapes import Shape
from kvtier.tier import KvHints, request_tenant

RESIDENCY_HEADER = "x-kvtier-residency"
LOSSY_HEADER = "x-kvtier-lossy"


class Framing(Protocol):
    """How one API frames a streamed answer as server-sent events."""

    def opening(self, first: StreamDelta | RequestOutput) -> bytes: ...

    def piece(self, text: str) -> bytes: ...

    def closing(self, out: RequestOutput) -> bytes: ...

    def failure(self, message: str, status: int) -> bytes: ...


class Responder:
    """Built once per app; per request, `submit` then `answer` (the OpenAI routes: `serve`)."""

    def __init__(self, loop: EngineLoop, served_name: str, metrics: Metrics) -> None:
        self.loop, self.served_name, self.metrics = loop, served_name, metrics
        # names the tenant where no API key or router header does (kv_tenant_from)
        self.tenant_source = loop.engine.config.offload.tenant_source

    async def submit(self, prompt: PromptType, tenant: str, cache_salt: str | None,
                     params: Callable[[], SamplingParams], hints: Callable[[str], KvHints]
                     ) -> RequestStream:
        """The request into the engine under the tenant's namespace, its hints asked for the
        tenant its KV counts against; a bad parameter is a 400, a refusal its status."""
        try:
            return await self.loop.submit(
                prompt, params(), cache_salt=tenant_salt(tenant, cache_salt),
                hints=hints(request_tenant(self.tenant_source, cache_salt, tenant)))
        except RequestFailed as e:
            raise ApiError(e.status, str(e), kind="server_error") from None
        except KvtierError as e:
            raise ApiError(400, str(e)) from None

    async def answer(self, request: Request, stream: RequestStream,
                     respond: Callable[[], Awaitable[Response]]) -> Response:
        """`respond()`, and until a streaming response takes over (it watches the client
        itself), a client that goes away aborts the request at once: queued, or
        mid-generation."""
        watcher = asyncio.create_task(
            _on_disconnect(request, lambda: self.loop.abort(stream.request_id)))
        try:
            return await respond()
        finally:
            watcher.cancel()

    async def serve(self, request: Request, req: Any, prompt: PromptType,
                    max_tokens: int | None, tenant: str, chat: bool,
                    breakpoint_tokens: list[int] | None = None) -> Response:
        """An OpenAI completion or chat request, answered in OpenAI's shapes."""
        stream = await self.submit(prompt, tenant, req.cache_salt,
                                   lambda: req.sampling(max_tokens),
                                   lambda owner: req.hints(owner, breakpoint_tokens))
        ids = prompt.get("prompt_token_ids", ()) if isinstance(prompt, dict) else ()
        kept = req.cache_marks(breakpoint_tokens, len(ids))
        return await self.answer(request, stream,
                                 lambda: self.respond(req, stream, chat, kept))

    async def _first(self, stream: RequestStream
                    ) -> tuple[StreamDelta | RequestOutput,
                               AsyncIterator[StreamDelta | RequestOutput]]:
        """The request's first event (its admission: where its KV lived) and the rest; the
        request is aborted if none comes, and a failed one is its error."""
        events = stream.events()
        try:
            first = await anext(events)
        except BaseException:  # a RequestFailed is answered by `guarded`
            self.loop.abort(stream.request_id)
            raise
        if isinstance(first, RequestOutput):
            check_finished(first)
        return first, events

    async def _last(self, stream: RequestStream, first: StreamDelta | RequestOutput,
                   events: AsyncIterator[StreamDelta | RequestOutput]) -> RequestOutput:
        """The finished request's output (an error if it failed)."""
        out = first if isinstance(first, RequestOutput) else None
        try:
            async for event in events:
                if isinstance(event, RequestOutput):
                    out = event
        finally:
            if out is None:
                self.loop.abort(stream.request_id)
        assert out is not None
        check_finished(out)
        return out

    async def respond(self, req: Any, stream: RequestStream, chat: bool,
                      kept: list[tuple[int, str]]) -> Response:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        shape = Shape(stream.request_id, self.served_name, chat, req.return_token_ids,
                      req.top_logprobs_k(), self.loop.engine.tokenizer, kept,
                      self.loop.engine.config.cache.block_size, usage)
        return await self.reply(stream, req.stream, shape, shape.whole)

    async def reply(self, stream: RequestStream, streaming: bool, framing: Framing,
                    whole: Callable[[RequestOutput], dict[str, Any]]) -> Response:
        """The answer: streamed as `framing` frames it, or `whole(out)` once finished; its
        headers say where its KV lived, known from the first event."""
        first, events = await self._first(stream)
        headers = residency_headers(first)
        if streaming:
            return StreamingResponse(self.sse(stream, first, events, framing),
                                     media_type="text/event-stream", headers=headers)
        out = await self._last(stream, first, events)
        return JSONResponse(whole(out), headers=headers)

    async def sse(self, stream: RequestStream, first: StreamDelta | RequestOutput,
                  events: AsyncIterator[StreamDelta | RequestOutput], framing: Framing
                  ) -> AsyncIterator[bytes]:
        """The answer as its text grows, framed by `framing`; a client that goes away
        mid-stream frees its blocks at once."""
        done = False
        try:
            yield framing.opening(first)
            async for piece in _pieces(first, events):
                if isinstance(piece, str):
                    yield framing.piece(piece)
                    continue
                done = True
                if piece.finish_reason in ("error", "abort"):
                    yield framing.failure(piece.error or "the request was aborted", 500)
                else:
                    yield framing.closing(piece)
                return
        except RequestFailed as e:  # the engine failed it, or the server is going
            done = True
            self.metrics.observe_error(e.status)
            yield framing.failure(str(e), e.status)
        finally:
            if not done:
                self.loop.abort(stream.request_id)


async def _pieces(first: StreamDelta | RequestOutput,
                  events: AsyncIterator[StreamDelta | RequestOutput]
                  ) -> AsyncIterator[str | RequestOutput]:
    """The text as it becomes visible (none held back for a stop string still forming),
    piece by piece, then the finished output."""
    sent = 0
    event = first
    while True:
        if isinstance(event, RequestOutput):
            if event.finish_reason not in ("error", "abort") and len(event.text) > sent:
                yield event.text[sent:]
            yield event
            return
        visible = len(event.text) - event.holdback
        if visible > sent:
            yield event.text[sent:visible]
            sent = visible
        event = await anext(events)


def residency_headers(first: StreamDelta | RequestOutput) -> dict[str, str]:
    """Where the request's KV lived (and whether it came back lossy), known at admission."""
    headers = {RESIDENCY_HEADER: first.residency.value}
    if first.lossy:  # restored from 8-bit blocks: close to, not equal to, the exact KV
        headers[LOSSY_HEADER] = "true"
    return headers


def check_finished(out: RequestOutput) -> None:
    """A request the engine ended without an answer is a 500 (or, aborted, a 499: its
    client is gone) in OpenAI's error shape."""
    if out.finish_reason == "error":
        raise ApiError(500, out.error or "the engine failed this request", kind="server_error")
    if out.finish_reason == "abort":
        raise ApiError(499, "the request was aborted (its client went away)", kind="aborted")


async def _on_disconnect(request: Request, then: Any) -> None:
    """Wait for the client to go away (the body is read already), then call `then()`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return
