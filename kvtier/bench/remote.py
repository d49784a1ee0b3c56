"""Drive a running OpenAI-compatible server (kvtier serve, vLLM, SGLang...) with a trace.

Prompts go as token ids to /v1/completions, streamed, so TTFT is the first text chunk.
Where the server says so, the record takes its residency (`x-kvtier-residency`) and usage
extras. A server that only counts cached prompt tokens (vLLM with
`--enable-prompt-tokens-details`: its own prefix cache plus what a KV connector loaded) gets
"cached" when at least half of the session's earlier context was reused, else "recomputed"
(a first turn: "new"); a server that says neither gets "unknown". A turn's history grows by
the generated ids when the server returns them (`return_token_ids`, as kvtier and vLLM do),
else by the same number of stand-in ids: the server still sees a conversation of the right
length, but the reply part of its prefix cache cannot be reused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.run import ConfigRun, session_residency
from kvtier.errors import ConfigError
from kvtier.tier import Residency

STAND_IN_ID = 100  # first id of the stand-in tokens for replies a server does not return


def run_remote(url: str, trace: Any, name: str, model: str, api_key: str | None = None,
               on_request: Callable[[], None] | None = None, timeout_s: float = 600.0
               ) -> ConfigRun:
    """Replay `trace` against `url` in real time; one record per request."""
    import httpx

    run = ConfigRun(name, {"url": url, "model": model})
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ConfigError(f"--url {url}: the server does not answer ({e})") from None

    async def drive() -> None:
        limits = httpx.Limits(max_connections=trace.num_sessions + 4)
        async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                     timeout=httpx.Timeout(timeout_s)) as client:
            start = time.perf_counter()
            await asyncio.gather(*(
                _session(client, sid, reqs, model, start, run, on_request)
                for sid, reqs in trace.sessions().items()))

    start = time.perf_counter()
    asyncio.run(drive())
    run.wall_s = time.perf_counter() - start
    run.engine = {"host_tier": None, "rejected_requests": len(run.rejected)}
    return run


async def _session(client: Any, sid: str, reqs: list[Any], model: str, t0: float,
                   run: ConfigRun, on_request: Callable[[], None] | None) -> None:
    history: list[int] = []
    await asyncio.sleep(max(0.0, reqs[0].arrival_s - (time.perf_counter() - t0)))
    for turn, req in enumerate(reqs):
        if turn:
            await asyncio.sleep(req.arrival_s)  # think time after the previous answer
        prompt = history + list(req.new_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": req.output_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        sent = time.perf_counter() - t0
        record = await _one(client, body, sid, turn, sent, t0, run, len(history),
                            len(req.new_tokens))
        if record is None:
            return  # the session ends where the server refused it
        history = prompt + record.pop("_token_ids")
        run.records.append(record)
        if on_request is not None:
            on_request()


async def _one(client: Any, body: dict[str, Any], sid: str, turn: int, sent: float,
               t0: float, run: ConfigRun, prior: int, new: int) -> dict[str, Any] | None:
    first: float | None = None
    last = sent
    ids: list[int] | None = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                run.rejected.append({"request": f"{sid}/{turn}",
                                     "reason": f"HTTP {r.status_code} "
                                               f"{(await r.aread()).decode()[:200]}",
                                     "prompt_tokens": len(body["prompt"])})
                return None
            residency = r.headers.get("x-kvtier-residency")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice.get("text") and first is None:
                        first = time.perf_counter() - t0
                    last = time.perf_counter() - t0
                    ids = choice.get("token_ids") or ids
    except Exception as e:  # a dropped connection ends the session, not the run
        run.rejected.append({"request": f"{sid}/{turn}", "reason": f"{type(e).__name__}: {e}",
                             "prompt_tokens": len(body["prompt"])})
        return None
    n = int(usage.get("completion_tokens", body["max_tokens"]))
    details = usage.get("prompt_tokens_details") or {}
    if residency is None:
        residency = _from_cached(details.get("cached_tokens"), turn, prior)
    residency = session_residency(residency, turn)
    first = first if first is not None else last
    split = _split(usage, first - sent)
    return {
        "config": run.name, "session_id": sid, "turn": turn,
        "context_tokens": len(body["prompt"]), "new_tokens": new, "output_tokens": n,
        "ttft_s": first - sent,
        "itl_s": (last - first) / (n - 1) if n > 1 else None, "residency": residency,
        "restored_tokens": usage.get("restored_tokens", 0),
        "recomputed_tokens": usage.get("recomputed_tokens", 0),
        # the device's share: a server's cached_tokens counts its restored tokens too
        "cached_tokens": max(0, (details.get("cached_tokens") or 0)
                             - usage.get("restored_tokens", 0)),
        "restore_bytes": 0, "restore_s": usage.get("restore_ms", 0.0) / 1e3,
        **split, "arrival_s": sent, "finish_s": last,
        "_token_ids": list(ids) if ids else [STAND_IN_ID + k % 1000 for k in range(n)],
    }


def _split(usage: dict[str, Any], ttft_s: float) -> dict[str, float | None]:
    """The server's queue / tier / compute parts (kvtier's usage extension) in seconds, with
    what the client saw beyond the server's own TTFT (HTTP, the server's event loop) added
    to the queue part, so the parts add up to the TTFT measured here. None where the server
    does not report them."""
    ms = [usage.get(f"{k}_ms") for k in ("ttft", "queue", "tier", "compute")]
    if any(not isinstance(v, (int, float)) for v in ms):
        return {"queue_s": None, "tier_s": None, "compute_s": None}
    ttft, queue, tier, compute = (v / 1e3 for v in ms)
    return {"queue_s": queue + max(0.0, ttft_s - ttft), "tier_s": tier, "compute_s": compute}


def _from_cached(cached: int | None, turn: int, prior: int) -> str:
    """Residency from a server's cached-token count alone (vLLM's usage details)."""
    if cached is None:
        return "unknown"
    if turn == 0:
        return "cached" if cached else Residency.NEW.value
    return "cached" if cached >= prior / 2 else Residency.RECOMPUTED.value
