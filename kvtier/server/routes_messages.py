"""POST /v1/messages: Anthropic's Messages API over the same engine, tenants and tiers as
the OpenAI routes. Each `cache_control` is a breakpoint whose prefix is retained for its
ttl in every tier holding it; usage counts what was read from the cache and written for a
breakpoint, by Anthropic's definitions. Errors come in Anthropic's shape (`api.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvtier.errors import RequestError
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.prompt_cache import breakpoint_tokens
from kvtier.server.protocol_messages import MessagesRequest
from kvtier.server.request_body import ApiError, json_body, prompt_text, read_body, validated
from kvtier.server.responses import Responder
from kvtier.server.routes_completions import guarded
from kvtier.server.shapes_messages import MessageShape

MESSAGES_PATH = "/v1/messages"


def message_routes(loop: EngineLoop, served_name: str, responder: Responder,
                   tenant_of: Callable[[Request], str], body_limit: int) -> APIRouter:
    """The Messages route; `tenant_of` authenticates (an `x-api-key` or bearer key)."""
    names = {served_name, "default"}
    router = APIRouter()
    block_size = loop.engine.config.cache.block_size

    @router.post(MESSAGES_PATH)
    @guarded
    async def messages(request: Request) -> Response:
        tenant = tenant_of(request)
        req = validated(MessagesRequest, json_body(await read_body(request, body_limit)))
        assert isinstance(req, MessagesRequest)
        if req.model not in names:
            raise ApiError(404, f"model: '{req.model}' does not exist; this server serves "
                                f"'{served_name}'")
        prompt, marks = await _prompt(loop, req)
        stream = await responder.submit(prompt, tenant, req.cache_salt, req.sampling,
                                        lambda owner: req.hints(owner, marks))
        shape = MessageShape(stream.request_id, served_name, len(prompt["prompt_token_ids"]),
                             list(zip(marks, req.breakpoint_ttls())), block_size)
        return await responder.answer(
            request, stream, lambda: responder.reply(stream, req.stream, shape, shape.whole))

    return router


async def _prompt(loop: EngineLoop, req: MessagesRequest
                  ) -> tuple[dict[str, Any], list[int]]:
    """The system and messages through the model's chat template (off the event loop), and
    where each cache breakpoint ends in its tokens; 400 for what the template cannot take."""
    tokenizer, max_len = loop.engine.tokenizer, loop.engine.max_model_len
    try:
        pieces = [(prompt_text(text, max_len), control is not None)
                  for _, text, control in req.pieces()]
        text = await asyncio.to_thread(tokenizer.apply_chat_template, req.turns(),
                                       add_generation_prompt=True)
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    text = prompt_text(text, max_len)
    ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    marks = await asyncio.to_thread(breakpoint_tokens, tokenizer, text, ids, pieces)
    return {"prompt": text, "prompt_token_ids": ids}, marks
