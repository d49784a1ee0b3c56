"""`kvtier serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.engine.flags import add_engine_args, engine_knobs
from kvtier.errors import ConfigError
from kvtier.tier import TierConfig, tenant_rule

DRAIN_SLACK_S = 5.0  # after the drain, time for the ended responses to reach their clients
MAX_HEADER_BYTES = 64 * 1024  # a request's headers, beyond which uvicorn answers 400


def add_serve_args(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with residency in every response")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem)")
    p.add_argument("--api-key", default=None, help="require this key (one tenant, 'default')")
    p.add_argument("--api-keys-file", default=None,
                   help="JSON object mapping API key -> tenant name (one namespace each)")
    p.add_argument("--tenant-header", default=None,
                   help="without API keys: the header (e.g. X-Tenant) in which the router in "
                        "front of this server names each request's tenant, for quotas and "
                        "counters (one namespace each); a request without it is refused")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger request bodies are refused with 413 (default: sized to the "
                        "model's context)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers before the "
                        "connection is closed")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="SIGTERM: seconds running requests get to finish before they are ended")
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def load_tenants(api_key: str | None, keys_file: str | None) -> dict[str, str] | None:
    """None (no auth), or API key -> tenant; a bad keys file is a ConfigError naming it."""
    tenants: dict[str, str] = {}
    if keys_file:
        path = Path(keys_file)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--api-keys-file '{path}' is not readable JSON: {e}") from None
        if not isinstance(data, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k for k, v in data.items()):
            raise ConfigError(f"--api-keys-file '{path}' must be a JSON object of "
                              '"key": "tenant" strings')
        tenants.update(data)
    if api_key:
        tenants[api_key] = "default"
    return tenants or None


def tenant_line(tenants: dict[str, str] | None, header: str | None, offload: TierConfig
                ) -> tuple[str, bool]:
    """The startup line on what names a request's tenant (and whether it warns: quotas that
    separate no one), or a ConfigError: both keys and a header, or a named quota no request
    can ever be (with API keys, a tenant no key is for: a typo, never a silent no-op)."""
    if tenants is not None and header is not None:
        raise ConfigError("give API keys (--api-key, --api-keys-file) or --tenant-header, not "
                          "both: with keys, each request's tenant is its key's")
    if tenants is not None:
        unknown = sorted(set(offload.kv_tenant_quotas) - set(tenants.values()))
        if unknown:
            raise ConfigError(f"kv_tenant_quotas names {', '.join(map(repr, unknown))}, which "
                              f"no API key is for; the tenants are: "
                              f"{', '.join(sorted(set(tenants.values())))}")
    by = ("API keys" if tenants is not None else
          f"the router's {header} header" if header is not None else None)
    return tenant_rule(offload.tenant_source, offload.kv_tenant_quotas, offload.quota_set, by)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.config import EngineConfig
    from kvtier.engine.llm_engine import LLMEngine
    from kvtier.server.api import build_app
    from kvtier.server.engine_loop import EngineLoop
    from kvtier.server.metrics import Metrics

    tenants = load_tenants(args.api_key, args.api_keys_file)
    engine_config = EngineConfig.from_knobs(model=args.model, **engine_knobs(args))
    line, warn = tenant_line(tenants, args.tenant_header, engine_config.offload)
    engine = LLMEngine(engine_config)
    name = args.served_model_name or Path(engine.model_source).name.split(".")[0]
    metrics = Metrics()
    server: Any = None

    def engine_died() -> None:  # from the engine thread: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    loop = EngineLoop(engine, on_death=engine_died, on_finished=metrics.observe_request)
    app = build_app(loop, name, tenants, metrics, args.max_request_bytes, args.tenant_header)

    @app.on_event("startup")
    async def _start() -> None:
        loop.start()

    @app.on_event("shutdown")
    async def _stop() -> None:  # after the drain: end what is left, write the tiers down
        left = loop.shutdown()
        print(f"kvtier serve: shut down; {left} requests still open were ended (503), pools "
              "released", flush=True)

    print(f"kvtier serve: {'warning: ' if warn else ''}{line}", flush=True)
    print(f"kvtier serve: model '{name}' on http://{args.host}:{args.port}/v1", flush=True)
    from kvtier.server.http import header_deadline_protocol

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=header_deadline_protocol(args.header_timeout),
                            timeout_graceful_shutdown=args.shutdown_timeout + DRAIN_SLACK_S,
                            timeout_keep_alive=5, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    server = _draining_server(config, loop, args.shutdown_timeout)
    server.run()
    if loop.dead is not None:
        print(f"kvtier serve: exiting because the engine died: {loop.health()}", flush=True)
        return 1
    return 0


def _draining_server(config: Any, loop: Any, shutdown_timeout: float) -> Any:
    """uvicorn's server, whose SIGTERM first drains: admission stops (503), running requests
    get `shutdown_timeout` seconds to finish, then what is still open ends with an error."""
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not loop.draining:
                loop.draining = True
                timer = threading.Timer(shutdown_timeout, loop.fail_open,
                                        ("the server is shutting down", 503))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    return DrainingServer(config)
