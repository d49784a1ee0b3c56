"""The connector's two halves with the disk and Redis tiers, as vLLM runs them (bookkeeping on
the scheduler side, bytes on the worker side, joined only by jobs and results), here in one
process with real bytes and no vLLM: vLLM CPU's per-layer layout of 2 layers, 16 blocks of 4
tokens. `Half.step` is one vLLM step: metadata out, worker hooks, worker metadata back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_file import blocks_on_disk, flip_payload_byte

from kvtier.integrations.kit.counters import flat
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.integrations.vllm.worker_side import ExpectedLayout, WorkerSide
from kvtier.tier import Calibration, Fingerprint, TierConfig, build_scheduler_side, host_slot_count

BS, LAYERS, BLOCKS, SHAPE = 4, 2, 16, (2, 4, 16)  # [kv heads, block size, 2 * head size]
PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks, 12 tokens to restore
HOST_GIB = 1e-4  # ~100 slots of 1 KB


def nbytes(dtype: torch.dtype) -> int:
    return LAYERS * SHAPE[0] * SHAPE[1] * SHAPE[2] * torch.empty((), dtype=dtype).element_size()


class Half:
    """One vLLM process pair: a scheduler side and a worker side over its own KV memory."""

    def __init__(self, config: TierConfig, dtype: torch.dtype = torch.float32,
                 seed: int = 0, weights: str = "weights", writes_first: bool = False) -> None:
        torch.manual_seed(seed)
        self.kv = torch.randn(LAYERS, BLOCKS, *SHAPE).to(dtype)  # one storage, as vLLM CPU
        fp = Fingerprint(weights, "arch", str(dtype), BS, "")
        expected = ExpectedLayout(tuple(f"model.layers.{i}.self_attn.attn"
                                        for i in range(LAYERS)), BLOCKS, SHAPE, dtype,
                                  host_slot_count(config.kv_offloading_size, nbytes(dtype)))
        # vLLM builds the worker first (register_kv_caches), then the scheduler
        self.worker = WorkerSide(config, expected, fp.namespace(), BS,
                                 writes_first=writes_first)
        self.worker.register({f"model.layers.{i}.self_attn.attn": self.kv[i]
                              for i in range(LAYERS)})
        cal = Calibration(link_gbps=5.0, transfer_overhead_s=1e-4, prefill_tokens_per_s=1000.0)
        self.tier = build_scheduler_side(config, BS, nbytes(dtype), cal, fp.namespace())
        self.side = SchedulerSide(self.tier.manager, BS, fp.namespace)
        self.stats: dict[str, float] = {}  # as vLLM's log line writes them

    def step(self, scheduled: list[Scheduled] | None = None) -> None:
        jobs = self.side.step(scheduled or [])
        self.worker.start_below(jobs)  # vLLM binds the metadata before its forward pass
        self.worker.load(jobs)  # and starts the loads after it: nothing below runs twice
        self.worker.save(jobs)
        self.side.apply(self.worker.take_results())
        for key, value in flat(self.side.take_stats()).items():
            self.stats[key] = self.stats.get(key, 0) + value

    def settle(self, timeout: float = 10.0) -> None:
        """vLLM steps while `has_pending_push_work` (the connector's `busy`) says so."""
        deadline = time.monotonic() + timeout
        while self.side.busy:
            assert time.monotonic() < deadline, "jobs below host never landed"
            self.step()
            time.sleep(0.002)

    def matched(self, rid: str, prompt: list[int], timeout: float = 10.0) -> int:
        """get_num_new_matched_tokens, asked once a step until it answers (None = later)."""
        deadline = time.monotonic() + timeout
        while (n := self.side.matched_tokens(rid, prompt, "", 0)) is None:
            assert time.monotonic() < deadline, "the match never resolved"
            self.step()
            time.sleep(0.002)
        return n

    def serve(self, rid: str, prompt: list[int], blocks: list[int]) -> dict[str, Any]:
        """One request computed in one step (its full blocks stored), finished, settled."""
        external = self.matched(rid, prompt)
        self.side.allocated(rid, [blocks], external)
        self.step([Scheduled(rid, [blocks], len(prompt))])
        params = self.side.finished(rid)
        self.settle()
        return params

    def block(self, i: int) -> torch.Tensor:
        return self.kv[:, i].clone()

    def close(self) -> None:
        self.worker.close()
        self.tier.close()


def disk(tmp_path: Path, **more: Any) -> TierConfig:
    return TierConfig.of(kv_offloading_size=HOST_GIB, disk_kv_path=str(tmp_path / "kv"),
                      disk_kv_size=1e-3, disk_kv_read_gbps=2.0, **more)


def first_run(config: TierConfig) -> list[torch.Tensor]:
    """Process 1 serves the prompt and exits; the bytes of its three full blocks."""
    a = Half(config)
    params = a.serve("a", PROMPT, [1, 2, 3, 4])
    assert params["kvtier_restored_tokens"] == 0
    written = (a.stats.get("written_blocks{tier=disk}", 0)
               + a.stats.get("written_blocks{tier=remote}", 0))
    assert written >= 3
    blocks = [a.block(i) for i in (1, 2, 3)]
    a.close()
    return blocks


def test_a_producer_lands_its_writes_below_host_before_its_next_forward_pass(
        tmp_path: Path) -> None:
    a = Half(disk(tmp_path), writes_first=True)  # vLLM's kv_role kv_producer
    a.side.allocated("a", [[1, 2, 3, 4]], a.matched("a", PROMPT))
    a.step([Scheduled("a", [[1, 2, 3, 4]], len(PROMPT))])  # stored to host, writes decided
    a.step()  # the writes are submitted, and land before the step goes on to compute
    assert a.stats["written_blocks{tier=disk}"] == 3
    assert not a.side.busy
    a.close()


def test_a_restarted_process_restores_the_prefix_from_disk_exactly(tmp_path: Path) -> None:
    config = disk(tmp_path)
    original = first_run(config)
    b = Half(config, seed=1)  # other bytes in its KV memory: nothing is left over by chance
    assert b.matched("b", PROMPT) == 12  # fetched disk -> host, verified, then offered
    b.side.allocated("b", [[5, 6, 7, 8]], 12)
    b.step([Scheduled("b", [[5, 6, 7, 8]], 14)])
    for got, want in zip((b.block(5), b.block(6), b.block(7)), original):
        assert torch.equal(got, want)
    params = b.side.finished("b")
    assert params["kvtier_residency"] == "disk" and params["kvtier_restored_tokens"] == 12
    assert b.stats["fetched_blocks{tier=disk}"] == 3 and b.stats["restored_tokens"] == 12
    # where its wake's time went: every mark of a disk wake, in the order they happen
    marks = params["kvtier_timeline"]
    order = ["fetch_started", "fetch_began", "fetch_ended", "fetch_applied", "answered",
             "allocated", "load_began", "load_ended", "finished"]
    assert [marks[f"{m}_ms"] for m in order] == sorted(marks[f"{m}_ms"] for m in order)
    assert marks["fetch_started_ms"] >= 0 and marks["asked_at"] > 0
    b.close()


def test_a_flipped_byte_on_disk_ends_the_prefix_there_and_is_counted(tmp_path: Path) -> None:
    config = disk(tmp_path)
    original = first_run(config)
    second = tuple(PROMPT[4:8])
    bad_slot = blocks_on_disk(config, nbytes(torch.float32), BS)[second]
    flip_payload_byte(config, nbytes(torch.float32), BS, second)
    b = Half(config, seed=1)
    assert b.matched("b", PROMPT) == 4  # the first block only: a prefix cannot skip one
    b.side.allocated("b", [[5, 6, 7, 8]], 4)
    b.step([Scheduled("b", [[5, 6, 7, 8]], 14)])
    assert torch.equal(b.block(5), original[0])
    assert b.stats["miss_blocks{tier=disk,reason=checksum}"] == 1
    assert b.side.finished("b")["kvtier_restored_tokens"] == 4
    b.settle()
    b.close()
    # the bad slot was invalidated where it lives, and the recomputed block written afresh
    assert blocks_on_disk(config, nbytes(torch.float32), BS)[second] != bad_slot
    c = Half(config, seed=2)
    assert c.matched("c", PROMPT) == 12
    c.close()


@pytest.mark.parametrize("change", ["dtype", "block_size"])
def test_another_dtype_or_block_size_finds_nothing_on_disk(tmp_path: Path, change: str) -> None:
    first_run(disk(tmp_path))
    if change == "dtype":
        b = Half(disk(tmp_path), dtype=torch.bfloat16)
        assert b.matched("b", PROMPT) == 0
    else:  # the same bytes per block under another block size's namespace and file geometry
        config = disk(tmp_path)
        fp = Fingerprint("weights", "arch", str(torch.float32), 8, "")
        cal = Calibration(link_gbps=5.0, transfer_overhead_s=1e-4, prefill_tokens_per_s=1e3)
        tier = build_scheduler_side(config, 8, nbytes(torch.float32), cal, fp.namespace())
        side = SchedulerSide(tier.manager, 8, fp.namespace)
        assert side.matched_tokens("b", PROMPT, "", 0) == 0
        assert tier.manager.below is not None and not tier.manager.below.busy
        tier.close()
        return
    assert not b.side.busy and b.stats.get("fetched_blocks{tier=disk}", 0) == 0
    b.close()


def test_two_processes_share_one_redis(tmp_path: Path, redis_server: Any) -> None:
    config = TierConfig.of(kv_offloading_size=HOST_GIB, remote_kv_url=redis_server.url,
                        remote_kv_read_gbps=1.0)
    a = Half(config)
    b = Half(config, seed=1)  # both running at once, each with its own host pool
    assert a.serve("a", PROMPT, [1, 2, 3, 4])["kvtier_restored_tokens"] == 0
    assert a.stats["written_blocks{tier=remote}"] == 3
    assert b.matched("b", PROMPT) == 12  # presence asked, then fetched and verified
    b.side.allocated("b", [[5, 6, 7, 8]], 12)
    b.step([Scheduled("b", [[5, 6, 7, 8]], 14)])
    for i, j in ((1, 5), (2, 6), (3, 7)):
        assert torch.equal(b.block(j), a.block(i))
    assert b.side.finished("b")["kvtier_residency"] == "remote"
    assert b.stats["fetched_blocks{tier=remote}"] == 3
    a.close()
    b.close()


def test_a_later_retention_reaches_the_ttl_of_blocks_already_in_redis(
        redis_server: Any) -> None:
    """Blocks written to Redis under the plain TTL, retained by a later request that
    restores them from host: the scheduler side's renewal travels to the worker side like
    any job, and Redis keeps each block as long as the retention."""
    config = TierConfig.of(kv_offloading_size=HOST_GIB, remote_kv_url=redis_server.url,
                        remote_kv_ttl_s=30.0)
    a = Half(config)
    a.serve("a", PROMPT, [1, 2, 3, 4])
    with redis_server.client() as client:
        names = list(client.scan_iter(count=1000))
        assert len(names) == 3 and all(0 < client.pttl(n) <= 30_000 for n in names)
    assert a.matched("b", PROMPT) == 12
    a.side.allocated("b", [[5, 6, 7, 8]], 12)
    a.step([Scheduled("b", [[5, 6, 7, 8]], 14)])
    answer = a.side.answer("b", {"kvtier_retention_s": 3600})
    assert answer["kvtier_retention_s"] == 3600.0
    assert answer["kvtier_read_tokens"] == answer["kvtier_retention_kept"] == 12  # all read
    a.side.finished("b")
    a.settle()
    with redis_server.client() as client:
        assert all(3_500_000 < client.pttl(n) <= 3_600_000 for n in names)
    assert a.stats["renewed_blocks{tier=remote}"] == 3
    a.close()


def test_the_disk_file_is_left_whole_when_the_worker_closes_with_writes_queued(
        tmp_path: Path) -> None:
    config = disk(tmp_path)
    a = Half(config)
    a.side.matched_tokens("a", PROMPT, "", 0)
    a.side.allocated("a", [[1, 2, 3, 4]], 0)
    a.step([Scheduled("a", [[1, 2, 3, 4]], 14)])  # stored on host; the writes are decided
    a.step()  # ... and handed to the worker's I/O thread, then the process stops at once
    a.close()
    assert sorted(blocks_on_disk(config, nbytes(torch.float32), BS)) == sorted(
        tuple(PROMPT[i:i + 4]) for i in (0, 4, 8))


def test_blocks_of_another_fingerprint_on_disk_are_counted_at_start(tmp_path: Path) -> None:
    """The weights changed between two processes (another namespace): the new one serves none
    of the old blocks, and says how many it refused and why before anything is asked."""
    config = disk(tmp_path)
    first_run(config)
    b = Half(config, seed=1, weights="other weights")
    assert b.matched("b", PROMPT) == 0
    b.step()
    assert b.stats["miss_blocks{tier=disk,reason=fingerprint}"] == 3
    assert "fetched_blocks{tier=disk}" not in b.stats
    b.close()


def test_an_idle_step_waits_for_its_fetch_and_the_next_ask_is_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.integrations.vllm.worker_side as worker_side

    monkeypatch.setattr(worker_side, "IDLE_FETCH_WAIT_S", 10.0)  # a loaded CI machine too
    config = disk(tmp_path)
    first_run(config)
    b = Half(config, seed=1)
    assert b.side.matched_tokens("b", PROMPT, "", 0) is None  # the fetch below host starts
    jobs = b.side.step([])
    b.worker.load(jobs, idle=True)  # the step computes nothing: it waits for the fetch
    b.side.apply(b.worker.take_results())
    assert b.side.matched_tokens("b", PROMPT, "", 0) == 12  # no empty steps in between
    b.close()
