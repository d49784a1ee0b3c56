"""`kvtier serve` on loopback, driven by the real `openai` client: chat and completions,
streaming and not, usage and residency, tenants, bad input, disconnects, /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import start_server
from prometheus_client.parser import text_string_to_metric_families

KEYS = {"key-a": "alice", "key-b": "bob"}
CONVERSATION = [{"role": "system", "content": "You answer briefly. " * 10},
                {"role": "user", "content": "Name a colour of the sky, please."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    proc, url = start_server("--num-device-blocks", "64", "--kv-offloading-size", "0.02",
                             "--idle-offload-s", "0.3", "--api-keys-file", str(keys))
    yield url
    proc.terminate()  # SIGTERM: graceful shutdown (uvicorn then re-raises the signal)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode in (0, -15), out
    assert "pools released" in out


def client(url: str, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_chat_and_completions_whole_and_streamed(server: str) -> None:
    c = client(server)
    chat = c.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=6,
                                     temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 6 and chat.usage.prompt_tokens > 20
    pieces = list(c.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text == chat.choices[0].message.content  # greedy: the same answer, streamed
    assert pieces[-1].usage.completion_tokens == 6
    # the second identical request reused the first one's prefix blocks
    assert pieces[-1].usage.prompt_tokens_details.cached_tokens > 0
    comp = c.completions.create(model="tiny", prompt="The sky is", max_tokens=5, temperature=0,
                                extra_body={"top_k": 3, "cache_salt": "x"})
    assert comp.choices[0].finish_reason == "length"
    streamed = list(c.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4,
                                         temperature=0, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_woken_session_reports_host(server: str) -> None:
    # idle_offload_s=0.3: after a pause the conversation's KV is on host, and the next turn
    # says so in its header and usage
    with httpx.Client(base_url=server, headers={"authorization": "Bearer key-a"}) as h:
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [
            *CONVERSATION, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Why?"}]}
        first = h.post("/v1/chat/completions", json=body)
        assert first.status_code == 200
        time.sleep(2.0)  # well past idle_offload_s, even on a loaded machine
        again = h.post("/v1/chat/completions", json=body)
        assert again.headers["x-kvtier-residency"] == "host"
        usage = again.json()["usage"]
        assert usage["restored_tokens"] > 0 and usage["restore_ms"] >= 0


def test_tenants_never_share_a_prefix(server: str) -> None:
    prompt = "Tenant-private prefix that is long enough to fill a few blocks. " * 3
    a = client(server, "key-a").completions.create(model="tiny", prompt=prompt, max_tokens=2)
    b1 = client(server, "key-b").completions.create(model="tiny", prompt=prompt, max_tokens=2)
    a2 = client(server, "key-a").completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b1.usage.prompt_tokens_details.cached_tokens == 0  # never alice's blocks
    assert a2.usage.prompt_tokens_details.cached_tokens > 0  # alice's own prefix is reused


def test_auth_and_bad_input_are_openai_shaped_4xx(server: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    c = client(server)
    cases = [
        (lambda: c.chat.completions.create(model="nope", messages=CONVERSATION),
         openai.NotFoundError),
        (lambda: c.chat.completions.create(model="tiny", messages=[]), openai.BadRequestError),
        (lambda: c.completions.create(model="tiny", prompt="x" * 5000, max_tokens=2),
         openai.BadRequestError),
        (lambda: c.completions.create(model="tiny", prompt="hi", max_tokens=0),
         openai.BadRequestError),
        (lambda: c.completions.create(model="tiny", prompt="hi", n=2), openai.BadRequestError),
        (lambda: c.completions.create(model="tiny", prompt="hi", max_tokens=10**6),
         openai.BadRequestError),
    ]
    for call, error in cases:
        with pytest.raises(error) as info:
            call()
        assert info.value.body and "message" in info.value.body
    raw = httpx.post(f"{server}/v1/completions", content=b"{not json",
                     headers={"authorization": "Bearer key-a"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]


def test_disconnect_frees_blocks_and_metrics_parse(server: str) -> None:
    with httpx.Client(base_url=server, headers={"authorization": "Bearer key-a"}) as h, \
            h.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": "a long answer please", "max_tokens": 900,
                "stream": True}) as r:
        next(r.iter_lines())  # one chunk, then hang up
    deadline = time.monotonic() + 20  # the abort and in-flight stores land between steps
    while True:
        text = httpx.get(f"{server}/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        used = [s.value for s in families["kvtier_device_blocks"].samples
                if s.labels.get("state") == "used"]
        if used == [0.0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert used == [0.0]  # the abandoned request's blocks are back
    ttft = families["kvtier_time_to_first_token_seconds"]
    counts = {s.labels["residency"]: s.value for s in ttft.samples
              if s.name.endswith("_count")}
    assert counts["host"] >= 1 and counts["new"] >= 1
    assert "resident" in counts
