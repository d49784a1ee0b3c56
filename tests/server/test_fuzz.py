"""Random bodies against every generation route of a real `kvtier serve` (OpenAI's three,
Anthropic's Messages): every answer is JSON or a stream that ends as its API ends one, below
500 unless the server says why in the API's shape, and the server serves on afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "cache_salt",
          "ignore_eos", "return_token_ids", "logprobs", "frequency_penalty", "tools"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
values = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=12)
small = st.one_of(st.integers(-3, 6), values)  # never a long generation
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
    optional={"content": st.one_of(st.text(max_size=30), values)}), max_size=3)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.fixed_dictionaries(
        {"model": st.sampled_from(["tiny", "default", "other"]), "max_tokens": small},
        optional={"prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 60000),
                                                                     max_size=8)),
                  "messages": messages, "temperature": values, "top_p": values,
                  "top_k": values, "seed": values, "stop": values, "stream": st.booleans(),
                  "n": values, "cache_salt": values, "frequency_penalty": values}))


marks = st.one_of(values, st.fixed_dictionaries(
    {"type": st.sampled_from(["ephemeral", "lasting"]), "mode": st.just("explicit")},
    optional={"ttl": st.sampled_from(["5m", "1h", "30m", "12h", "2h"])}))
blocks = st.one_of(st.text(max_size=30), values, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "input_text", "output_text", "image"])},
    optional={"text": st.one_of(st.text(max_size=20), values), "cache_control": marks,
              "prompt_cache_breakpoint": marks}), max_size=5))
turns = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "robot"])},
    optional={"content": blocks}), max_size=3)
# (path, body) for the Messages and Responses routes
cached_bodies = st.one_of(
    st.tuples(st.just("/v1/messages"), st.fixed_dictionaries(
        {"model": st.sampled_from(["tiny", "other"]), "max_tokens": small},
        optional={"messages": turns, "system": blocks, "cache_control": marks,
                  "stream": st.booleans(), "temperature": values, "stop_sequences": values,
                  "tools": values, "top_k": values})),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
        {"model": st.sampled_from(["tiny", "other"]), "max_output_tokens": small},
        optional={"input": st.one_of(blocks, turns), "instructions": values,
                  "prompt_cache_options": st.one_of(values, st.fixed_dictionaries(
                      {}, optional={"mode": st.sampled_from(["implicit", "explicit", "x"]),
                                    "ttl": st.sampled_from(["30m", "12h", "1h"]),
                                    "prewarm": st.one_of(st.booleans(), values)})),
                  "stream": st.booleans(), "previous_response_id": values,
                  "prompt_cache_retention": values})))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--num-device-blocks", "64")
    yield url
    proc.terminate()
    proc.communicate(timeout=60)


def check(r: httpx.Response) -> None:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
        return
    body = r.json()  # always JSON
    if r.status_code >= 500:  # only with the server's own reason
        assert body["error"]["type"] == "server_error" and body["error"]["message"]
    elif r.status_code >= 400:
        assert body["error"]["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, chat=st.booleans())
def test_random_bodies_get_json_answers_and_the_server_serves_on(server: str,
                                                                 body: dict[str, Any],
                                                                 chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = json.dumps(body, allow_nan=True)
    r = httpx.post(server + path, content=content, timeout=60,
                   headers={"content-type": "application/json"})
    check(r)
    assert r.status_code < 500, r.text[:500]
    assert httpx.get(server + "/health", timeout=5).status_code == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=cached_bodies)
def test_random_cache_bodies_on_messages_and_responses_get_answers_in_their_shape(
        server: str, request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    r = httpx.post(server + path, content=json.dumps(body, allow_nan=True), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text[:500]
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]
        ends = ("event: message_stop",) if path == "/v1/messages" else (
            "event: response.completed", "event: response.incomplete")
        assert last.startswith(ends), r.text[-300:]
    elif r.status_code >= 400:
        error = r.json()
        assert error["error"]["message"]
        if path == "/v1/messages":
            assert error["type"] == "error" and error["error"]["type"]
    assert httpx.get(server + "/health", timeout=5).status_code == 200
