"""The routes about the server rather than a generation: GET /health (for a supervisor or
load balancer), /v1/models (the one served name, to a tenant), /metrics (Prometheus). None
of them puts work in the engine's queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvtier.engine.stats import RequestLog, engine_stats
from kvtier.server.engine_loop import EngineLoop, RequestFailed
from kvtier.server.metrics import Metrics
from kvtier.tier import TierStats


def admin_routes(loop: EngineLoop, served_name: str, metrics: Metrics,
                 tenant_of: Callable[[Request], str]) -> APIRouter:
    """`tenant_of` authenticates the model list (401) as it does the generation routes."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 (and why) when it is dead, stalled or draining."""
        why = loop.health()
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant_of(request)
        return {"object": "list", "data": [{"id": served_name, "object": "model",
                                             "created": 0, "owned_by": "kvtier"}]}

    @router.get("/metrics")
    async def prometheus() -> Response:
        def snapshot() -> tuple[dict[str, Any], int, int, TierStats | None]:
            s = loop.engine.scheduler  # counters and gauges only: no history is scanned
            tier = loop.engine.tier.report() if loop.engine.tier.enabled else None
            return (engine_stats(loop.engine, RequestLog(), tier), len(s.running),
                    len(s.waiting), tier)

        try:
            stats, running, waiting, tier = await asyncio.wrap_future(loop.call(snapshot))
        except RequestFailed:  # the engine is gone: what the counters said last
            stats, running, waiting, tier = {}, 0, 0, None
        metrics.refresh(stats, running=running, waiting=waiting, tier=tier)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return router
