"""POST /v1/completions and /v1/chat/completions: who asks (the tenant, whose blocks live in
its own hash namespace), what they ask (a bounded body, validated, for the served model), and
the prompt it makes; `Responder` answers. `guarded` turns whatever a handler did not foresee
into a 500 in OpenAI's shape."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import RequestError
from kvtier.model.tokenizer import Tokenizer
from kvtier.server.engine_loop import EngineLoop, RequestFailed
from kvtier.server.metrics import Metrics
from kvtier.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvtier.server.request_body import ApiError, json_body, prompt_text, read_body
from kvtier.server.responses import Responder

log = logging.getLogger(__name__)


def completion_routes(loop: EngineLoop, served_name: str, metrics: Metrics,
                      tenant_of: Callable[[Request], str], body_limit: int) -> APIRouter:
    """The two generation routes; `tenant_of` authenticates (401) and `body_limit` bounds
    a request body (413) before it is read whole."""
    names = {served_name, "default"}
    responder = Responder(loop, served_name, metrics)
    router = APIRouter()

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = json_body(await read_body(request, body_limit))
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:
            # the deepest error: in a union (a message's text or its parts) the branch the
            # client meant went furthest
            first = max(e.errors(), key=lambda err: len(err["loc"]))
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ApiError(400, f"{where}: {first['msg']}") from None
        if parsed.model not in names:
            raise ApiError(404, f"model '{parsed.model}' does not exist; this server serves "
                           f"'{served_name}'", "model_not_found")
        return parsed

    @router.post("/v1/completions")
    @guarded
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        req: CompletionRequest = await parse(request, CompletionRequest)
        prompt = await completion_prompt(loop, req.prompt)
        return await responder.serve(request, req, prompt, req.max_tokens, tenant, chat=False)

    @router.post("/v1/chat/completions")
    @guarded
    async def chat(request: Request) -> Response:
        tenant = tenant_of(request)
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        prompt = await chat_prompt(loop, req.messages)
        assert isinstance(prompt, dict)
        marks = await asyncio.to_thread(breakpoint_tokens, loop.engine.tokenizer,
                                        str(prompt.get("prompt", "")),
                                        list(prompt["prompt_token_ids"]), req.messages)
        return await responder.serve(request, req, prompt, req.limit, tenant, chat=True,
                                     breakpoint_tokens=marks)

    return router


async def completion_prompt(loop: EngineLoop, prompt: str | list[int]) -> PromptType:
    """A completion's prompt: text tokenized off the event loop, or the ids as given."""
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    text = prompt_text(prompt, loop.engine.max_model_len)
    return {"prompt": text,
            "prompt_token_ids": await asyncio.to_thread(loop.engine.tokenizer.encode, text)}


async def chat_prompt(loop: EngineLoop, messages: list[ChatMessage]) -> PromptType:
    """Chat messages through the model's template, off the event loop (other requests go
    on); 400 for a message the template cannot take."""
    tokenizer, max_len = loop.engine.tokenizer, loop.engine.max_model_len
    try:
        turns = [{"role": m.role, "content": prompt_text(m.text(), max_len)} for m in messages]
        text = await asyncio.to_thread(tokenizer.apply_chat_template, turns,
                                       add_generation_prompt=True)
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    text = prompt_text(text, max_len)
    ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": ids}


def breakpoint_tokens(tokenizer: Tokenizer, text: str, ids: list[int],
                      messages: list[ChatMessage]) -> list[int]:
    """Where each content part marked with `prompt_cache_breakpoint` ends in the rendered
    prompt's tokens: the tokens of the text up to the end of that part, as far as they agree
    with the whole prompt's (a token the cut would split is left out). The template renders
    every part's text in order, so each is found after the one before."""
    out: list[int] = []
    cursor = 0
    if not any(isinstance(m.content, list) and any(p.prompt_cache_breakpoint for p in m.content)
               for m in messages):
        return out
    for m in messages:
        parts = m.content if isinstance(m.content, list) else []
        for part in parts:
            piece = part.text or ""
            at = text.find(piece, cursor)
            if at < 0:
                raise ApiError(400, "a content part's text is not in the prompt the chat "
                                    "template made; its prompt_cache_breakpoint has no place")
            cursor = at + len(piece)
            if part.prompt_cache_breakpoint is not None:
                head = tokenizer.encode(text[:cursor], add_special_tokens=False)
                n = 0
                while n < min(len(head), len(ids)) and head[n] == ids[n]:
                    n += 1
                out.append(n)
        if isinstance(m.content, str) and (at := text.find(m.content, cursor)) >= 0:
            cursor = at + len(m.content)
    return out


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
