"""What a request may be before any work is spent on it: a bounded body (413), a JSON
object of valid strings nested a sane depth (400), prompt text that can fit the context
(400). All in OpenAI's error shape, through `ApiError`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

BYTES_PER_TOKEN = 32  # a token as JSON-escaped text (a \u escape is 6 bytes a character)
MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters than this into a token
MAX_JSON_DEPTH = 32  # far beyond any OpenAI request's nesting
UNION_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of a union's branches


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: status, message, code and type."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def default_max_request_bytes(max_model_len: int) -> int:
    """A body that holds a whole context as escaped text or token ids, and some slack."""
    return max_model_len * BYTES_PER_TOKEN + (64 << 10)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be larger than `limit` (from its
    Content-Length, else while it streams in): an oversized body is never held whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; this server takes at "
                       f"most {limit} (--max-request-bytes)", "request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                           "request_too_large")
    return bytes(body)


def json_body(raw: bytes) -> dict[str, Any]:
    """A JSON object of valid strings nested at most MAX_JSON_DEPTH deep, else a 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} "
                       "levels") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _too_deep(body):
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:  # a lone UTF-16 surrogate (e.g. "\ud800") decodes to a str no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds an invalid string (a lone surrogate at "
                       f"{e.start}); send valid UTF-8 text") from None
    return body


def _too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether lists and objects nest deeper than `limit` in a parsed JSON value."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [child for v in level if isinstance(v, (list, dict))
                 for child in (v.values() if isinstance(v, dict) else v)]
        if not any(isinstance(v, (list, dict)) for v in level):
            return False
    return True


def prompt_text(text: str, max_model_len: int) -> str:
    """`text`, unless it is too long to fit the context however it tokenizes (a 400 before
    any tokenizer sees it)."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise ApiError(400, f"the prompt has {len(text)} characters; a context of "
                       f"{max_model_len} tokens holds far fewer (at most {limit} are read)")
    return text


def validated(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """`body` as `model`, else a 400 naming the field: the deepest error, since in a union
    (a message's text or its blocks) the branch the client meant went furthest."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = max(e.errors(), key=lambda err: len(err["loc"]))
        where = ".".join(str(p) for p in first["loc"] if not _union_branch(p)) or "body"
        raise ApiError(400, f"{where}: {first['msg']}") from None


def _union_branch(part: int | str) -> bool:
    """A step of pydantic's error path that names a union's branch (`list[TextBlock]`,
    `str`), not a field the client wrote."""
    return isinstance(part, str) and ("[" in part or part in UNION_TAGS)
