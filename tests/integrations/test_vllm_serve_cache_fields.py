"""OpenAI's prompt caching fields against `vllm serve` + kvtier's middleware, sent by the
official `openai` SDK unchanged: `prompt_cache_options` and `prompt_cache_breakpoint` become
the connector's retentions, answered in the response's `kv_transfer_params`; the retained
blocks outlive a flood on host; what OpenAI refuses is a 400 in its shape (issue 45)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from vllm_run import VllmServer

pytestmark = pytest.mark.vllm
MIDDLEWARE = ("--middleware", "kvtier.integrations.vllm.middleware.KvtierCacheFields")
RULES = "You are a careful assistant. Answer in one short sentence. " * 40  # ~480 tokens


@pytest.fixture(scope="module")
def server(smollm2_hf: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[VllmServer]:
    tmp = tmp_path_factory.mktemp("cache-fields")
    s = VllmServer(smollm2_hf, {"kv_offloading_size": 0.25}, 24, tmp / "vllm.log",
                   extra_args=MIDDLEWARE).start()
    yield s
    s.close()


def chat(server: VllmServer, system: Any, user: str = "Hello.", **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model="default", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        **extra)


def test_cache_options_and_a_breakpoint_become_the_connectors_retentions(
        server: VllmServer) -> None:
    plain = chat(server, RULES)
    implicit = chat(server, RULES, extra_body={"prompt_cache_options": {"ttl": "12h"}})
    assert implicit.choices[0].message.content == plain.choices[0].message.content
    assert implicit.model_extra["kv_transfer_params"]["kvtier_retention_s"] == 43200
    part = [{"type": "text", "text": RULES,
             "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}]
    marked = chat(server, part, "Another question.",
                  extra_body={"prompt_cache_options": {"mode": "explicit"}})
    params = marked.model_extra["kv_transfer_params"]
    assert params["kvtier_cache_breakpoints_s"] == [1800]
    assert "kvtier_retention_s" not in params  # explicit: no implicit breakpoint
    granted = server.metrics()
    assert sum(v for k, v in granted.items()
               if k.startswith("vllm:kvtier_retention_granted_total")) == 2
    flood = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for seed in range(7):  # 56 blocks through vLLM's 24 and kvtier's 45 on host
        rng = random.Random(seed)
        flood.completions.create(model="default", max_tokens=1, temperature=0,
                                 prompt=[rng.randrange(100, 49000) for _ in range(1024)])
    back = chat(server, part, "A third question.")
    params = back.model_extra["kv_transfer_params"]
    assert params["kvtier_residency"] == "host"  # the retained rules, through the flood
    assert params["kvtier_restored_tokens"] >= 3 * 128


def test_usage_counts_what_a_breakpoint_wrote_and_the_next_turn_read(
        server: VllmServer) -> None:
    """vLLM reports reads only: the middleware rewrites a whole answer's usage from what
    the connector says it read and kept, as OpenAI defines `cache_write_tokens`."""
    part = [{"type": "text", "text": "Count only what is asked, exactly. " * 50,
             "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]
    explicit = {"prompt_cache_options": {"mode": "explicit"}}
    first = chat(server, part, "One.", extra_body=explicit)
    kept = first.model_extra["kv_transfer_params"]["kvtier_cache_breakpoints_kept"][0]
    one = first.usage.prompt_tokens_details.model_dump()
    assert one["cached_tokens"] == 0 and one["cache_write_tokens"] == kept >= 256
    second = chat(server, part, "Two.", extra_body=explicit)
    two = second.usage.prompt_tokens_details.model_dump()
    assert two["cached_tokens"] >= kept and two["cache_write_tokens"] == 0
    assert second.usage.prompt_tokens == first.usage.prompt_tokens


def test_the_responses_api_prewarms_and_keeps_its_breakpoints(server: VllmServer) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    rules = "Answer from these rules alone. " * 50

    def respond(user: Any, **extra: Any) -> Any:
        return c.responses.create(model="default", instructions=rules, input=user,
                                  max_output_tokens=4, temperature=0, **extra)

    warm = respond("First.", prompt_cache_options={"prewarm": True, "ttl": "12h"})
    assert warm.output == [] and warm.usage.output_tokens == 0  # nothing generated
    written = warm.usage.input_tokens_details
    assert written.cached_tokens == 0 and written.cache_write_tokens >= 256
    assert written.cache_write_tokens_details.ttl_12h_tokens == written.cache_write_tokens
    assert warm.model_extra["kv_transfer_params"]["kvtier_retention_s"] == 43200
    turn = respond("First.", prompt_cache_options={"ttl": "12h"})
    assert turn.output_text  # this one generates, reading what the prewarm wrote
    assert turn.usage.input_tokens_details.cached_tokens >= written.cache_write_tokens
    part = {"type": "input_text", "text": "Keep this part. " * 40,
            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}
    marked = respond([{"role": "user", "content": [part, {"type": "input_text",
                                                          "text": " Then this."}]}],
                     prompt_cache_options={"mode": "explicit"})
    params = marked.model_extra["kv_transfer_params"]
    assert params["kvtier_cache_breakpoints_s"] == [1800] and "kvtier_retention_s" not in params
    details = marked.usage.input_tokens_details
    assert details.cache_write_tokens == details.cache_write_tokens_details.ttl_30m_tokens
    assert details.cache_write_tokens + details.cached_tokens == \
        params["kvtier_cache_breakpoints_kept"][0]
    with pytest.raises(openai.BadRequestError) as e:
        respond("x", stream=True, prompt_cache_options={"prewarm": True})
    assert "answered whole" in str(e.value)


@pytest.mark.parametrize("extra, says", [
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"ttl": "30m"}, "prompt_cache_retention": "24h"},
     "cannot be sent with prompt_cache_options.ttl"),
])
def test_what_openai_refuses_is_a_400_in_its_shape(server: VllmServer, extra: dict[str, Any],
                                                   says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, RULES, extra_body=extra)
    assert says in str(e.value)


def test_more_than_four_breakpoints_are_refused(server: VllmServer) -> None:
    five = [{"type": "text", "text": f"Rule {i}. ",
             "prompt_cache_breakpoint": {"mode": "explicit"}} for i in range(5)]
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, five)
    assert "at most 4" in str(e.value)


def claude(server: VllmServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_anthropics_cache_control_on_vllms_messages_route(server: VllmServer) -> None:
    system = [{"type": "text", "text": RULES, "cache_control": {"type": "ephemeral",
                                                                 "ttl": "1h"}}]
    out = claude(server).messages.create(model="default", max_tokens=4, system=system,
                                         messages=[{"role": "user", "content": "Hello."}])
    assert out.content[0].type == "text"
    assert out.model_extra["kv_transfer_params"]["kvtier_cache_breakpoints_s"] == [3600]
    auto = claude(server).messages.create(
        model="default", max_tokens=4, system=RULES, cache_control={"type": "ephemeral"},
        messages=[{"role": "user", "content": "A question that ends the prompt."}])
    assert auto.model_extra["kv_transfer_params"]["kvtier_cache_breakpoints_s"] == [300]


def test_anthropics_usage_counts_creation_and_reads_by_its_definitions(
        server: VllmServer) -> None:
    """vLLM's Messages endpoint reports 0 creation tokens: the middleware counts them."""
    system = [{"type": "text", "text": "Say what you see, no more. " * 50,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    def ask(user: str) -> Any:
        return claude(server).messages.create(model="default", max_tokens=4, system=system,
                                              messages=[{"role": "user", "content": user}])

    first, second = ask("One."), ask("Two.")
    u, v = first.usage, second.usage
    kept = first.model_extra["kv_transfer_params"]["kvtier_cache_breakpoints_kept"][0]
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == kept >= 256
    assert u.cache_creation.ephemeral_1h_input_tokens == kept
    assert u.cache_creation.ephemeral_5m_input_tokens == 0
    assert v.cache_read_input_tokens >= kept and v.cache_creation_input_tokens == 0
    total = [x.input_tokens + x.cache_read_input_tokens + x.cache_creation_input_tokens
             for x in (u, v)]
    assert total[0] == total[1] > kept  # the same prompt, its three parts adding up


@pytest.mark.parametrize("system, says", [
    ([{"type": "text", "text": f"Rule {i}. ", "cache_control": {"type": "ephemeral"}}
      for i in range(5)], "a maximum of 4 blocks"),
    ([{"type": "text", "text": "Short. ", "cache_control": {"type": "ephemeral"}},
      {"type": "text", "text": "Long.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
     "cannot come after"),
    ([{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
     "system.0.cache_control.ttl"),
])
def test_what_anthropic_refuses_is_a_400_in_its_shape(server: VllmServer, system: Any,
                                                      says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(server).messages.create(model="default", max_tokens=4, system=system,
                                       messages=[{"role": "user", "content": "Hello."}])
    assert says in str(e.value)
    assert e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("purge", [True, False])
def test_a_prompt_purged_through_the_middleware_leaves_kvtiers_tiers(server: VllmServer,
                                                                      purge: bool) -> None:
    """DELETE /v1/kv as kvtier serve takes it: the prompt runs once with kvtier_purge, and
    its blocks leave host: once vLLM's own cache is flooded nothing of it is restored
    (unpurged, the same prompt comes back from host)."""
    rng = random.Random(99 if purge else 98)
    prompt = [rng.randrange(100, 49000) for _ in range(640)]  # five blocks of 128
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    c.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
    if purge:
        r = httpx.request("DELETE", f"{server.url}/v1/kv", timeout=120,
                          json={"model": "default", "prompt": prompt})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "kv.purge" and out["blocks"] == 5
        assert out["host_blocks"] + out["host_in_use"] == 5
    for seed in range(3):  # vLLM's 24 blocks flooded; kvtier's 45 on host keep the rest
        flood = random.Random(seed + 100)
        c.completions.create(model="default", max_tokens=1, temperature=0,
                             prompt=[flood.randrange(100, 49000) for _ in range(1024)])
    back = c.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
    assert back.model_extra["kv_transfer_params"]["kvtier_residency"] == \
        ("none" if purge else "host")


def test_a_purge_without_a_prompt_is_refused(server: VllmServer) -> None:
    bad = httpx.request("DELETE", f"{server.url}/v1/kv", timeout=30, json={})
    assert bad.status_code == 400 and "exactly one of" in bad.json()["error"]["message"]
