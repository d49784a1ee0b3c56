"""The FastAPI app: OpenAI-compatible completions and chat and Anthropic's Messages,
residency in every response.

Every response says where the request's KV lived (`x-kvtier-residency`, a `tier.Residency`:
new | resident | host | disk | remote | recomputed) and `usage` carries OpenAI's
`prompt_tokens_details.cached_tokens` plus `restored_tokens`, `recomputed_tokens`,
`restore_ms`, and the engine's TTFT split (`ttft_ms` = `queue_ms` + `tier_ms` +
`compute_ms`). Tenants are API keys; each tenant's blocks live in its own hash namespace, so
one tenant can never hit, or time, another's.
Bad input is a 4xx in the API's own error shape (OpenAI's; Anthropic's on /v1/messages),
never a traceback.

This module only assembles: the error shape and who the caller is, then the routes of
`routes_admin` (health, models, metrics), `routes_completions` (completions, chat),
`routes_messages` (messages) and `routes_kv`.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.server.engine_loop import EngineLoop
from kvtier.server.metrics import Metrics
from kvtier.server.protocol import error_body
from kvtier.server.request_body import ApiError, default_max_request_bytes
from kvtier.server.responses import Responder
from kvtier.server.routes_admin import admin_routes
from kvtier.server.routes_completions import completion_routes
from kvtier.server.routes_kv import kv_routes
from kvtier.server.routes_messages import MESSAGES_PATH, message_routes
from kvtier.server.shapes_messages import error_body as anthropic_error
from kvtier.tier import MAX_TENANT_CHARS


def build_app(loop: EngineLoop, served_name: str, tenants: dict[str, str] | None = None,
              metrics: Metrics | None = None, max_request_bytes: int | None = None,
              tenant_header: str | None = None) -> FastAPI:
    """`tenants` maps API key -> tenant name; None means no authentication.
    `tenant_header`: without keys, the header the operator's router names each request's
    tenant in. `max_request_bytes`: a larger body is a 413 before it is read whole (default:
    sized to the model's context, `default_max_request_bytes`)."""
    metrics = metrics or Metrics()
    body_limit = max_request_bytes or default_max_request_bytes(loop.engine.max_model_len)
    tenant_of = authenticator(tenants, tenant_header)
    app = FastAPI(title="kvtier", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        metrics.observe_error(e.status)
        body = (anthropic_error(e.status, e.message) if request.url.path == MESSAGES_PATH
                else error_body(e.message, e.kind, e.code))
        return JSONResponse(body, status_code=e.status)

    # admin first: the routes (and /openapi.json) keep the order they always had
    app.include_router(admin_routes(loop, served_name, metrics, tenant_of))
    responder = Responder(loop, served_name, metrics)
    app.include_router(completion_routes(loop, served_name, responder, tenant_of, body_limit))
    app.include_router(message_routes(loop, served_name, responder, tenant_of, body_limit))
    app.include_router(kv_routes(loop, served_name, tenant_of, body_limit))
    return app


def authenticator(tenants: dict[str, str] | None,
                  tenant_header: str | None = None) -> Callable[[Request], str]:
    """The request's tenant from its bearer key (a 401 for a missing or unknown key); with
    no `tenants`, from the router's `tenant_header` (a 400 without it), else "" (no tenant:
    `kv_tenant_from` may name one)."""

    def tenant_of(request: Request) -> str:
        if tenants is None and tenant_header is not None:
            tenant = request.headers.get(tenant_header, "").strip()
            if not 0 < len(tenant) <= MAX_TENANT_CHARS:
                raise ApiError(400, f"the {tenant_header} header must name the request's tenant "
                               f"(1 to {MAX_TENANT_CHARS} characters); this server takes it "
                               "from the router in front of it", "invalid_tenant")
            return tenant
        if tenants is None:
            return ""
        auth = request.headers.get("authorization", "")
        key = (auth[7:].strip() if auth.lower().startswith("bearer ")
               else request.headers.get("x-api-key", "").strip())  # Anthropic's SDK's header
        if key not in tenants:
            raise ApiError(401, "invalid or missing API key; send 'Authorization: Bearer KEY' "
                           "(or 'x-api-key: KEY')", "invalid_api_key", "authentication_error")
        return tenants[key]

    return tenant_of
