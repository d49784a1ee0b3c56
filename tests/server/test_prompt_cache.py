"""OpenAI's prompt caching fields as the official `openai` SDK sends them to `kvtier serve`:
`prompt_cache_options` (mode, ttl) and `prompt_cache_breakpoint` on content parts become
retentions in every tier (a breakpoint keeps the prompt up to the end of its part), answered
in the response; a breakpoint-kept system prompt outlives a flood and comes back from the
tier; what OpenAI refuses is a 400 in its shape (issue 45, first part)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import start_server

BLOCK_GIB = 8192 / 1024**3  # one block of the tiny model
SYSTEM = "You answer briefly. " * 5  # ~100 bytes: six blocks of the tiny model's tokens


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ask(c: openai.OpenAI, system: list[dict[str, Any]] | str, user: str = "hello",
        **extra: Any) -> Any:
    return c.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})}, **extra)


def marked(ttl: str | None = None) -> list[dict[str, Any]]:
    mark: dict[str, Any] = {"mode": "explicit", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": SYSTEM, "prompt_cache_breakpoint": mark}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    disk = tmp_path_factory.mktemp("prompt-cache") / "kv"
    proc, url = start_server("--num-device-blocks", "48", "--batch-invariant",
                             "--kv-offloading-size", str(24 * BLOCK_GIB),
                             "--disk-kv-path", str(disk), "--disk-kv-size", "0.0004",
                             "--disk-kv-read-gbps", "2", "--idle-offload-s", "0.2",
                             # what was kept is read back: for the tiny model the planner
                             # may rightly recompute, and these tests are about the keeping
                             "--load-policy", "always")
    try:
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_cache_options_and_breakpoints_become_retentions_answered_in_the_response(
        server: str) -> None:
    c = client(server)
    implicit = ask(c, SYSTEM, prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    assert implicit.model_extra["kvtier_retention_s"] == 1800  # the whole prompt, 30 min
    explicit = ask(c, marked("12h"), prompt_cache_options={"mode": "explicit"})
    assert "kvtier_retention_s" not in explicit.model_extra  # no implicit breakpoint
    assert explicit.model_extra["kvtier_cache_breakpoints_s"] == [43200]
    inherited = ask(c, marked(), prompt_cache_options={"mode": "explicit", "ttl": "30m"})
    assert inherited.model_extra["kvtier_cache_breakpoints_s"] == [1800]  # the request's ttl
    plain = ask(c, SYSTEM)
    assert "kvtier_retention_s" not in plain.model_extra  # nothing asked, nothing answered


def test_a_breakpoint_kept_system_prompt_comes_back_after_a_flood(server: str) -> None:
    c = client(server)
    first = ask(c, marked("12h"), user="first question")
    assert first.model_extra["kvtier_cache_breakpoints_s"] == [43200]
    for i in range(30):  # other prompts push it off the device and through the host tier
        c.completions.create(model="tiny", prompt=f"flood {i} " + "word " * 15, max_tokens=1,
                             temperature=0)
    time.sleep(0.5)  # idle_offload_s: nothing stays cached on the device
    again = ask(c, marked("12h"), user="second question")
    usage = again.usage.model_extra
    read = again.usage.prompt_tokens_details.cached_tokens  # the device's and the tier's
    assert usage["residency"] in ("host", "disk"), usage  # kept by the tier through the flood
    assert read >= usage["restored_tokens"] >= 96, usage  # the six full blocks


def test_usage_counts_what_was_read_and_what_was_written_for_a_breakpoint(
        server: str) -> None:
    c = client(server)
    system = "Usage is counted here. " * 5
    fresh = ask(c, system, user="one").usage.prompt_tokens_details
    assert fresh.cached_tokens == 0  # never seen before
    # implicit (the default): the whole prompt's full blocks are written
    assert fresh.cache_write_tokens > 0 and fresh.cache_write_tokens % 16 == 0
    again = ask(c, system, user="one").usage.prompt_tokens_details
    assert again.cached_tokens == fresh.cache_write_tokens  # read back what it wrote
    assert again.cache_write_tokens == 0
    other = "Nothing here is kept. " * 5
    explicit = ask(c, other, prompt_cache_options={"mode": "explicit"}).usage
    assert explicit.prompt_tokens_details.cache_write_tokens == 0  # no breakpoint, no write
    part = [{"type": "text", "text": "Only this part is kept. " * 3,
             "prompt_cache_breakpoint": {"mode": "explicit"}}]
    marked_part = ask(c, part, user="a question that runs on for a while",
                      prompt_cache_options={"mode": "explicit"}).usage
    written = marked_part.prompt_tokens_details.cache_write_tokens
    assert 0 < written < marked_part.prompt_tokens - 16  # up to the breakpoint's block only


@pytest.mark.parametrize("extra, says", [
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h"},
     "cannot be sent with prompt_cache_options.ttl"),
])
def test_what_openai_refuses_is_a_400_in_its_shape(server: str, extra: dict[str, Any],
                                                   says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server), SYSTEM, extra_body=extra)
    assert says in str(e.value)


def test_more_than_four_breakpoints_or_a_bad_one_is_refused(server: str) -> None:
    mark = {"mode": "explicit"}
    five = [{"type": "text", "text": f"part {i}. ", "prompt_cache_breakpoint": mark}
            for i in range(5)]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server), five)
    assert "at most 4" in str(e.value)
    bad = [{"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "implicit"}}]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server), bad)
    assert "prompt_cache_breakpoint" in str(e.value)


def test_a_breakpoint_ends_where_its_part_ends_in_the_templated_prompt(tiny: Any) -> None:
    from kvtier.server.prompt_cache import breakpoint_tokens
    from kvtier.server.protocol import ChatCompletionRequest, ChatMessage

    tok = tiny.tokenizer
    mark = {"mode": "explicit"}
    messages = [ChatMessage.model_validate(m) for m in (
        {"role": "system", "content": [{"type": "text", "text": "Rules: be brief. ",
                                        "prompt_cache_breakpoint": mark},
                                       {"type": "text", "text": "Tools: none."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello there",
                                      "prompt_cache_breakpoint": mark}]})]
    text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages])
    ids = tok.encode(text, add_special_tokens=False)
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages})
    first, second = breakpoint_tokens(tok, text, ids, request.pieces())
    head = tok.encode(text[:text.index("Rules: be brief. ") + len("Rules: be brief. ")],
                      add_special_tokens=False)
    assert 0 < first <= len(head) and ids[:first] == head[:first]  # never past its part
    assert first < second <= len(ids)
    assert tok.decode(ids[first:second]).find("Hello there") >= 0  # the second ends later
