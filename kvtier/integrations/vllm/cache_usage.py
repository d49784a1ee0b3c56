"""vLLM's answer to a request that asked caching fields, its usage rewritten by the
provider's definitions: vLLM reports the tokens read only (with
`--enable-prompt-tokens-details`) and 0 cache-creation tokens on its Anthropic endpoint.
What kvtier's connector says it read and how far each grant keeps the prompt
(`kvtier_read_tokens`, `kvtier_retention_kept`, `kvtier_cache_breakpoints_kept` in the
answer's `kv_transfer_params`) becomes OpenAI's `cached_tokens` and `cache_write_tokens`,
and Anthropic's `cache_read_input_tokens`, `cache_creation_input_tokens` (split by ttl) and
`input_tokens`, counted as `kvtier serve` counts them (`server/prompt_cache.kept_usage`);
a Responses prewarm's answer loses the one token the engine had to sample.

Whole answers only: a streamed one goes on as vLLM wrote it (its chunks carry no
`kv_transfer_params` to read the grants from)."""

from __future__ import annotations

import enum
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvtier.server.prompt_cache import CacheUsage, kept_usage
from kvtier.server.protocol import DAY_S, TTL_S
from kvtier.server.protocol_messages import CACHE_TTL_S
from kvtier.server.shapes_responses import TTL_FIELDS as RESPONSES_TTL_FIELDS

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

# a grant's seconds -> the lifetime label each API splits its usage by
OPENAI_LABELS = {**{s: ttl for ttl, s in TTL_S.items()}, DAY_S: "24h"}
ANTHROPIC_LABELS = {s: ttl for ttl, s in CACHE_TTL_S.items()}
TTL_FIELDS = {"5m": "ephemeral_5m_input_tokens", "1h": "ephemeral_1h_input_tokens"}


class Api(enum.Enum):
    """Whose answer it is: its usage's shape."""

    CHAT = "chat"  # OpenAI's Chat Completions and Completions
    RESPONSES = "responses"  # OpenAI's Responses API
    MESSAGES = "messages"  # Anthropic's Messages API


def usage_from(params: Any, labels: dict[float, str]) -> CacheUsage | None:
    """What the connector's answer says was read and written, by lifetime label; None where
    it says nothing of it (a request that asked no caching field, or an older connector)."""
    if not isinstance(params, dict):
        return None
    read = params.get("kvtier_read_tokens")
    if isinstance(read, bool) or not isinstance(read, int):
        return None
    kept: list[tuple[int, str]] = []
    retained, granted = params.get("kvtier_retention_kept"), params.get("kvtier_retention_s")
    if isinstance(retained, int) and isinstance(granted, (int, float)):
        kept.append((retained, labels.get(float(granted), f"{granted:g}s")))
    ends = params.get("kvtier_cache_breakpoints_kept")
    grants = params.get("kvtier_cache_breakpoints_s")
    if isinstance(ends, list) and isinstance(grants, list):
        kept += [(end, labels.get(float(s), f"{s:g}s")) for end, s in zip(ends, grants)
                 if isinstance(end, int) and isinstance(s, (int, float))]
    return kept_usage(read, kept)


def rewritten(body: dict[str, Any], api: Api, prewarm: bool = False) -> bool:
    """`body` (a whole answer) with its usage by the API's definitions, and for a prewarm
    (Responses) no output; False where it has nothing to rewrite by."""
    usage = body.get("usage")
    cache = usage_from(body.get("kv_transfer_params"),
                       ANTHROPIC_LABELS if api is Api.MESSAGES else OPENAI_LABELS)
    if cache is None or not isinstance(usage, dict):
        return False
    if api is Api.RESPONSES:
        details = usage.get("input_tokens_details")
        usage["input_tokens_details"] = {
            **(details if isinstance(details, dict) else {}), "cached_tokens": cache.read,
            "cache_write_tokens": cache.written,
            "cache_write_tokens_details": {name: cache.written_by_ttl.get(ttl, 0)
                                           for ttl, name in RESPONSES_TTL_FIELDS.items()}}
        if prewarm:  # the one token the engine sampled is never shown
            body["output"] = []
            usage["output_tokens"] = 0
            usage["total_tokens"] = usage.get("input_tokens", 0)
        return True
    if api is Api.MESSAGES:
        prompt = sum(int(usage.get(k) or 0) for k in (
            "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        usage.update({"input_tokens": max(0, prompt - cache.read - cache.written),
                      "cache_read_input_tokens": cache.read,
                      "cache_creation_input_tokens": cache.written,
                      "cache_creation": {name: cache.written_by_ttl.get(ttl, 0)
                                         for ttl, name in TTL_FIELDS.items()}})
        return True
    details = usage.get("prompt_tokens_details")
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                      "cached_tokens": cache.read,
                                      "cache_write_tokens": cache.written}
    return True


class UsageRewriter:
    """A `send` that holds a whole JSON answer until its last byte, rewrites its usage
    (`rewritten`) and sends it with its new length; anything else (a stream, an error, a
    body that is no JSON object) goes on untouched."""

    def __init__(self, send: Send, api: Api, prewarm: bool = False) -> None:
        self.send = send
        self.api = api
        self.prewarm = prewarm
        self._start: Message | None = None
        self._body = bytearray()
        self._passing = False

    async def __call__(self, message: Message) -> None:
        if self._passing:
            await self.send(message)
            return
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            whole = (message.get("status") == 200 and
                     headers.get(b"content-type", b"").startswith(b"application/json"))
            if not whole:
                self._passing = True
                await self.send(message)
                return
            self._start = message
            return
        if message["type"] != "http.response.body" or self._start is None:
            await self.send(message)
            return
        self._body += message.get("body", b"")
        if message.get("more_body", False):
            return
        await self._finish()

    async def _finish(self) -> None:
        assert self._start is not None
        body = bytes(self._body)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            data = None
        if isinstance(data, dict) and rewritten(data, self.api, self.prewarm):
            body = json.dumps(data).encode()
        headers = [(k, v) for k, v in self._start.get("headers", [])
                   if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**self._start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
