"""OpenAI's Responses API as the official `openai` SDK sends it to `kvtier serve`: the same
answer as the chat route for the same turns, whole or streamed; `prompt_cache_breakpoint` on
`input_text` parts and `prompt_cache_options` as chat takes them; `prewarm` fills the cache
and generates nothing, and the next request reads what it wrote; what kvtier cannot serve
(state it does not keep, non-text parts) is a 400 by name (issue 45)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import start_server

SYSTEM = "You answer briefly. " * 5  # ~100 bytes: six blocks of the tiny model's tokens
BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # a part of a block read back is loaded whatever the planner would choose: for the
    # tiny model recomputing 8 tokens can win, and these tests are about what was kept
    proc, url = start_server("--num-device-blocks", "64", "--batch-invariant",
                             "--kv-offloading-size", str(128 * BLOCK_GIB),
                             "--load-policy", "always")
    try:
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def respond(c: openai.OpenAI, user: Any = "hello", instructions: str = SYSTEM,
            **extra: Any) -> Any:
    return c.responses.create(model="tiny", instructions=instructions, input=user,
                              max_output_tokens=4, temperature=0, **extra)


def test_the_same_turns_answer_as_chat_whole_and_streamed(server: str) -> None:
    c = gpt(server)
    chat = c.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    whole = respond(c, "hi")
    assert whole.object == "response" and whole.output[0].type == "message"
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                            else "completed")
    events = list(c.responses.create(model="tiny", instructions=SYSTEM, input="hi",
                                     max_output_tokens=4, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # response.completed, or .incomplete at max_output_tokens
    assert events[-1].type == f"response.{whole.status}"
    assert deltas == final.output_text == whole.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_prewarm_writes_the_cache_generates_nothing_and_the_next_request_reads_it(
        server: str) -> None:
    c = gpt(server)
    rules = "Prewarmed rules for every later turn. " * 3
    warm = respond(c, "first", rules, prompt_cache_options={"prewarm": True, "ttl": "12h"})
    assert warm.output == [] and warm.usage.output_tokens == 0
    details = warm.usage.input_tokens_details
    assert details.cached_tokens == 0 and details.cache_write_tokens > 0
    assert details.cache_write_tokens_details.ttl_12h_tokens == details.cache_write_tokens
    assert warm.model_extra["kvtier_retention_s"] == 43200
    turn = respond(c, "first", rules)
    assert turn.usage.input_tokens_details.cached_tokens == details.cache_write_tokens
    assert turn.output_text  # this one generates
    streamed = list(c.responses.create(model="tiny", instructions="Streamed prewarm. " * 4,
                                       input="x", stream=True,
                                       prompt_cache_options={"prewarm": True}))
    assert [e.type for e in streamed] == ["response.created", "response.in_progress",
                                          "response.completed"]
    assert streamed[-1].response.output == [] and streamed[-1].response.usage.output_tokens == 0


def test_a_breakpoint_on_an_input_text_part_keeps_its_prefix(server: str) -> None:
    c = gpt(server)
    part = {"type": "input_text", "text": "Kept up to here. " * 4,
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}
    out = respond(c, [{"role": "user", "content": [part, {"type": "input_text",
                                                           "text": " and not this."}]}],
                  prompt_cache_options={"mode": "explicit"})
    assert out.model_extra["kvtier_cache_breakpoints_s"] == [43200]
    assert "kvtier_retention_s" not in out.model_extra  # explicit: no implicit breakpoint
    written = out.usage.input_tokens_details.cache_write_tokens
    assert written > 0
    assert written == out.usage.input_tokens_details.cache_write_tokens_details.ttl_12h_tokens
    # the same part, then other text: read back exactly to the breakpoint, not a block edge
    again = respond(c, [{"role": "user", "content": [part, {"type": "input_text",
                                                             "text": " but this one."}]}],
                    prompt_cache_options={"mode": "explicit"})
    read = out.usage.input_tokens_details.cached_tokens  # earlier tests' shared prefix
    assert again.usage.input_tokens_details.cached_tokens == read + written


@pytest.mark.parametrize("extra, says", [
    ({"previous_response_id": "resp_1"}, "previous_response_id: not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x/y.png"}]}]},
     "input_image: only input_text and output_text parts are supported"),
    ({"prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h"},
     "cannot be sent with prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"prewarm": "yes"}}, "prompt_cache_options.prewarm"),
])
def test_what_kvtier_cannot_serve_is_a_400_by_name(server: str, extra: dict[str, Any],
                                                   says: str) -> None:
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        gpt(server).responses.create(**body)
    assert says in str(e.value)
