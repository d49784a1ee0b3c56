"""OpenAI's prompt caching fields for `vllm serve`, as kvtier's connector takes them:

    vllm serve ... --middleware kvtier.integrations.vllm.middleware.KvtierCacheFields

An ASGI middleware on Chat Completions and Completions: `prompt_cache_options` (implicit
mode: the whole prompt kept `ttl`), the deprecated `prompt_cache_retention: "24h"`, and
`prompt_cache_breakpoint` on chat content parts become the connector's asks in the request's
`kv_transfer_params` (`kvtier_retention_s`, `kvtier_cache_breakpoints`: [[tokens, seconds]]),
answered in the response's `kv_transfer_params`. A breakpoint's tokens are counted by vLLM's
own `/tokenize` on the messages cut after its part, so they are the tokens vLLM's template
makes. The fields vLLM does not know are taken out of the body; what OpenAI refuses is a 400
in its shape, and a body this middleware cannot read goes on to vLLM untouched."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import ValidationError

from kvtier.server.protocol import (
    DAY_S,
    DEFAULT_TTL,
    MAX_BREAKPOINTS,
    TTL_S,
    PromptCacheBreakpoint,
    PromptCacheOptions,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATHS = ("/v1/chat/completions", "/v1/completions")
FIELDS = ("prompt_cache_options", "prompt_cache_retention")
MAX_BODY = 64 << 20  # larger bodies go on untouched (vLLM bounds them itself)


class CacheFieldError(Exception):
    """A caching field OpenAI would refuse: a 400 naming it."""


class KvtierCacheFields:
    """The middleware vLLM's `--middleware` loads (a class: `app.add_middleware`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        body, more = await _read(receive)
        data = _json(body) if not more else None
        if not isinstance(data, dict) or not _asks_cache(data):
            await self.app(scope, _replay(body, receive, more), send)
            return
        try:
            asks = await self._asks(scope, data)
        except CacheFieldError as e:
            await _error(send, str(e))
            return
        _strip(data)
        params = data.get("kv_transfer_params")
        data["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), **asks}
        new = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        await self.app({**scope, "headers": headers}, _replay(new, receive, False), send)

    async def _asks(self, scope: Scope, data: dict[str, Any]) -> dict[str, Any]:
        """The connector's asks for the request's caching fields (CacheFieldError: a value
        OpenAI refuses)."""
        options = _options(data.get("prompt_cache_options"))
        retention = data.get("prompt_cache_retention")
        if retention not in (None, "in_memory", "24h"):
            raise CacheFieldError("prompt_cache_retention: must be 'in_memory' or '24h'")
        if options is not None and options.ttl is not None and retention is not None:
            raise CacheFieldError("prompt_cache_retention is deprecated and cannot be sent "
                                  "with prompt_cache_options.ttl; send "
                                  "prompt_cache_options.ttl alone")
        ttl = TTL_S[options.ttl or DEFAULT_TTL] if options is not None else TTL_S[DEFAULT_TTL]
        asks: dict[str, Any] = {}
        if retention == "24h":
            asks["kvtier_retention_s"] = DAY_S
        elif options is not None and options.mode == "implicit":
            asks["kvtier_retention_s"] = ttl  # the implicit breakpoint: the whole prompt
        marks = _marks(data.get("messages"))
        if marks:
            asks["kvtier_cache_breakpoints"] = await self._breakpoints(scope, data, marks, ttl)
        return asks

    async def _breakpoints(self, scope: Scope, data: dict[str, Any],
                           marks: list[tuple[int, int, PromptCacheBreakpoint]], ttl: float
                           ) -> list[list[float]]:
        """[[tokens, seconds]] per breakpoint: the tokens vLLM's template makes of the
        messages up to the end of its part, as far as they agree with the whole prompt's."""
        messages = _stripped(data["messages"])
        whole = await self._tokenize(scope, {"model": data.get("model"), "messages": messages,
                                             "add_generation_prompt": True})
        out = []
        for i, j, mark in marks:
            cut = [*messages[:i], {**messages[i], "content": messages[i]["content"][:j + 1]}]
            head = await self._tokenize(scope, {"model": data.get("model"), "messages": cut,
                                                "add_generation_prompt": False,
                                                "continue_final_message": True})
            n = 0
            while n < min(len(head), len(whole)) and head[n] == whole[n]:
                n += 1
            out.append([n, TTL_S[mark.ttl] if mark.ttl else ttl])
        return out

    async def _tokenize(self, scope: Scope, body: dict[str, Any]) -> list[int]:
        """vLLM's own POST /tokenize, called in process (the caller's headers kept: its
        API key)."""
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())]
        inner = {**scope, "path": "/tokenize", "raw_path": b"/tokenize", "query_string": b"",
                 "headers": headers}
        status, chunks = 500, []

        async def collect(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        await self.app(inner, _replay(raw, _never, False), collect)
        answer = _json(b"".join(chunks))
        if status != 200 or not isinstance(answer, dict) or \
                not isinstance(answer.get("tokens"), list):
            message = answer.get("error", {}).get("message") if isinstance(answer, dict) \
                and isinstance(answer.get("error"), dict) else None
            raise CacheFieldError(f"the messages could not be tokenized to place their cache "
                                  f"breakpoints ({message or f'status {status}'})")
        return [int(t) for t in answer["tokens"]]


def _asks_cache(data: dict[str, Any]) -> bool:
    return any(data.get(f) is not None for f in FIELDS) or bool(_has_marks(data))


def _has_marks(data: dict[str, Any]) -> bool:
    messages = data.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and "prompt_cache_breakpoint" in p for p in m["content"])
        for m in messages)


