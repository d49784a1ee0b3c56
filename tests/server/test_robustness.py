"""`kvtier serve` tried as a hostile or careless client would, over HTTP against a real
server process (the tiny model): every bad request gets its own 4xx/5xx in OpenAI's shape,
another tenant's stream completes, the next request is served, and /health tells the truth.
Failures inside the engine are injected (`kvtier/engine/faults.py`): seed 13 fails in
sampling, seed 14 fails its forward pass."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import start_server
from prometheus_client.parser import text_string_to_metric_families

FAULTS = {"KVTIER_FAULT_SAMPLE_SEED": "13", "KVTIER_FAULT_STEP_SEED": "14"}


@pytest.fixture(scope="module")
def started() -> Iterator[tuple[Any, str]]:
    proc, url = start_server("--num-device-blocks", "64", "--kv-offloading-size", "0.02",
                             env=FAULTS)
    yield proc, url
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert "Traceback" not in out.split("kvtier serve: shut down")[-1]


@pytest.fixture(scope="module")
def server(started: tuple[Any, str]) -> str:
    return started[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def post(url: str, body: dict[str, Any] | str, path: str = "/v1/completions",
         **kw: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


def ok(url: str, **extra: Any) -> dict[str, Any]:
    r = post(url, {"model": "tiny", "prompt": "The sky is", "max_tokens": 4,
                   "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def health_s(url: str) -> float:
    start = time.perf_counter()
    r = httpx.get(url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} not in /metrics")


class Stream(threading.Thread):
    """Another tenant's long streamed completion, read in the background."""

    def __init__(self, url: str, max_tokens: int = 48) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.chunks.append(json.loads(line[6:]))
                    self.started.set()
        self.started.set()

    @property
    def finish_reason(self) -> str | None:
        last = self.chunks[-1] if self.chunks else {}
        return "error" if "error" in last else (last.get("choices") or [{}])[0].get(
            "finish_reason")


def test_a_request_failing_in_sampling_fails_alone(server: str) -> None:
    other = Stream(server)
    other.start()
    assert other.started.wait(60)
    r = post(server, {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0.7,
                      "seed": 13})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "sampling" in r.json()["error"][
        "message"]
    assert health_s(server) < 1.0
    other.join(120)
    assert other.done and other.finish_reason == "length"  # the other stream never noticed
    ok(server)  # and the engine serves on
    assert metric(server, "kvtier_requests_total", status="error") >= 1


def test_a_failing_forward_pass_fails_its_step_and_the_engine_serves_on(server: str) -> None:
    for stream in (False, True):
        r = post(server, {"model": "tiny", "prompt": "hello", "max_tokens": 8,
                          "temperature": 0.5, "seed": 14, "stream": stream})
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"
    ok(server)
    assert health_s(server) < 1.0
    deadline = time.monotonic() + 10
    while metric(server, "kvtier_device_blocks", state="used") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "kvtier_device_blocks", state="used") == 0  # no leaked block


@pytest.mark.parametrize("field,value,named", [
    ("temperature", "Infinity", "temperature"), ("temperature", "NaN", "temperature"),
    ("temperature", "1e999", "temperature"), ("temperature", "1000", "temperature"),
    ("top_p", "0", "top_p"), ("seed", str(2**70), "seed"), ("seed", "-1", "seed"),
    ("seed", '"5"', "seed"), ("max_tokens", '"5"', "max_tokens"),
    ("max_tokens", "true", "max_tokens"), ("stream", '"yes"', "stream"),
    ("top_k", "2.5", "top_k"), ("frequency_penalty", "0.5", "frequency_penalty"),
    ("logit_bias", '{"5": 10}', "logit_bias"), ("logprobs", "30", "logprobs"),
    ("response_format", '{"type": "json_object"}', "response_format"),
    ("cache_salt", json.dumps("s" * 257), "cache_salt"),
])
def test_values_the_engine_cannot_use_are_400s_naming_them(server: str, field: str,
                                                           value: str, named: str) -> None:
    r = post(server, f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}')
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


