"""Anthropic's Messages API as the official `anthropic` SDK sends it to `kvtier serve`:
the same answer as OpenAI's chat route for the same turns, whole or streamed; `cache_control`
(per block, or once at the top level) is a breakpoint retained for its ttl in every tier,
answered in usage by Anthropic's definitions (input + cache read + cache creation = the
prompt); a 1h system prompt outlives a flood and is read back from the tier; what Anthropic
refuses is a 400 in its shape (issue 45)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from conftest import start_server

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model
BLOCK = 16  # tokens a block of the tiny model holds
SYSTEM = "You answer briefly. " * 5  # ~100 bytes: six blocks of the tiny model's tokens
KEY = "sk-test"
# the SDK no longer sends sampling parameters; the API (and kvtier) still takes them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    disk = tmp_path_factory.mktemp("messages") / "kv"
    proc, url = start_server("--num-device-blocks", "48", "--batch-invariant",
                             "--kv-offloading-size", str(32 * BLOCK_GIB),
                             "--disk-kv-path", str(disk), "--disk-kv-size", "0.0004",
                             "--disk-kv-read-gbps", "2", "--idle-offload-s", "0.2",
                             # what was kept is read back: for the tiny model the planner
                             # may rightly recompute, and these tests are about the keeping
                             "--load-policy", "always",
                             "--api-key", KEY)
    try:
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def claude(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def system(ttl: str | None = "1h", text: str = SYSTEM) -> list[dict[str, Any]]:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": text, "cache_control": control}]


def ask(c: anthropic.Anthropic, system: Any = SYSTEM, user: str = "hello",
        **extra: Any) -> Any:
    return c.messages.create(model="tiny", max_tokens=4, system=system,
                             messages=[{"role": "user", "content": user}],
                             extra_body={**GREEDY, **extra.pop("extra_body", {})}, **extra)


def prompt_tokens(u: Any) -> int:
    return u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_the_same_turns_answer_as_openai_chat_whole_and_streamed(server: str) -> None:
    gpt = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    chat = gpt.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi there"}])
    whole = ask(claude(server), user="hi there")
    assert whole.type == "message" and whole.role == "assistant"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert prompt_tokens(whole.usage) == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with claude(server).messages.stream(
            model="tiny", max_tokens=4, system=SYSTEM, extra_body=GREEDY,
            messages=[{"role": "user", "content": "hi there"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert prompt_tokens(final.usage) == chat.usage.prompt_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_cache_control_writes_its_blocks_then_reads_them(server: str) -> None:
    c = claude(server)
    text = "Ground rules, written once. " * 4
    first = ask(c, system("1h", text), user="first")
    u = first.usage
    assert first.model_extra["kvtier_cache_breakpoints_s"] == [3600]
    assert u.cache_read_input_tokens == 0  # a system prompt never seen before
    assert u.cache_creation_input_tokens > 0  # to the token: the part of a block kept too
    assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation.ephemeral_5m_input_tokens == 0
    again = ask(c, system("1h", text), user="second")
    v = again.usage
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens  # read what was written
    assert v.cache_creation_input_tokens == 0  # nothing new before the breakpoint
    assert v.input_tokens < prompt_tokens(v) - u.cache_creation_input_tokens  # the rest
    plain = ask(c, "Another system prompt, never marked. " * 3)
    assert plain.usage.cache_creation_input_tokens == 0  # no breakpoint: nothing written
    assert "kvtier_cache_breakpoints_s" not in plain.model_extra


def test_top_level_cache_control_marks_the_last_block(server: str) -> None:
    c = claude(server)
    out = ask(c, SYSTEM, user="the last block " * 6, cache_control={"type": "ephemeral"})
    assert out.model_extra["kvtier_cache_breakpoints_s"] == [300]  # 5m, the default
    u = out.usage
    assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation_input_tokens > 0
    # the whole prompt up to the end of the user's text, the generation prompt after it
    assert u.input_tokens < 2 * BLOCK


def test_a_one_hour_system_prompt_comes_back_from_the_tier_after_a_flood(server: str) -> None:
    c = claude(server)
    first = ask(c, system("1h"), user="first question")
    written = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert written >= 96  # the six full blocks before the breakpoint are kept
    gpt = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    for i in range(30):  # other prompts push it off the device and through the host tier
        gpt.completions.create(model="tiny", prompt=f"flood {i} " + "word " * 15, max_tokens=1,
                               temperature=0)
    time.sleep(0.5)  # idle_offload_s: nothing stays cached on the device
    raw = c.messages.with_raw_response.create(
        model="tiny", max_tokens=4, system=system("1h"), extra_body=GREEDY,
        messages=[{"role": "user", "content": "second question"}])
    again = raw.parse()
    assert raw.headers["x-kvtier-residency"] in ("host", "disk")  # kept through the flood
    assert again.usage.cache_read_input_tokens >= 96


@pytest.mark.parametrize("body, says", [
    ({"system": [{"type": "text", "text": f"part {i}. ",
                  "cache_control": {"type": "ephemeral"}} for i in range(5)]},
     "a maximum of 4 blocks with cache_control"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                                "ttl": "2h"}}]},
     "system.0.cache_control.ttl"),
    ({"system": [{"type": "text", "text": "short. ", "cache_control": {"type": "ephemeral"}},
                 {"type": "text", "text": "long.", "cache_control": {"type": "ephemeral",
                                                                     "ttl": "1h"}}]},
     "cannot come after one with ttl='5m'"),
    ({"system": [{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}]},
     "an empty text block cannot be cached"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]},
     "'image' block is not supported"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools: not supported"),
    ({"extra_body": {"top_k": "3"}}, "top_k"),
    ({"model": "claude-sonnet-9"}, "does not exist"),
])
def test_what_anthropic_refuses_is_an_error_in_its_shape(server: str, body: dict[str, Any],
                                                         says: str) -> None:
    request = {"model": "tiny", "max_tokens": 4, "system": SYSTEM,
               "messages": [{"role": "user", "content": "hello"}], **body}
    error = anthropic.NotFoundError if body.get("model") else anthropic.BadRequestError
    with pytest.raises(error) as e:
        claude(server).messages.create(**request)
    assert says in str(e.value), e.value
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == ("not_found_error" if body.get("model")
                                             else "invalid_request_error")


def test_an_unknown_key_is_an_authentication_error_in_its_shape(server: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        ask(claude(server, key="sk-wrong"))
    assert e.value.body["error"]["type"] == "authentication_error"
