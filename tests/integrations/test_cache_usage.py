"""The usage rewrite `vllm serve`'s middleware applies to a whole answer (no vLLM needed):
from what the connector says it read and kept per grant, OpenAI's and Anthropic's counts;
an answer without those words, a stream or an error goes on untouched."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvtier.integrations.vllm.cache_usage import Api, UsageRewriter, rewritten, usage_from
from kvtier.server.protocol import DAY_S

PARAMS = {"kvtier_read_tokens": 32, "kvtier_retention_s": 43200.0,
          "kvtier_retention_kept": 160, "kvtier_cache_breakpoints_s": [1800.0, "refused:full"],
          "kvtier_cache_breakpoints_kept": [96, 0]}


def test_each_grant_writes_past_what_was_read_and_kept_before_it() -> None:
    cache = usage_from(PARAMS, {1800.0: "30m", 43200.0: "12h", DAY_S: "24h"})
    assert cache is not None
    assert (cache.read, cache.written) == (32, 128)
    assert cache.written_by_ttl == {"30m": 64, "12h": 64}  # 32..96, then 96..160
    assert usage_from({"kvtier_retention_s": 60}, {}) is None  # no read count: no rewrite


def test_openai_and_anthropic_usage_by_their_definitions() -> None:
    chat: dict[str, Any] = {"usage": {"prompt_tokens": 200, "prompt_tokens_details": None},
                            "kv_transfer_params": PARAMS}
    assert rewritten(chat, Api.CHAT)
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 32,
                                                      "cache_write_tokens": 128}
    marks = {**PARAMS, "kvtier_retention_s": 300.0, "kvtier_cache_breakpoints_s": [3600.0]}
    message: dict[str, Any] = {"usage": {"input_tokens": 190, "cache_read_input_tokens": 10,
                                         "cache_creation_input_tokens": 0},
                               "kv_transfer_params": marks}
    assert rewritten(message, Api.MESSAGES)
    assert message["usage"] == {"input_tokens": 40, "cache_read_input_tokens": 32,
                                "cache_creation_input_tokens": 128,
                                "cache_creation": {"ephemeral_5m_input_tokens": 64,
                                                   "ephemeral_1h_input_tokens": 64}}
    assert not rewritten({"usage": {"prompt_tokens": 5}}, Api.CHAT)
    warm: dict[str, Any] = {"output": [{"type": "message"}], "kv_transfer_params": PARAMS,
                            "usage": {"input_tokens": 200, "output_tokens": 1,
                                      "total_tokens": 201}}
    assert rewritten(warm, Api.RESPONSES, prewarm=True)
    assert warm["output"] == [] and warm["usage"]["output_tokens"] == 0
    assert warm["usage"]["total_tokens"] == 200
    assert warm["usage"]["input_tokens_details"] == {
        "cached_tokens": 32, "cache_write_tokens": 128,
        "cache_write_tokens_details": {"ttl_30m_tokens": 64, "ttl_12h_tokens": 64}}


def run(start: dict[str, Any], bodies: list[bytes]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def go() -> None:
        rewriter = UsageRewriter(send, Api.CHAT)
        await rewriter(start)
        for i, body in enumerate(bodies):
            await rewriter({"type": "http.response.body", "body": body,
                            "more_body": i < len(bodies) - 1})

    asyncio.run(go())
    return sent


def test_a_whole_answer_is_sent_once_rewritten_with_its_new_length() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 200}, "kv_transfer_params": PARAMS}).encode()
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    head, whole = run(start, [body[:10], body[10:]])
    data = json.loads(whole["body"])
    assert data["usage"]["prompt_tokens_details"]["cache_write_tokens"] == 128
    assert dict(head["headers"])[b"content-length"] == str(len(whole["body"])).encode()


def test_streams_errors_and_bodies_it_cannot_read_go_on_untouched() -> None:
    stream = {"type": "http.response.start", "status": 200,
              "headers": [(b"content-type", b"text/event-stream")]}
    assert [m.get("body") for m in run(stream, [b"data: 1\n\n", b"data: 2\n\n"])] == \
        [None, b"data: 1\n\n", b"data: 2\n\n"]
    error = {"type": "http.response.start", "status": 400,
             "headers": [(b"content-type", b"application/json")]}
    assert run(error, [b'{"error": {}}'])[1]["body"] == b'{"error": {}}'
    json_start = {"type": "http.response.start", "status": 200,
                  "headers": [(b"content-type", b"application/json")]}
    assert run(json_start, [b"not json"])[1]["body"] == b"not json"
