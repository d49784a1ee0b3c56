"""POST /v1/completions, /v1/chat/completions and /v1/responses: who asks (the tenant, whose
blocks live in its own hash namespace), what they ask (a bounded body, validated, for the
served model), and the prompt it makes; `Responder` answers. `guarded` turns whatever a
handler did not foresee into a 500 in OpenAI's shape."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import RequestError
from kvtier.server.engine_loop import EngineLoop, RequestFailed
from kvtier.server.prompt_cache import breakpoint_tokens
from kvtier.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from kvtier.server.protocol_responses import ResponsesRequest
from kvtier.server.request_body import ApiError, json_body, prompt_text, read_body, validated
from kvtier.server.responses import Responder
from kvtier.server.shapes_responses import ResponseShape

log = logging.getLogger(__name__)


def completion_routes(loop: EngineLoop, served_name: str, responder: Responder,
                      tenant_of: Callable[[Request], str], body_limit: int) -> APIRouter:
    """OpenAI's generation routes; `tenant_of` authenticates (401) and `body_limit` bounds
    a request body (413) before it is read whole."""
    names = {served_name, "default"}
    router = APIRouter()

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        parsed: Any = validated(model, json_body(await read_body(request, body_limit)))
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
                                        list(prompt["prompt_token_ids"]), req.pieces())
        return await responder.serve(request, req, prompt, req.limit, tenant, chat=True,
                                     breakpoint_tokens=marks)

    @router.post("/v1/responses")
    @guarded
    async def responses(request: Request) -> Response:
        tenant = tenant_of(request)
        req: ResponsesRequest = await parse(request, ResponsesRequest)
        try:
            req.checked()
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        prompt = await chat_prompt(loop, req.messages())
        assert isinstance(prompt, dict)
        ids = list(prompt["prompt_token_ids"])
        marks = await asyncio.to_thread(breakpoint_tokens, loop.engine.tokenizer,
                                        str(prompt.get("prompt", "")), ids, req.pieces())
        # a prewarm computes the prompt and one token it never shows: nothing generated
        limit = 1 if req.prewarm else req.max_output_tokens
        stream = await responder.submit(prompt, tenant, req.cache_salt,
                                        lambda: req.sampling(limit),
                                        lambda owner: req.hints(owner, marks))
        shape = ResponseShape(stream.request_id, served_name, req.echo(),
                              req.cache_marks(marks, len(ids)),
                              loop.engine.config.cache.block_size, req.prewarm)
        return await responder.answer(
            request, stream, lambda: responder.reply(stream, req.stream, shape, shape.whole))

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
