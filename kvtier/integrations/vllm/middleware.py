"""OpenAI's and Anthropic's prompt caching fields for `vllm serve`, as kvtier's connector
takes them:

    vllm serve ... --middleware kvtier.integrations.vllm.middleware.KvtierCacheFields

An ASGI middleware on Chat Completions and Completions (`prompt_cache_options`, implicit
mode: the whole prompt kept `ttl`; the deprecated `prompt_cache_retention: "24h"`;
`prompt_cache_breakpoint` on chat content parts) and on Messages (`cache_control` on a
system or message block, or at the top level: the last block, 5m | 1h): they become the
connector's asks in the request's
`kv_transfer_params` (`kvtier_retention_s`, `kvtier_cache_breakpoints`: [[tokens, seconds]]),
answered in the response's `kv_transfer_params`, and a whole answer's usage counted by the
provider's definitions (`cache_usage.py`). A breakpoint's tokens are counted by vLLM's
own `/tokenize` on the messages cut after its part, so they are the tokens vLLM's template
makes. The fields vLLM does not know are taken out of the body; what OpenAI refuses is a 400
in its shape, and a body this middleware cannot read goes on to vLLM untouched.

`DELETE /v1/kv` purges a prompt's blocks from kvtier's tiers as `kvtier serve` does, through
the connector's `kvtier_purge` ask."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import ValidationError

from kvtier.errors import RequestError
from kvtier.integrations.vllm.cache_usage import Api, UsageRewriter
from kvtier.server.protocol import (
    DAY_S,
    DEFAULT_TTL,
    TTL_S,
    PromptCacheBreakpoint,
    PromptCacheOptions,
    check_breakpoints,
    check_one_prompt,
)
from kvtier.server.protocol_messages import CACHE_TTL_S, CacheControl, check_controls
from kvtier.server.protocol_responses import ResponsesCacheOptions

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATHS = ("/v1/chat/completions", "/v1/completions")
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"  # Anthropic's, which vLLM serves too
KV = "/v1/kv"  # DELETE: a prompt's KV purged from every tier below vLLM's GPU
FIELDS = ("prompt_cache_options", "prompt_cache_retention")
MAX_BODY = 64 << 20  # larger bodies go on untouched (vLLM bounds them itself)


class CacheFieldError(Exception):
    """A caching field OpenAI would refuse: a 400 naming it."""


class KvtierCacheFields:
    """The middleware vLLM's `--middleware` loads (a class: `app.add_middleware`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope.get("type") == "http" and scope.get("method") == "DELETE" and path == KV:
            await self._purge(scope, receive, send)
            return
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                path not in (*PATHS, RESPONSES, MESSAGES):
            await self.app(scope, receive, send)
            return
        api = Api.MESSAGES if path == MESSAGES else Api.RESPONSES if path == RESPONSES \
            else Api.CHAT
        anthropic = api is Api.MESSAGES
        body, more = await _read(receive)
        data = _json(body) if not more else None
        if not isinstance(data, dict) or not (_asks_cache_control(data) if anthropic
                                              else _asks_cache(data, api)):
            await self.app(scope, _replay(body, receive, more), send)
            return
        prewarm = False
        try:
            if anthropic:
                asks = await self._cache_control(scope, data)
            else:
                asks = await self._asks(scope, data, api)
                prewarm = _prewarm(data, api)
        except CacheFieldError as e:
            await _error(send, str(e), anthropic)
            return
        _strip(data)
        if prewarm:  # the prompt is computed and written; the one token sampled is hidden
            data["max_output_tokens"] = 1
        params = data.get("kv_transfer_params")
        data["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), **asks}
        new = json.dumps(data).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        answer = send if data.get("stream") else UsageRewriter(send, api, prewarm)
        await self.app({**scope, "headers": headers}, _replay(new, receive, False), answer)

    async def _asks(self, scope: Scope, data: dict[str, Any], api: Api) -> dict[str, Any]:
        """The connector's asks for the request's caching fields (CacheFieldError: a value
        OpenAI refuses)."""
        options = _options(data.get("prompt_cache_options"), api)
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
        responses = api is Api.RESPONSES
        marks = _marks(_input(data) if responses else data.get("messages"),
                       "input" if responses else "messages")
        if marks:
            chat = _responses_chat(data) if responses else data["messages"]
            shift = len(chat) - len(_input(data)) if responses else 0  # the instructions
            asks["kvtier_cache_breakpoints"] = await self._breakpoints(
                scope, data.get("model"), chat, [(i + shift, j, m) for i, j, m in marks], ttl)
        return asks

    async def _breakpoints(self, scope: Scope, model: Any, chat: list[Any],
                           marks: list[tuple[int, int, PromptCacheBreakpoint]], ttl: float
                           ) -> list[list[float]]:
        """[[tokens, seconds]] per breakpoint: the tokens vLLM's template makes of the
        messages (`chat`, as vLLM renders the request) up to the end of its part, as far as
        they agree with the whole prompt's."""
        messages = _stripped(chat)
        whole = await self._tokenize(scope, {"model": model, "messages": messages,
                                             "add_generation_prompt": True})
        out = []
        for i, j, mark in marks:
            cut = [*messages[:i], {**messages[i], "content": messages[i]["content"][:j + 1]}]
            head = await self._tokenize(scope, {"model": model, "messages": cut,
                                                "add_generation_prompt": False,
                                                "continue_final_message": True})
            out.append([_common(head, whole), TTL_S[mark.ttl] if mark.ttl else ttl])
        return out

    async def _cache_control(self, scope: Scope, data: dict[str, Any]) -> dict[str, Any]:
        """Anthropic's `cache_control` blocks (and the top-level one: the last block) as the
        connector's breakpoints, each block's tokens as vLLM renders its Messages request."""
        marks = _controls(data)
        model = data.get("model")
        whole = await self._tokenize(scope, {"model": model, "messages": _as_chat(data),
                                             "add_generation_prompt": True})
        out = []
        for where, control in marks:
            head = await self._tokenize(scope, {"model": model,
                                                "messages": _as_chat(data, where),
                                                "add_generation_prompt": False,
                                                "continue_final_message": True})
            out.append([_common(head, whole), CACHE_TTL_S[control.ttl]])
        return {"kvtier_cache_breakpoints": out}

    async def _tokenize(self, scope: Scope, body: dict[str, Any]) -> list[int]:
        """vLLM's own POST /tokenize, called in process (the caller's headers kept: its
        API key)."""
        status, answer = await self._call(scope, "/tokenize", body)
        if status != 200 or not isinstance(answer, dict) or \
                not isinstance(answer.get("tokens"), list):
            message = answer.get("error", {}).get("message") if isinstance(answer, dict) \
                and isinstance(answer.get("error"), dict) else None
            raise CacheFieldError(f"the messages could not be tokenized to place their cache "
                                  f"breakpoints ({message or f'status {status}'})")
        return [int(t) for t in answer["tokens"]]

    async def _call(self, scope: Scope, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST `body` to vLLM's own `path`, in process (the caller's headers kept: its API
        key): the status and the JSON answer (None if it is none)."""
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())]
        inner = {**scope, "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": headers}
        status, chunks = 500, []

        async def collect(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        await self.app(inner, _replay(raw, _never, False), collect)
        return status, _json(b"".join(chunks))

    async def _purge(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`DELETE /v1/kv` as `kvtier serve` takes it (a `prompt`, text or token ids, or
        chat `messages`; `cache_salt`): the prompt runs once with `kvtier_purge`, and the
        connector erases its blocks from host and every tier below when it ends. vLLM's own
        GPU prefix cache keeps its copy (vLLM's `reset_prefix_cache` clears it)."""
        body, more = await _read(receive)
        data = _json(body) if not more else None
        try:
            if not isinstance(data, dict):
                raise RequestError("the request body must be a JSON object")
            check_one_prompt(data.get("prompt"), data.get("messages"))
        except RequestError as e:
            await _error(send, str(e))
            return
        ask: dict[str, Any] = {"max_tokens": 1, "kv_transfer_params": {"kvtier_purge": True},
                               **{k: data[k] for k in ("model", "cache_salt") if k in data}}
        if data.get("messages") is not None:
            path, ask["messages"] = "/v1/chat/completions", data["messages"]
        else:
            path, ask["prompt"] = "/v1/completions", data["prompt"]
        status, answer = await self._call(scope, path, ask)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        done = params.get("kvtier_purge") if isinstance(params, dict) else None
        if status != 200 or not isinstance(done, dict):
            error = answer if status != 200 and isinstance(answer, dict) else {"error": {
                "message": "the KV connector did not answer the purge: is kvtier's "
                           "connector configured?", "type": "server_error"}}
            raw = json.dumps(error).encode()
            await _send_json(send, status if status != 200 else 501, raw)
            return
        raw = json.dumps({"object": "kv.purge", "model": answer.get("model"), **done}).encode()
        await _send_json(send, 200, raw)


def _common(head: list[int], whole: list[int]) -> int:
    """How many leading tokens `head` shares with `whole`."""
    n = 0
    while n < min(len(head), len(whole)) and head[n] == whole[n]:
        n += 1
    return n


# -- Anthropic's Messages: where each cache_control block ends ------------------------------

Where = tuple[int, int]  # (-1, block): the system's; (message, block)


def _asks_cache_control(data: dict[str, Any]) -> bool:
    blocks = [*_blocks(data.get("system"))] + [
        b for m in data.get("messages") or [] if isinstance(m, dict)
        for b in _blocks(m.get("content"))]
    return data.get("cache_control") is not None or any("cache_control" in b for b in blocks)


def _blocks(content: Any) -> list[dict[str, Any]]:
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _controls(data: dict[str, Any]) -> list[tuple[Where, CacheControl]]:
    """(where, cache_control) of each marked block in prompt order, the top-level one on the
    last block; CacheFieldError for what Anthropic refuses."""
    found: list[tuple[Where, Any]] = []
    for j, b in enumerate(_blocks(data.get("system"))):
        if b.get("cache_control") is not None:
            found.append(((-1, j), b["cache_control"]))
    messages = data.get("messages") if isinstance(data.get("messages"), list) else []
    for i, m in enumerate(messages):
        for j, b in enumerate(_blocks(m.get("content") if isinstance(m, dict) else None)):
            if b.get("cache_control") is not None:
                found.append(((i, j), b["cache_control"]))
    if data.get("cache_control") is not None and messages:
        last = len(messages) - 1
        content = messages[last].get("content") if isinstance(messages[last], dict) else None
        where = (last, len(content) - 1) if isinstance(content, list) and content \
            else (last, -1)  # a string: the whole message
        if all(w != where for w, _ in found):
            found.append((where, data["cache_control"]))
    out = []
    for where, raw in found:
        try:
            out.append((where, CacheControl.model_validate(raw)))
        except ValidationError as e:
            first = e.errors()[0]
            at = "system" if where[0] < 0 else f"messages.{where[0]}.content"
            field = ".".join(str(p) for p in first["loc"])
            raise CacheFieldError(f"{at}.{where[1]}.cache_control"
                                  f"{'.' + field if field else ''}: {first['msg']}") from None
    try:
        check_controls([control for _, control in out])
    except RequestError as e:
        raise CacheFieldError(str(e)) from None
    return out


def _as_chat(data: dict[str, Any], cut: Where | None = None) -> list[dict[str, Any]]:
    """The Messages request's system and messages as vLLM's Anthropic endpoint hands them
    to its chat template (the system's text blocks joined into one string, a message of one
    text block as a string), up to the end of block `cut` (None: all of it)."""
    system = data.get("system")
    texts = [system] if isinstance(system, str) else [b.get("text") or "" for b in
                                                      _blocks(system) if b.get("type") == "text"]
    if cut is not None and cut[0] < 0:
        return [{"role": "system", "content": "".join(texts[:cut[1] + 1])}]
    out: list[dict[str, Any]] = [{"role": "system", "content": "".join(texts)}] if \
        "".join(texts) else []
    messages = data.get("messages") if isinstance(data.get("messages"), list) else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            parts = [{"type": "text", "text": b.get("text") or ""} for b in _blocks(content)]
            if cut is not None and i == cut[0] and cut[1] >= 0:
                parts = parts[:cut[1] + 1]
            content = parts[0]["text"] if len(parts) == 1 else parts
        out.append({"role": m.get("role"), "content": content})
        if cut is not None and i == cut[0]:
            break
    return out


def _asks_cache(data: dict[str, Any], api: Api) -> bool:
    messages = _input(data) if api is Api.RESPONSES else data.get("messages")
    return any(data.get(f) is not None for f in FIELDS) or _has_marks(messages)


def _input(data: dict[str, Any]) -> list[Any]:
    """A Responses request's input items (a string input has none)."""
    items = data.get("input")
    return items if isinstance(items, list) else []


def _responses_chat(data: dict[str, Any]) -> list[Any]:
    """The chat messages vLLM renders a Responses request as (its instructions a system
    message, each input message one message); CacheFieldError where the input holds items
    that are no message (a breakpoint's place in the prompt would be a guess)."""
    items = _input(data)
    if any(not isinstance(m, dict) or m.get("type", "message") != "message" or
           "role" not in m for m in items):
        raise CacheFieldError("input: a prompt_cache_breakpoint is placed among message items "
                              "only under vllm serve; this input holds other items")
    instructions = data.get("instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    return [*system, *({"role": m["role"], "content": _as_text_parts(m.get("content"))}
                       for m in items)]


