"""The FastAPI app: OpenAI-compatible completions and chat, residency in every response.

Every response says where the request's KV lived (`x-kvtier-residency`: resident | host |
recomputed | new) and `usage` carries OpenAI's `prompt_tokens_details.cached_tokens` plus
`restored_tokens`, `recomputed_tokens`, `restore_ms`, and the engine's TTFT split
(`ttft_ms` = `queue_ms` + `tier_ms` + `compute_ms`). Tenants are API keys; each tenant's
blocks live in its own hash namespace, so one tenant can never hit, or time, another's.
Bad input is a 4xx in OpenAI's error shape, never a traceback.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import KvtierError, RequestError
from kvtier.metrics import Metrics
from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.engine_loop import EngineLoop, RequestFailed, RequestStream
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvtier.server.request_body import (
    ApiError,
    default_max_request_bytes,
    json_body,
    prompt_text,
    read_body,
)
from kvtier.stats import RequestLog, engine_stats

log = logging.getLogger(__name__)
RESIDENCY_HEADER = "x-kvtier-residency"
LOSSY_HEADER = "x-kvtier-lossy"


def build_app(loop: EngineLoop, served_name: str, tenants: dict[str, str] | None = None,
              metrics: Metrics | None = None, max_request_bytes: int | None = None) -> FastAPI:
    """`tenants` maps API key -> tenant name; None means no authentication.
    `max_request_bytes`: a larger body is a 413 before it is read whole (default: sized to
    the model's context, `default_max_request_bytes`)."""
    metrics = metrics or Metrics()
    max_len = loop.engine.max_model_len
    body_limit = max_request_bytes or default_max_request_bytes(max_len)
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None)
    names = {served_name, "default"}

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        metrics.observe_error(e.status)
        return JSONResponse(error_body(e.message, e.kind, e.code), status_code=e.status)

    def tenant_of(request: Request) -> str:
        if tenants is None:
            return ""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in tenants:
            raise ApiError(401, "invalid or missing API key; send 'Authorization: Bearer KEY'",
                           "invalid_api_key", "authentication_error")
        return tenants[key]

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = json_body(await read_body(request, body_limit))
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ApiError(400, f"{where}: {first['msg']}") from None
        if parsed.model not in names:
            raise ApiError(404, f"model '{parsed.model}' does not exist; this server serves "
                           f"'{served_name}'", "model_not_found")
        return parsed

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 (and why) when it is dead, stalled or draining."""
        why = loop.health()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [{"id": served_name, "object": "model",
                                             "created": 0, "owned_by": "kvtier"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        def snapshot() -> tuple[dict[str, Any], int, int]:
            s = loop.engine.scheduler  # counters and gauges only: no history is scanned
            return engine_stats(loop.engine, RequestLog()), len(s.running), len(s.waiting)

        try:
            stats, running, waiting = await asyncio.wrap_future(loop.call(snapshot))
        except RequestFailed:  # the engine is gone: what the counters said last
            stats, running, waiting = {}, 0, 0
        metrics.refresh(stats, running=running, waiting=waiting)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    @guarded
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        req: CompletionRequest = await parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            text = prompt_text(req.prompt, max_len)
            ids = await asyncio.to_thread(loop.engine.tokenizer.encode, text)
            prompt: PromptType = {"prompt": text, "prompt_token_ids": ids}
        else:
            prompt = {"prompt_token_ids": req.prompt}
        return await serve(request, req, prompt, req.max_tokens, tenant, chat=False)

    @app.post("/v1/chat/completions")
    @guarded
    async def chat(request: Request) -> Response:
        tenant = tenant_of(request)
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        tokenizer = loop.engine.tokenizer
        try:
            messages = [{"role": m.role, "content": prompt_text(m.text(), max_len)}
                        for m in req.messages]
            # the template and the tokenizer run off the event loop: other requests go on
            text = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                           add_generation_prompt=True)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        text = prompt_text(text, max_len)
        ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        return await serve(request, req, {"prompt": text, "prompt_token_ids": ids}, req.limit,
                           tenant, chat=True)

    async def serve(request: Request, req: Any, prompt: PromptType, max_tokens: int | None,
                    tenant: str, chat: bool) -> Response:
        try:
            params = req.sampling(max_tokens)
            salt = f"tenant={tenant}|salt={req.cache_salt or ''}"
            stream = await loop.submit(prompt, params, cache_salt=salt)
        except RequestFailed as e:
            raise ApiError(e.status, str(e), kind="server_error") from None
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        # Until a streaming response takes over (it watches the client itself), a client
        # that goes away aborts the request at once: queued, or mid-generation.
        watcher = asyncio.create_task(_on_disconnect(request,
                                                     lambda: loop.abort(stream.request_id)))
        try:
            return await respond(req, stream, chat)
        finally:
            watcher.cancel()

    async def respond(req: Any, stream: RequestStream, chat: bool) -> Response:
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
        shape = _Shape(stream.request_id, served_name, chat, req.return_token_ids,
                       req.top_logprobs_k(), loop.engine.tokenizer)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(stream, first, events, shape, usage),
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

    async def sse(stream: RequestStream, first: StreamDelta | RequestOutput,
                  events: AsyncIterator[StreamDelta | RequestOutput], shape: _Shape,
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
                    yield shape.chunk("", event.finish_reason, event.token_ids)
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
                    metrics.observe_error(e.status)
                    yield _sse_error(str(e), e.status)
                    return
        finally:
            if not done:  # the client went away mid-stream: free its blocks now
                loop.abort(stream.request_id)

    return app


def guarded(handler: Callable[[Request], Awaitable[Response]]
            ) -> Callable[[Request], Awaitable[Response]]:
    """A request the engine could not serve is its 500 or 503, and whatever a handler did
    not foresee a logged 500, in OpenAI's shape (counted, the connection kept), never a
    plain-text traceback page."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError:
            raise
        except RequestFailed as e:
            raise ApiError(e.status, str(e), kind="server_error") from None
        except Exception as e:
            log.exception("kvtier: %s %s failed", request.method, request.url.path)
            raise ApiError(500, f"internal error ({type(e).__name__}); the server logged it",
                           kind="server_error") from None

    return run


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


