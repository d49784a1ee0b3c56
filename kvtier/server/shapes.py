"""OpenAI's JSON shapes for the completion routes: `Shape` (one request's whole response,
SSE chunks and usage chunk), `usage_of` (OpenAI's `usage` plus kvtier's restore and TTFT
split), `ttft_split_ms`. Pure formatting: no engine, no I/O."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from kvtier.output import RequestOutput, StreamDelta
from kvtier.server.prompt_cache import CacheUsage, cache_usage
from kvtier.server.protocol import error_body
from kvtier.tier import HintReply


class Shape:
    """OpenAI's JSON shapes for one request: whole responses, SSE chunks, usage."""

    def __init__(self, request_id: str, model: str, chat: bool, token_ids: bool = False,
                 top_logprobs: int | None = None, tokenizer: Any = None,
                 kept: Sequence[tuple[int, str]] = (), block_size: int = 1,
                 include_usage: bool = False) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id.split("-")[-1]
        # where the request writes the cache (`prompt_cache.cache_usage`)
        self.kept, self.block_size = kept, block_size
        self.include_usage = include_usage  # a streamed answer closes with a usage chunk
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.first = True
        self.with_token_ids = token_ids
        self.top_logprobs = top_logprobs  # None: no logprobs were asked for
        self.tokenizer = tokenizer

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        logprobs = self._logprobs(out)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": logprobs}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                      "logprobs": logprobs}
            obj = "text_completion"
        if self.with_token_ids:
            choice["token_ids"] = out.token_ids
        return {**self._base(obj), "choices": [choice], "usage": self.usage(out),
                **retention_of(out.hint_reply)}

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        return usage_of(out, cache_usage(out, self.kept, self.block_size))

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        """OpenAI's logprobs object: per generated token its log-probability under the
        model and the `top_logprobs` most likely alternatives (chat and completions shapes)."""
        if self.top_logprobs is None or out.logprobs is None:
            return None
        text = self.tokenizer.decode
        steps = []
        for token, lps in zip(out.token_ids, out.logprobs):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            steps.append((text([token], False), lps[token], [(text([t], False), lp)
                                                              for t, lp in top]))
        if self.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": [
                    {"token": ts, "logprob": tlp, "bytes": list(ts.encode())}
                    for ts, tlp in top]} for s, lp, top in steps]}
        offsets, at = [], 0
        for s, _, _ in steps:
            offsets.append(at)
            at += len(s)
        return {"tokens": [s for s, _, _ in steps], "token_logprobs": [lp for _, lp, _ in steps],
                "top_logprobs": [dict(top) for _, _, top in steps], "text_offset": offsets}

    def chunk(self, text: str, finish_reason: str | None,
              token_ids: list[int] | None = None, reply: HintReply | None = None
              ) -> bytes:
        """One SSE event; the closing one carries the output's ids (when asked) and what
        each hint asked got."""
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or finish_reason is None else {}
            if self.first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}
            body = {**self._base("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = {**self._base("text_completion"), "choices": [choice]}
        if token_ids is not None and self.with_token_ids:
            choice["token_ids"] = token_ids  # the whole output's ids, on the closing chunk
        if reply is not None:
            body.update(retention_of(reply))
        self.first = False
        return f"data: {json.dumps(body)}\n\n".encode()

    def usage_chunk(self, out: RequestOutput) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._base(obj), "choices": [], "usage": self.usage(out)}
        return f"data: {json.dumps(body)}\n\n".encode()

    # the `responses.Framing` of a streamed answer
    def opening(self, first: StreamDelta | RequestOutput) -> bytes:
        return b""

    def piece(self, text: str) -> bytes:
        return self.chunk(text, None)

    def closing(self, out: RequestOutput) -> bytes:
        """The closing chunk (the ids, what each hint got), the usage chunk when asked,
        `[DONE]`."""
        body = self.chunk("", out.finish_reason, out.token_ids, out.hint_reply)
        if self.include_usage:
            body += self.usage_chunk(out)
        return body + b"data: [DONE]\n\n"

    @staticmethod
    def failure(message: str, status: int) -> bytes:
        """The error event vLLM's server streams, then the end of the stream."""
        body = error_body(message, "server_error", str(status))
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def retention_of(reply: HintReply) -> dict[str, Any]:
    """`kvtier_retention_s`: the seconds a retention got, or "refused:<reason>";
    `kvtier_cache_breakpoints_s`: the same for each cache breakpoint, in its order (nothing
    for what was not asked)."""
    out: dict[str, Any] = {}
    if reply.retention is not None:
        out["kvtier_retention_s"] = reply.retention.value
    if reply.prefixes:
        out["kvtier_cache_breakpoints_s"] = [g.value for g in reply.prefixes]
    return out


def usage_of(out: RequestOutput, cache: CacheUsage) -> dict[str, Any]:
    """OpenAI's `usage` (`cached_tokens`: read from the device's prefix cache or restored
    from a tier, as vLLM counts them; `cache_write_tokens`: written for a breakpoint), plus
    where the prompt's KV came from and what restoring it cost."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cache.read,
                                      "cache_write_tokens": cache.written},
            "restored_tokens": out.num_restored_tokens,
            "swapped_in_tokens": out.num_swapped_in_tokens,
            "recomputed_tokens": out.num_recomputed_tokens,
            "restore_ms": round(out.metrics.restore_s * 1e3, 3),
            "residency": out.residency, "lossy": out.lossy, **ttft_split_ms(out)}


def ttft_split_ms(out: RequestOutput) -> dict[str, float | None]:
    """The engine's TTFT and its queue / tier / compute parts, in ms (None: no first token)."""
    m = out.metrics
    return {f"{name}_ms": None if value is None else round(value * 1e3, 3)
            for name, value in {"ttft": m.ttft_s, **m.parts()}.items()}