def _options(raw: Any) -> PromptCacheOptions | None:
    if raw is None:
        return None
    try:
        return PromptCacheOptions.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CacheFieldError(f"prompt_cache_options{'.' + where if where else ''}: "
                              f"{first['msg']}") from None


def _marks(messages: Any) -> list[tuple[int, int, PromptCacheBreakpoint]]:
    """(message, part, breakpoint) of each marked content part, in prompt order."""
    if not isinstance(messages, list):
        return []
    out = []
    for i, m in enumerate(messages):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            if isinstance(part, dict) and "prompt_cache_breakpoint" in part:
                try:
                    mark = PromptCacheBreakpoint.model_validate(part["prompt_cache_breakpoint"])
                except ValidationError as e:
                    first = e.errors()[0]
                    where = ".".join(str(p) for p in first["loc"])
                    raise CacheFieldError(f"messages.{i}.content.{j}.prompt_cache_breakpoint"
                                          f"{'.' + where if where else ''}: {first['msg']}"
                                          ) from None
                out.append((i, j, mark))
    if len(out) > MAX_BREAKPOINTS:
        raise CacheFieldError(f"{len(out)} content parts carry prompt_cache_breakpoint; a "
                              f"request writes at most {MAX_BREAKPOINTS}")
    return out


def _stripped(messages: list[Any]) -> list[Any]:
    """The messages without the breakpoint marks vLLM does not know."""
    return [{**m, "content": [{k: v for k, v in p.items() if k != "prompt_cache_breakpoint"}
                              if isinstance(p, dict) else p for p in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m
            for m in messages]


def _strip(data: dict[str, Any]) -> None:
    for f in FIELDS:
        data.pop(f, None)
    if isinstance(data.get("messages"), list):
        data["messages"] = _stripped(data["messages"])


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


async def _read(receive: Receive) -> tuple[bytes, bool]:
    """The body (up to MAX_BODY), and whether more of it is still to come."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(body), False
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body), False
        if len(body) > MAX_BODY:
            return bytes(body), True


def _replay(body: bytes, receive: Receive, more: bool) -> Receive:
    """A receive that hands `body` over first, then (`more`: the rest of the client's body,
    else) what the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()

    return replay


async def _never() -> Message:
    """An in-process call's client never goes away: wait until the call is over."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}  # never reached: cancelled with its call


async def _error(send: Send, message: str) -> None:
    """A 400 in OpenAI's error shape."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
