"""Anthropic's JSON shapes for `/v1/messages`: the whole message, its SSE events and its
error, with `usage` counted by Anthropic's definitions (`input_tokens` are the prompt's
tokens neither read from the cache nor written to it). Pure formatting: no engine, no I/O."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.prompt_cache import CacheUsage, cache_usage
from kvtier.server.shapes import retention_of

# Anthropic's error type for each HTTP status kvtier answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
TTL_FIELDS = {"5m": "ephemeral_5m_input_tokens", "1h": "ephemeral_1h_input_tokens"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error",
            "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_of(out: RequestOutput) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for an engine finish."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage_of(prompt_tokens: int, output_tokens: int, cache: CacheUsage) -> dict[str, Any]:
    """Anthropic's `usage`: the prompt split into input (computed, not kept), cache creation
    (computed and kept for a breakpoint, per lifetime) and cache read."""
    return {"input_tokens": max(0, prompt_tokens - cache.read - cache.written),
            "cache_creation_input_tokens": cache.written,
            "cache_read_input_tokens": cache.read,
            "cache_creation": {name: cache.written_by_ttl.get(ttl, 0)
                               for ttl, name in TTL_FIELDS.items()},
            "output_tokens": output_tokens}


class MessageShape:
    """One request's message, whole or as SSE events (a `responses.Framing`); usage counts
    the cache against the request's breakpoints (`kept`: their tokens and ttl labels)."""

    def __init__(self, request_id: str, model: str, prompt_tokens: int,
                 kept: Sequence[tuple[int, str]], block_size: int) -> None:
        self.id = "msg_" + request_id.split("-")[-1]
        self.model, self.prompt_tokens = model, prompt_tokens
        self.kept, self.block_size = kept, block_size

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        cache = cache_usage(out, self.kept, self.block_size)
        return usage_of(len(out.prompt_token_ids), len(out.token_ids), cache)

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        return {**self._message([{"type": "text", "text": out.text}], stop_of(out),
                                self._usage(out)),
                **retention_of(out.hint_reply)}

    def opening(self, first: StreamDelta | RequestOutput) -> bytes:
        """message_start (usage as known at admission: what was read; the closing
        message_delta carries the final counts), the text block's start, a ping."""
        usage = usage_of(self.prompt_tokens, 0, CacheUsage(first.num_read_tokens))
        return (event("message_start", {"message": self._message([], (None, None), usage)})
                + event("content_block_start",
                        {"index": 0, "content_block": {"type": "text", "text": ""}})
                + event("ping", {}))

    @staticmethod
    def piece(text: str) -> bytes:
        return event("content_block_delta",
                     {"index": 0, "delta": {"type": "text_delta", "text": text}})

    def closing(self, out: RequestOutput) -> bytes:
        """The block's stop, message_delta (stop reason, the final usage, what each
        cache_control got), message_stop."""
        reason, sequence = stop_of(out)
        return (event("content_block_stop", {"index": 0})
                + event("message_delta", {"delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence},
                                          "usage": self._usage(out),
                                          **retention_of(out.hint_reply)})
                + event("message_stop", {}))

    @staticmethod
    def failure(message: str, status: int) -> bytes:
        return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n".encode()


def event(name: str, body: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic names and frames them."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **body})}\n\n".encode()
