"""The client's asks of its KV by prompt. POST /v1/kv/prefetch: a client that knows a
session comes back soon (an agent whose tool call is about to return) asks for its prefix to
be brought up from disk or the shared store into host memory now, so the request that follows
wakes from host; nothing is computed, the answer says what was found, what is on its way up,
and from where. DELETE /v1/kv: the prompt's blocks purged from every tier, provably (a disk
slot overwritten, a file or a key deleted), the answer counting what went and what stayed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvtier.engine.llm_engine import PromptType
from kvtier.errors import KvtierError
from kvtier.server.engine_loop import EngineLoop
from kvtier.server.protocol import KvPromptRequest, KvPurgeRequest, tenant_salt
from kvtier.server.request_body import ApiError, json_body, read_body, validated
from kvtier.server.routes_completions import chat_prompt, completion_prompt, guarded
from kvtier.tier import request_tenant


def kv_routes(loop: EngineLoop, served_name: str, tenant_of: Callable[[Request], str],
              body_limit: int) -> APIRouter:
    """The KV routes; authenticated (401) and bounded (413) as the generation routes are."""
    router = APIRouter()

    async def body(request: Request, kind: type[KvPromptRequest]
                   ) -> tuple[str, KvPromptRequest]:
        """The caller's tenant and its body, checked."""
        tenant = tenant_of(request)
        req = validated(kind, json_body(await read_body(request, body_limit)))
        assert isinstance(req, kind)
        try:
            req.check()
        except KvtierError as e:
            raise ApiError(400, str(e)) from None
        if req.model not in (None, served_name, "default"):
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves "
                           f"'{served_name}'", "model_not_found")
        return tenant, req

    async def prompt_of(req: KvPromptRequest) -> PromptType:
        return await (chat_prompt(loop, req.messages) if req.messages is not None
                      else completion_prompt(loop, req.prompt or ""))

    async def on_engine(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return await asyncio.wrap_future(loop.call(work))
        except KvtierError as e:
            raise ApiError(400, str(e)) from None

    @router.post("/v1/kv/prefetch")
    @guarded
    async def prefetch(request: Request) -> JSONResponse:
        tenant, req = await body(request, KvPromptRequest)
        prompt = await prompt_of(req)
        salt = tenant_salt(tenant, req.cache_salt)
        who = request_tenant(loop.engine.config.offload.tenant_source, req.cache_salt,
                             tenant)  # whose prefetch budget it spends
        found = await on_engine(lambda: loop.engine.prefetch(prompt, cache_salt=salt,
                                                             tenant=who))
        if found["limited_blocks"] and not found["fetching_blocks"]:
            raise ApiError(429, f"{found['limited_blocks']} blocks were not prefetched: this "
                           "tenant's prefetches are over their budget (half the host "
                           "memory tier per 10 s); retry in a few seconds",
                           "rate_limit_exceeded", "rate_limit_error")
        return JSONResponse({"object": "kv.prefetch", "model": served_name, **found})

    @router.delete("/v1/kv")
    @guarded
    async def purge(request: Request) -> JSONResponse:
        """The prompt's blocks, in the caller's own namespace (or with `scope` "tenant",
        every block its tenant owns), removed from every tier and erased below host before
        the answer (a disk slot overwritten, a file or a key deleted); what a running request
        still uses is kept and counted."""
        tenant, req = await body(request, KvPurgeRequest)
        if isinstance(req, KvPurgeRequest) and req.scope == "tenant":
            if not tenant:  # every client is the one tenant: it would erase everyone's
                raise ApiError(400, "this server names no tenants (--api-keys-file or "
                               "--tenant-header): a purge of scope 'tenant' would erase every "
                               "client's KV; purge by prompt instead")
            who = request_tenant(loop.engine.config.offload.tenant_source, None, tenant)
            done = await on_engine(lambda: loop.engine.purge_tenant(who))
            return JSONResponse({"object": "kv.purge", "model": served_name, **done})
        prompt = await prompt_of(req)
        salt = tenant_salt(tenant, req.cache_salt)
        done = await on_engine(lambda: loop.engine.purge(prompt, cache_salt=salt))
        return JSONResponse({"object": "kv.purge", "model": served_name, **done})

    return router
