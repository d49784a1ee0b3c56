"""POST /v1/kv/prefetch: a client that knows a session comes back soon (an agent whose tool
call is about to return) asks for its prefix to be brought up from disk or the shared store
into host memory now, so the request that follows wakes from host. Nothing is computed; the
answer says what was found, what is on its way up, and from where."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kvtier.errors import KvtierError
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.protocol import PrefetchRequest, tenant_salt
from kvtier.server.request_body import ApiError, json_body, read_body
from kvtier.server.routes_completions import chat_prompt, completion_prompt, guarded
from kvtier.tier import request_tenant


def kv_routes(loop: EngineLoop, served_name: str, tenant_of: Callable[[Request], str],
              body_limit: int) -> APIRouter:
    """The KV routes; authenticated (401) and bounded (413) as the generation routes are."""
    router = APIRouter()

    @router.post("/v1/kv/prefetch")
    @guarded
    async def prefetch(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        try:
            req = PrefetchRequest.model_validate(json_body(await read_body(request,
                                                                           body_limit)))
            req.check()
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise ApiError(400, f"{where}: {first['msg']}") from None
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        if req.model not in (None, served_name, "default"):
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves "
                           f"'{served_name}'", "model_not_found")
        prompt = await (chat_prompt(loop, req.messages) if req.messages is not None
                        else completion_prompt(loop, req.prompt or ""))
        salt = tenant_salt(tenant, req.cache_salt)
        who = request_tenant(loop.engine.config.offload.tenant_source, req.cache_salt,
                             tenant)  # whose prefetch budget it spends
        try:
            found = await asyncio.wrap_future(
                loop.call(lambda: loop.engine.prefetch(prompt, cache_salt=salt, tenant=who)))
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        if found["limited_blocks"] and not found["fetching_blocks"]:
            raise ApiError(429, f"{found['limited_blocks']} blocks were not prefetched: this "
                           "tenant's prefetches are over their budget (half the host "
                           "memory tier per 10 s); retry in a few seconds",
                           "rate_limit_exceeded", "rate_limit_error")
        return JSONResponse({"object": "kv.prefetch", "model": served_name, **found})

    return router