def _as_text_parts(content: Any) -> Any:
    """A Responses message's `input_text` / `output_text` parts as chat's text parts (what
    vLLM's renderer reads them as; its /tokenize takes chat's only)."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": p.get("text") or ""}
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text") else p
            for p in content]


def _prewarm(data: dict[str, Any], api: Api) -> bool:
    """Whether a Responses request asks for a prewarm (CacheFieldError: streamed, which
    this middleware cannot answer without output)."""
    options = data.get("prompt_cache_options")
    asked = api is Api.RESPONSES and isinstance(options, dict) and options.get("prewarm") is True
    if asked and data.get("stream"):
        raise CacheFieldError("prompt_cache_options.prewarm: under vllm serve a prewarm is "
                              "answered whole; send it without stream")
    return asked


def _has_marks(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and "prompt_cache_breakpoint" in p for p in m["content"])
        for m in messages)


def _options(raw: Any, api: Api) -> PromptCacheOptions | None:
    if raw is None:
        return None
    kind = ResponsesCacheOptions if api is Api.RESPONSES else PromptCacheOptions
    try:
        return kind.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CacheFieldError(f"prompt_cache_options{'.' + where if where else ''}: "
                              f"{first['msg']}") from None


def _marks(messages: Any, field: str) -> list[tuple[int, int, PromptCacheBreakpoint]]:
    """(message, part, breakpoint) of each marked content part, in prompt order (`field`:
    where the messages are, for what a refusal names)."""
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
                    raise CacheFieldError(f"{field}.{i}.content.{j}.prompt_cache_breakpoint"
                                          f"{'.' + where if where else ''}: {first['msg']}"
                                          ) from None
                out.append((i, j, mark))
    try:
        check_breakpoints(len(out))
    except RequestError as e:
        raise CacheFieldError(str(e)) from None
    return out


def _stripped(messages: list[Any]) -> list[Any]:
    """The messages without the breakpoint marks vLLM does not know."""
    return [{**m, "content": [{k: v for k, v in p.items() if k != "prompt_cache_breakpoint"}
                              if isinstance(p, dict) else p for p in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m
            for m in messages]


def _strip(data: dict[str, Any]) -> None:
    """The caching fields and marks vLLM does not know, out of the body."""
    for f in (*FIELDS, "cache_control"):
        data.pop(f, None)
    for key in ("messages", "input"):
        if isinstance(data.get(key), list):
            data[key] = _stripped(data[key])
    for holder in [data.get("system"), *[m.get("content") for m in data.get("messages") or []
                                          if isinstance(m, dict)]]:
        for b in _blocks(holder):
            b.pop("cache_control", None)


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


async def _error(send: Send, message: str, anthropic: bool = False) -> None:
    """A 400 in the API's own error shape (OpenAI's, or Anthropic's on /v1/messages)."""
    error = {"message": message, "type": "invalid_request_error"}
    body = json.dumps({"type": "error", "error": error} if anthropic else
                      {"error": {**error, "param": None, "code": None}}).encode()
    await _send_json(send, 400, body)


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