def test_logprobs_come_back_in_openais_shapes(server: str) -> None:
    out = ok(server, logprobs=3)["choices"][0]["logprobs"]
    assert len(out["tokens"]) == len(out["token_logprobs"]) == len(out["top_logprobs"]) == 4
    for chosen, top in zip(out["token_logprobs"], out["top_logprobs"]):
        # keyed by text, as OpenAI's: two ids that decode alike (a partial UTF-8 byte) merge
        assert 1 <= len(top) <= 3 and chosen <= 0.0
        assert chosen == max(top.values())  # greedy: the chosen token is the most likely
    assert out["text_offset"] == sorted(out["text_offset"])
    r = post(server, {"model": "tiny", "max_tokens": 3, "temperature": 0, "logprobs": True,
                      "top_logprobs": 2, "messages": [{"role": "user", "content": "Hi"}]},
             path="/v1/chat/completions")
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    refused = post(server, {"model": "tiny", "max_tokens": 3, "top_logprobs": 2,
                            "messages": [{"role": "user", "content": "Hi"}]},
                   path="/v1/chat/completions")
    assert refused.status_code == 400 and "logprobs=true" in refused.json()["error"]["message"]
    streamed = post(server, {"model": "tiny", "prompt": "hi", "logprobs": 2, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_values_that_mean_off_or_greedy_are_served(server: str) -> None:
    ok(server, frequency_penalty=0, logit_bias={}, response_format={"type": "text"})
    tiny_t = ok(server, temperature=1e-30)  # below vLLM's epsilon: greedy, never NaN
    assert tiny_t["choices"][0]["text"] == ok(server)["choices"][0]["text"]


@pytest.mark.parametrize("body,named", [
    ('{"model": "tiny", "prompt": ' + "[" * 200 + "]" * 200 + "}", "nests deeper"),
    ('{"model": "tiny", "prompt": "\\ud800 lone"}', "surrogate"),
    ('{"model": "tiny", "prompt": "hi"', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_malformed_bodies_are_400s_not_500s(server: str, body: str, named: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


@pytest.mark.parametrize("content,status", [
    ([{"type": "text", "text": 5}], 400), ([{"type": "image_url", "image_url": {}}], 400),
    ([1, 2], 400), ([{"type": "text", "text": "Hi"}], 200),
])
def test_chat_content_parts_are_checked(server: str, content: Any, status: int) -> None:
    r = post(server, {"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": content}]},
             path="/v1/chat/completions")
    assert r.status_code == status, r.text


def test_an_assistant_turn_with_only_tool_calls_is_accepted(server: str) -> None:
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "user", "content": "Well?"}]
    r = post(server, {"model": "tiny", "max_tokens": 2, "messages": messages},
             path="/v1/chat/completions")
    assert r.status_code == 200, r.text


def test_bodies_and_prompts_are_bounded_before_any_work(started: tuple[Any, str]) -> None:
    proc, server = started
    rss_before = rss_bytes(proc.pid)
    start = time.perf_counter()
    big = post(server, {"model": "tiny", "prompt": "a" * (52 << 20)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - start < 10
    chunked = httpx.post(server + "/v1/completions", timeout=60,
                         content=(b"x" * (1 << 20) for _ in range(4)))  # no Content-Length
    assert chunked.status_code == 413
    # within the body limit, but more characters than any context holds: no tokenizing
    long = post(server, {"model": "tiny", "prompt": "ab " * 23_400})  # 70 KB
    assert long.status_code == 400 and "characters" in long.json()["error"]["message"]
    assert health_s(server) < 1.0
    # the 52 MB body was refused from its Content-Length: never read, never held
    assert rss_bytes(proc.pid) - rss_before < 32 << 20


def test_a_whole_request_is_aborted_when_its_client_goes(server: str) -> None:
    before = metric(server, "kvtier_requests_total", status="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", timeout=0.5, json={
            "model": "tiny", "prompt": "Tell me a story", "max_tokens": 900,
            "ignore_eos": True})
    deadline = time.monotonic() + 10
    while (metric(server, "kvtier_requests_total", status="abort") == before
           and time.monotonic() < deadline):
        time.sleep(0.1)
    assert metric(server, "kvtier_requests_total", status="abort") == before + 1
    assert metric(server, "kvtier_device_blocks", state="used") == 0


def test_response_ids_are_unique(server: str) -> None:
    ids = {ok(server)["id"] for _ in range(3)}
    assert len(ids) == 3 and "cmpl-0" not in ids and all(i.startswith("cmpl-") for i in ids)


def test_oversized_headers_are_refused_and_the_server_serves_on(server: str) -> None:
    # uvicorn (h11) stops reading past 64 KiB of headers, answers 400 and closes the socket;
    # the unread rest of the headers turns that close into a reset the client may see first
    try:
        r = httpx.post(server + "/v1/completions", timeout=10,
                       json={"model": "tiny", "prompt": "x"},
                       headers={"authorization": "Bearer " + "k" * (200 << 10)})
        assert r.status_code in (400, 431)
    except httpx.ReadError:
        pass
    ok(server)
    assert health_s(server) < 1.0


def test_a_dead_engine_makes_health_503_and_the_server_exit_non_zero() -> None:
    proc, url = start_server("--num-device-blocks", "32", env={"KVTIER_FAULT_FATAL_SEED": "99"})
    try:
        r = post(url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "seed": 99,
                       "temperature": 0.5})
        assert r.status_code in (500, 503) and r.json()["error"]["type"] == "server_error"
        out, _ = proc.communicate(timeout=60)  # it stops on its own
        assert proc.returncode == 1, out
        assert "the engine died" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_then_ends_open_streams_with_an_error_and_exits() -> None:
    proc, url = start_server("--num-device-blocks", "64", "--shutdown-timeout", "1")
    streams = [Stream(url, max_tokens=900) for _ in range(2)]  # longer than the drain
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for s in streams:
        s.join(30)
        assert s.done, s.chunks[-1:]  # every client saw the end of its stream ...
        assert s.finish_reason in ("length", "error")  # ... a whole answer, or why not
    assert any(s.finish_reason == "error" for s in streams)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 1 + 5 + 5  # drain, slack, shutdown
    assert "requests still open were ended" in out


def test_a_client_trickling_headers_is_cut_off_at_the_header_timeout() -> None:
    proc, url = start_server("--num-device-blocks", "16", "--header-timeout", "1")
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.settimeout(0.25)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvtier\r\n")
            start, closed = time.monotonic(), False
            while not closed and time.monotonic() - start < 8:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")  # one header line at a time, never done
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
            assert closed and time.monotonic() - start < 4
        assert health_s(url) < 1.0
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


BAD_BODIES = [
    '{"model": "tiny", "prompt": "hi", "temperature": Infinity}',
    '{"model": "tiny", "prompt": "hi", "seed": 1180591620717411303424}',
    '{"model": "tiny", "prompt": "hi", "max_tokens": "5"}',
    '{"model": "tiny", "prompt": "hi", "logit_bias": {"5": 1}}',
    '{"model": "tiny", "prompt": ' + "[" * 300 + "]" * 300 + "}",
    '{"model": "tiny", "prompt": "\\ud800"}',
    '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "seed": 13}',
]


def test_a_stream_of_another_tenant_survives_every_kind_of_bad_request(server: str) -> None:
    other = Stream(server, max_tokens=120)
    other.start()
    assert other.started.wait(60)
    for body in BAD_BODIES:
        path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
        r = post(server, body, path=path)
        assert 400 <= r.status_code <= 500 and r.json()["error"]["message"], body[:80]
        assert health_s(server) < 1.0
    other.join(120)
    assert other.done and other.finish_reason == "length"
    ok(server)
    assert metric(server, "kvtier_device_blocks", state="used") == 0


def test_a_queued_stream_is_aborted_when_its_client_goes() -> None:
    proc, url = start_server("--num-device-blocks", "64", "--max-num-seqs", "1")
    try:
        running = Stream(url, max_tokens=900)  # holds the only slot for ~4 s
        running.start()
        assert running.started.wait(60)
        body = {"model": "tiny", "prompt": "queued", "max_tokens": 8, "stream": True}
        with (pytest.raises(httpx.ReadTimeout),  # queued behind it: no first byte in time
              httpx.stream("POST", url + "/v1/completions", json=body, timeout=0.5) as r):
            r.read()
        deadline = time.monotonic() + 10
        while metric(url, "kvtier_requests_total", status="abort") < 1:
            assert time.monotonic() < deadline, "the queued request was not aborted"
            time.sleep(0.1)
        assert not running.done  # aborted while the other was still generating
        running.join(120)
        assert running.done
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