class _Shape:
    """OpenAI's JSON shapes for one request: whole responses, SSE chunks, usage."""

    def __init__(self, request_id: str, model: str, chat: bool, token_ids: bool = False,
                 top_logprobs: int | None = None, tokenizer: Any = None) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id.split("-")[-1]
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.first = True
        self.with_token_ids = token_ids
        self.top_logprobs = top_logprobs  # None: no logprobs were asked for
        self.tokenizer = tokenizer

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        logprobs = self._logprobs(out)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": logprobs}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                      "logprobs": logprobs}
            obj = "text_completion"
        if self.with_token_ids:
            choice["token_ids"] = out.token_ids
        return {**self._base(obj), "choices": [choice], "usage": usage_of(out)}

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        """OpenAI's logprobs object: per generated token its log-probability under the
        model and the `top_logprobs` most likely alternatives (chat and completions shapes)."""
        if self.top_logprobs is None or out.logprobs is None:
            return None
        text = self.tokenizer.decode
        steps = []
        for token, lps in zip(out.token_ids, out.logprobs):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            steps.append((text([token], False), lps[token], [(text([t], False), lp)
                                                              for t, lp in top]))
        if self.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": [
                    {"token": ts, "logprob": tlp, "bytes": list(ts.encode())}
                    for ts, tlp in top]} for s, lp, top in steps]}
        offsets, at = [], 0
        for s, _, _ in steps:
            offsets.append(at)
            at += len(s)
        return {"tokens": [s for s, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
                "top_logprobs": [dict(top) for _, _, top in steps], "text_offset": offsets}

    def chunk(self, text: str, finish_reason: str | None,
              token_ids: list[int] | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            if self.first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}
            body = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = {**self._base("text_completion"), "choices": [choice]}
        if token_ids is not None and self.with_token_ids:
            choice["token_ids"] = token_ids  # the whole output's ids, on the closing chunk
        self.first = False
        return f"data: {json.dumps(body)}\n\n".encode()

    def usage_chunk(self, out: RequestOutput) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._base(obj), "choices": [], "usage": usage_of(out)}
        return f"data: {json.dumps(body)}\n\n".encode()


def usage_of(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "restored_tokens": out.num_restored_tokens,
            "swapped_in_tokens": out.num_swapped_in_tokens,
            "recomputed_tokens": out.num_recomputed_tokens,
            "restore_ms": round(out.metrics.restore_s * 1e3, 3),
            "residency": out.residency, "lossy": out.lossy, **ttft_split_ms(out)}


def ttft_split_ms(out: RequestOutput) -> dict[str, float | None]:
    """The engine's TTFT and its queue / tier / compute parts, in ms (None: no first token)."""
    m = out.metrics
    return {f"{name}_ms": None if value is None else round(value * 1e3, 3)
            for name, value in {"ttft": m.ttft_s, **m.parts()}.items()}
