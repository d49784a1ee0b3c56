"""OpenAI's Responses shapes for `/v1/responses`: the response object (one assistant message
of `output_text`, or none for a prewarm) and its streaming events, numbered in order, with
`usage` counting what was read from the cache and written per lifetime. Pure formatting."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.prompt_cache import CacheUsage, cache_usage
from kvtier.server.shapes import retention_of

TTL_FIELDS = {"30m": "ttl_30m_tokens", "12h": "ttl_12h_tokens"}


def usage_of(prompt_tokens: int, output_tokens: int, cache: CacheUsage) -> dict[str, Any]:
    """The Responses API's `usage`: `cached_tokens` read (the device's or a tier's),
    `cache_write_tokens` written for a breakpoint, split by lifetime."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cache.read, "cache_write_tokens": cache.written,
                "cache_write_tokens_details": {name: cache.written_by_ttl.get(ttl, 0)
                                               for ttl, name in TTL_FIELDS.items()}},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseShape:
    """One request's response object, whole or as numbered events."""

    def __init__(self, request_id: str, model: str, echo: dict[str, Any],
                 kept: Sequence[tuple[int, str]], block_size: int, prewarm: bool = False
                 ) -> None:
        suffix = request_id.split("-")[-1]
        self.id, self.item_id = "resp_" + suffix, "msg_" + suffix
        self.model, self.created = model, int(time.time())
        self.echo = echo  # what the response repeats of the request
        self.kept, self.block_size = kept, block_size  # `prompt_cache.cache_usage`
        self.prewarm = prewarm  # the cache filled, nothing generated: no output
        self.sequence = 0

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self._part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def whole(self, out: RequestOutput | None) -> dict[str, Any]:
        """The response object: in progress (`out` None) or finished."""
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created,
            "model": self.model, "output": [], "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "store": False, "error": None,
            "incomplete_details": None, "text": {"format": {"type": "text"}},
            "truncation": "disabled", **self.echo, "status": "in_progress", "usage": None}
        if out is None:
            return body
        generated = 0 if self.prewarm else len(out.token_ids)
        if not self.prewarm:
            body["output"] = [self._item(out.text, "completed")]
        if out.finish_reason == "length" and not self.prewarm:
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        cache = cache_usage(out, self.kept, self.block_size)
        body["usage"] = usage_of(len(out.prompt_token_ids), generated, cache)
        return {**body, **retention_of(out.hint_reply)}

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event, numbered."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    # the `responses.Framing` of a streamed answer
    def opening(self, first: StreamDelta | RequestOutput) -> bytes:
        head = self.event("response.created", response=self.whole(None)) + \
            self.event("response.in_progress", response=self.whole(None))
        if self.prewarm:
            return head
        where = {"output_index": 0}
        return (head + self.event("response.output_item.added",
                                  item=self._item("", "in_progress"), **where)
                + self.event("response.content_part.added", item_id=self.item_id,
                             content_index=0, part=self._part(""), **where))

    def piece(self, text: str) -> bytes:
        if self.prewarm:
            return b""
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0,
                          content_index=0, delta=text, logprobs=[])

    def closing(self, out: RequestOutput) -> bytes:
        final = self.whole(out)
        done = b""
        if not self.prewarm:
            where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            done = (self.event("response.output_text.done", text=out.text, logprobs=[],
                               **where)
                    + self.event("response.content_part.done", part=self._part(out.text),
                                 **where)
                    + self.event("response.output_item.done", output_index=0,
                                 item=self._item(out.text, "completed")))
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        return done + self.event(kind, response=final)

    def failure(self, message: str, status: int) -> bytes:
        return self.event("error", code=str(status), message=message, param=None)
