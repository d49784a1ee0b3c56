"""An engine request as an HTTP response, for the completion routes: `Responder.serve`
submits a prompt and answers with the whole JSON or an SSE stream. Every response carries
`x-kvtier-residency` (and `x-kvtier-lossy` when restored from 8-bit blocks), known from the
first event on; a client that goes away aborts its request at once, queued or mid-stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import KvtierError
from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.engine_loop import EngineLoop, RequestFailed, RequestStream
from kvtier.server.metrics import Metrics
from kvtier.server.protocol import error_body, tenant_salt
from kvtier.server.request_body import ApiError
from kvtier.server.shapes import Shape
from kvtier.tier import request_tenant

RESIDENCY_HEADER = "x-kvtier-residency"
LOSSY_HEADER = "x-kvtier-lossy"


class Responder:
    """Built once per app; one `serve` per request (its `req` is the parsed body)."""

    def __init__(self, loop: EngineLoop, served_name: str, metrics: Metrics) -> None:
        self.loop, self.served_name, self.metrics = loop, served_name, metrics
        # names the tenant where no API key or router header does (kv_tenant_from)
        self.tenant_source = loop.engine.config.offload.tenant_source

    async def serve(self, request: Request, req: Any, prompt: PromptType,
                    max_tokens: int | None, tenant: str, chat: bool,
                    breakpoint_tokens: list[int] | None = None) -> Response:
        loop = self.loop
        try:
            params = req.sampling(max_tokens)
            stream = await loop.submit(prompt, params,
                                       cache_salt=tenant_salt(tenant, req.cache_salt),
                                       hints=req.hints(request_tenant(
                                           self.tenant_source, req.cache_salt, tenant),
                                           breakpoint_tokens))
        except RequestFailed as e:
            raise ApiError(e.status, str(e), kind="server_error") from None
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        # Until a streaming response takes over (it watches the client itself), a client
        # that goes away aborts the request at once: queued, or mid-generation.
        watcher = asyncio.create_task(_on_disconnect(request,
                                                     lambda: loop.abort(stream.request_id)))
        try:
            return await self.respond(req, stream, chat)
        finally:
            watcher.cancel()

    async def respond(self, req: Any, stream: RequestStream, chat: bool) -> Response:
        loop = self.loop
        events = stream.events()
        try:
            first = await anext(events)
        except BaseException:  # a RequestFailed is answered by `guarded`
            loop.abort(stream.request_id)
            raise
        if isinstance(first, RequestOutput):
            _check(first)
        residency = first.residency
        headers = {RESIDENCY_HEADER: residency}
        if first.lossy:  # restored from 8-bit blocks: close to, not equal to, the exact KV
            headers[LOSSY_HEADER] = "true"
        shape = Shape(stream.request_id, self.served_name, chat, req.return_token_ids,
                      req.top_logprobs_k(), loop.engine.tokenizer)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.sse(stream, first, events, shape, usage),
                                     media_type="text/event-stream", headers=headers)
        out = first if isinstance(first, RequestOutput) else None
        try:
            async for event in events:
                if isinstance(event, RequestOutput):
                    out = event
        finally:
            if out is None:
                loop.abort(stream.request_id)
        assert out is not None
        _check(out)
        return JSONResponse(shape.whole(out), headers=headers)

    async def sse(self, stream: RequestStream, first: StreamDelta | RequestOutput,
                  events: AsyncIterator[StreamDelta | RequestOutput], shape: Shape,
                  usage: bool) -> AsyncIterator[bytes]:
        sent = 0
        done = False
        try:
            event = first
            while True:
                if isinstance(event, RequestOutput) and event.finish_reason in ("error",
                                                                                "abort"):
                    done = True
                    yield _sse_error(event.error or "the request was aborted", 500)
                    return
                if isinstance(event, RequestOutput):
                    if len(event.text) > sent:
                        yield shape.chunk(event.text[sent:], None)
                    yield shape.chunk("", event.finish_reason, event.token_ids,
                                      event.hint_reply)
                    if usage:
                        yield shape.usage_chunk(event)
                    yield b"data: [DONE]\n\n"
                    done = True
                    return
                visible = len(event.text) - event.holdback
                if visible > sent:
                    yield shape.chunk(event.text[sent:visible], None)
                    sent = visible
                try:
                    event = await anext(events)
                except RequestFailed as e:  # the engine failed it, or the server is going
                    done = True
                    self.metrics.observe_error(e.status)
                    yield _sse_error(str(e), e.status)
                    return
        finally:
            if not done:  # the client went away mid-stream: free its blocks now
                self.loop.abort(stream.request_id)


def _check(out: RequestOutput) -> None:
    """A request the engine ended without an answer is a 500 (or, aborted, a 499: its
    client is gone) in OpenAI's error shape."""
    if out.finish_reason == "error":
        raise ApiError(500, out.error or "the engine failed this request", kind="server_error")
    if out.finish_reason == "abort":
        raise ApiError(499, "the request was aborted (its client went away)", kind="aborted")


def _sse_error(message: str, status: int) -> bytes:
    """The error event vLLM's server streams, then the end of the stream."""
    body = error_body(message, "server_error", str(status))
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _on_disconnect(request: Request, then: Any) -> None:
    """Wait for the client to go away (the body is read already), then call `then()`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return
