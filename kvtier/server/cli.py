"""`kvtier serve`: the engine behind an OpenAI-compatible HTTP API on FastAPI + uvicorn."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.flags import add_engine_args, engine_knobs


def add_serve_args(sub: Any) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with residency in every response")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem)")
    p.add_argument("--api-key", default=None, help="require this key (one tenant, 'default')")
    p.add_argument("--api-keys-file", default=None,
                   help="JSON object mapping API key -> tenant name (one namespace each)")
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


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.config import EngineConfig
    from kvtier.engine.llm_engine import LLMEngine
    from kvtier.metrics import Metrics
    from kvtier.server.api import build_app
    from kvtier.server.engine_loop import EngineLoop

    tenants = load_tenants(args.api_key, args.api_keys_file)
    engine = LLMEngine(EngineConfig.from_knobs(model=args.model, **engine_knobs(args)))
    name = args.served_model_name or Path(engine.model_source).name.split(".")[0]
    loop = EngineLoop(engine)
    app = build_app(loop, name, tenants, Metrics())

    @app.on_event("startup")
    async def _start() -> None:
        loop.start()

    @app.on_event("shutdown")
    async def _stop() -> None:  # SIGTERM: abort what runs, release the pools
        aborted = loop.shutdown()
        print(f"kvtier serve: shut down; {aborted} in-flight requests aborted, pools released",
              flush=True)

    print(f"kvtier serve: model '{name}' on http://{args.host}:{args.port}/v1", flush=True)
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown, as servers do.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=10)
    return 0
