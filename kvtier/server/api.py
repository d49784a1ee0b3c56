"""The FastAPI app: OpenAI-compatible completions and chat, residency in every response.

Every response says where the request's KV lived (`x-kvtier-residency`: resident | host |
recomputed | new) and `usage` carries OpenAI's `prompt_tokens_details.cached_tokens` plus
`restored_tokens`, `recomputed_tokens` and `restore_ms`. Tenants are API keys; each tenant's
blocks live in its own hash namespace, so one tenant can never hit, or time, another's.
Bad input is a 4xx in OpenAI's error shape, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import KvtierError, RequestError
from kvtier.metrics import Metrics
from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.engine_loop import EngineLoop, RequestStream
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvtier.stats import RequestLog, engine_stats

RESIDENCY_HEADER = "x-kvtier-residency"
LOSSY_HEADER = "x-kvtier-lossy"


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def build_app(loop: EngineLoop, served_name: str, tenants: dict[str, str] | None = None,
              metrics: Metrics | None = None) -> FastAPI:
    """`tenants` maps API key -> tenant name; None means no authentication."""
    metrics = metrics or Metrics()
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
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
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
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [{"id": served_name, "object": "model",
                                             "created": 0, "owned_by": "kvtier"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        def snapshot() -> tuple[dict[str, Any], int, int]:
            log = RequestLog(list(loop.finished))
            s = loop.engine.scheduler
            return engine_stats(loop.engine, log), len(s.running), len(s.waiting)

        stats, running, waiting = await asyncio.wrap_future(loop.call(snapshot))
        metrics.refresh(stats, running=running, waiting=waiting)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        req: CompletionRequest = await parse(request, CompletionRequest)
        prompt: PromptType = req.prompt if isinstance(req.prompt, str) else \
            {"prompt_token_ids": req.prompt}
        return await serve(req, prompt, req.max_tokens, tenant, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        tenant = tenant_of(request)
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        tokenizer = loop.engine.tokenizer
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await serve(req, {"prompt": text, "prompt_token_ids": ids}, req.limit, tenant,
                           chat=True)

    async def serve(req: Any, prompt: PromptType, max_tokens: int | None, tenant: str,
                    chat: bool) -> Response:
        try:
            params = req.sampling(max_tokens)
            salt = f"tenant={tenant}|salt={req.cache_salt or ''}"
            stream = await loop.submit(prompt, params, cache_salt=salt)
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        events = stream.events()
        try:
            first = await anext(events)
        except BaseException:
            loop.abort(stream.request_id)
            raise
        residency = first.residency
        headers = {RESIDENCY_HEADER: residency}
        if first.lossy:  # restored from 8-bit blocks: close to, not equal to, the exact KV
            headers[LOSSY_HEADER] = "true"
        shape = _Shape(stream.request_id, served_name, chat, req.return_token_ids)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(sse(stream, first, events, shape, usage),
                                     media_type="text/event-stream", headers=headers)
        try:
            out = first if isinstance(first, RequestOutput) else None
            async for event in events:
                if isinstance(event, RequestOutput):
                    out = event
        finally:
            if out is None:
                loop.abort(stream.request_id)
        assert out is not None
        metrics.observe_request(out)
        return JSONResponse(shape.whole(out), headers=headers)

    async def sse(stream: RequestStream, first: StreamDelta | RequestOutput,
                  events: AsyncIterator[StreamDelta | RequestOutput], shape: _Shape,
                  usage: bool) -> AsyncIterator[bytes]:
        sent = 0
        done = False
        try:
            event = first
            while True:
                if isinstance(event, RequestOutput):
                    if len(event.text) > sent:
                        yield shape.chunk(event.text[sent:], None)
                    yield shape.chunk("", event.finish_reason, event.token_ids)
                    if usage:
                        yield shape.usage_chunk(event)
                    yield b"data: [DONE]\n\n"
                    metrics.observe_request(event)
                    done = True
                    return
                visible = len(event.text) - event.holdback
                if visible > sent:
                    yield shape.chunk(event.text[sent:visible], None)
                    sent = visible
                event = await anext(events)
        finally:
            if not done:  # the client went away mid-stream: free its blocks now
                loop.abort(stream.request_id)

    return app


class _Shape:
    """OpenAI's JSON shapes for one request: whole responses, SSE chunks, usage."""

    def __init__(self, request_id: str, model: str, chat: bool, token_ids: bool = False) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id.split("-")[-1]
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.first = True
        self.with_token_ids = token_ids

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                      "logprobs": None}
            obj = "text_completion"
        if self.with_token_ids:
            choice["token_ids"] = out.token_ids
        return {**self._base(obj), "choices": [choice], "usage": usage_of(out)}

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
            "recomputed_tokens": out.num_recomputed_tokens,
            "restore_ms": round(out.metrics.restore_s * 1e3, 3),
            "residency": out.residency, "lossy": out.lossy}
