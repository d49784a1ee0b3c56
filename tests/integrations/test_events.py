"""kvtier's host and disk residency as vLLM's KV events, driven through the connector's
scheduler half with plain values (no vLLM: its event classes are stood in for by ones with the
same fields, and vLLM's block hashes by a hash of each token prefix). Block size 4."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.kit.events import BlockOrigin, KVEvents
from kvtier.integrations.kit.groups import Window
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.tier import ChangeKind, Fingerprint, Medium, ResidencyChange, Result, TierConfig
from kvtier.tier.books.below import BelowHost
from kvtier.tier.books.host import HostTier
from kvtier.tier.books.manager import TierManager, job_ids
from kvtier.tier.books.residency_log import ResidencyLog
from kvtier.tier.keys import hash_blocks
from kvtier.tier.planner import Calibration, Planner
from kvtier.tier.stores.disk.index import DiskTier

BS = 4
FP = Fingerprint("w", "arch", "bf16", BS, "")
MEDIA = {Medium.HOST: "CPU", Medium.DISK: "STORAGE"}
KINDS = [("full_attention", None), ("sliding_window", 8)]  # per KV cache group
A = list(range(100, 112))  # 3 full blocks
B = list(range(200, 216))  # 4 full blocks


@dataclass
class BlockStored:
    """vLLM's event, by the fields kvtier fills."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: list[Any]
    group_idx: int
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    session_id: str | None


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str
    group_idx: int


@dataclass
class AllBlocksCleared:
    pass


def vhash(prefix: list[int]) -> int:
    """vLLM's hash of the block ending `prefix` (a stand-in: any chain of the whole prefix)."""
    return int.from_bytes(hashlib.sha256(repr(prefix).encode()).digest()[:8], "big")


class Vllm:
    """vLLM's live requests (id -> token ids) and what it would say of their blocks."""

    def __init__(self) -> None:
        self.live: dict[str, list[int]] = {}

    def origin(self, request_id: str, group: int, index: int) -> BlockOrigin | None:
        tokens = self.live.get(request_id)
        if tokens is None or (index + 1) * BS > len(tokens):
            return None
        return BlockOrigin(vhash(tokens[:(index + 1) * BS]),
                           vhash(tokens[:index * BS]) if index else None,
                           tuple(tokens[index * BS:(index + 1) * BS]), group, *KINDS[group],
                           extra_keys=("salt",) if index == 0 else None, session_id="s")


class Rig:
    """The scheduler side over a host (and a disk) whose changes are logged, and the events."""

    def __init__(self, host: int = 4, disk: int = 0, adopted: list[int] | None = None,
                 windows: tuple[Window | None, ...] = (None,)) -> None:
        """`adopted`: a prompt whose blocks an earlier process left on the disk."""
        self.log = ResidencyLog()
        cal = Calibration(link_gbps=10.0, transfer_overhead_s=0.0, prefill_tokens_per_s=100.0,
                          tier_gbps={"disk": 10.0})
        tier, ids = HostTier(host, log=self.log), job_ids()
        disks = [DiskTier(disk, log=self.log)] if disk else []
        if adopted is not None:
            keys = hash_blocks(FP.namespace(""), adopted, BS)
            disks[0].adopt((i, k, adopted[i * BS:(i + 1) * BS]) for i, k in enumerate(keys))
        below = BelowHost(tier, disks, 1000, ids)
        manager = TierManager(TierConfig.of(kv_offloading_size=1), BS, tier, Planner(cal), 1000,
                              below, ids, self.log)
        self.vllm = Vllm()
        self.events = KVEvents(self.vllm.origin, BS, MEDIA, BlockStored, BlockRemoved,
                               AllBlocksCleared)
        self.side = SchedulerSide(manager, BS, FP.namespace, windows=windows,
                                  recorder=self.events)

    def take(self) -> list[Any]:
        return self.events.take(self.side.manager.take_residency_changes())

    def run(self, jobs: list[Any] | None = None, ok: bool = True) -> None:
        """Answer the jobs (every one decided, when not given), as the worker would."""
        jobs = self.side.step([]) if jobs is None else jobs
        self.side.apply([Result.whole(j.id, j.num_blocks, ok, 1000 * j.num_blocks, 1e-4)
                         for j in jobs])

    def serve(self, rid: str, prompt: list[int], ok: bool = True, groups: int = 1) -> None:
        """One request with no hit: computed in one step, its full blocks stored, finished."""
        self.vllm.live[rid] = prompt
        ids = [list(range(1 + 8 * g, 9 + 8 * g)) for g in range(groups)]
        self.side.matched_tokens(rid, prompt, "", 0)
        self.side.allocated(rid, ids, 0)
        self.run(self.side.step([Scheduled(rid, ids, len(prompt))]), ok)
        self.side.finished(rid)
        del self.vllm.live[rid]


def stored(prompt: list[int], first: int, n: int, medium: str = "CPU", group: int = 0
           ) -> BlockStored:
    """What vLLM says of blocks first..first+n-1 of `prompt` stored on `medium`."""
    end = first + n
    return BlockStored([vhash(prompt[:(i + 1) * BS]) for i in range(first, end)],
                       vhash(prompt[:first * BS]) if first else None,
                       prompt[first * BS:end * BS], BS, None, medium, None,
                       [("salt",) if i == 0 else None for i in range(first, end)], group,
                       *KINDS[group], "s")


def removed(prompt: list[int], first: int, n: int, medium: str = "CPU", group: int = 0
            ) -> BlockRemoved:
    """An eviction's withdrawal: a prefix leaves a tier from its tail."""
    return BlockRemoved([vhash(prompt[:(i + 1) * BS])
                         for i in reversed(range(first, first + n))], medium, group)


def test_a_prompt_stored_to_host_is_published_then_withdrawn_when_evicted() -> None:
    # host 4: A's 3 blocks land -> one CPU store of their chain, under vLLM's hashes;
    # B's 4 blocks evict all of A's -> A withdrawn, B published; only resident origins kept
    rig = Rig(host=4)
    rig.serve("a", A)
    assert rig.take() == [stored(A, 0, 3)]
    assert rig.events.kept == 3
    rig.serve("b", B)
    assert rig.take() == [removed(A, 0, 3), stored(B, 0, 4)]
    assert rig.events.kept == 4


def test_a_store_that_lands_after_its_request_finished_is_still_published() -> None:
    # vLLM finishes a request before it hands back the step's results: the origin was taken
    # when the block went to the tier, not when its store landed
    rig = Rig()
    rig.vllm.live["a"] = A
    rig.side.matched_tokens("a", A, "", 0)
    rig.side.allocated("a", [[1, 2, 3, 4]], 0)
    jobs = rig.side.step([Scheduled("a", [[1, 2, 3, 4]], len(A))])
    rig.side.finished("a")
    del rig.vllm.live["a"]
    rig.run(jobs)
    assert rig.take() == [stored(A, 0, 3)]


def test_a_failed_store_publishes_nothing_and_keeps_nothing() -> None:
    rig = Rig()
    rig.serve("a", A, ok=False)
    assert rig.take() == [] and rig.events.kept == 0


def test_a_request_vllm_has_no_hashes_for_is_neither_published_nor_kept() -> None:
    rig = Rig()
    rig.side.matched_tokens("x", A, "", 0)  # vLLM knows no such live request
    rig.side.allocated("x", [[1, 2, 3, 4]], 0)
    rig.run(rig.side.step([Scheduled("x", [[1, 2, 3, 4]], len(A))]))
    assert rig.side.manager.report().host.stores == 3  # kvtier stored them
    assert rig.take() == [] and rig.events.kept == 0


def test_disk_is_published_as_storage_and_a_block_fetched_back_up_as_cpu_again() -> None:
    # host 3 over disk 8: A lands on host (CPU), then on disk (STORAGE); B evicts A from host
    # (A withdrawn from CPU only: still STORAGE); A asked again is fetched up from disk and
    # published as CPU again (B's blocks evicted for it withdrawn from CPU)
    rig = Rig(host=3, disk=8)
    rig.serve("a", A)
    rig.run()  # the write on to disk
    assert rig.take() == [stored(A, 0, 3), stored(A, 0, 3, "STORAGE")]
    rig.serve("b", B[:12])
    rig.run()
    assert rig.take() == [removed(A, 0, 3), stored(B, 0, 3), stored(B, 0, 3, "STORAGE")]
    follow = [*A, 1, 2]
    rig.vllm.live["a2"] = follow
    assert rig.side.matched_tokens("a2", follow, "", 0) is None  # fetching from disk
    rig.run()
    assert rig.take() == [removed(B, 0, 3), stored(A, 0, 3)]
    assert rig.side.matched_tokens("a2", follow, "", 0) == 12
    rig.side.allocated("a2", [[1, 2, 3, 4]], 12)
    assert rig.events.kept == 6  # A on host and disk, B on disk


def test_blocks_found_on_disk_after_a_restart_are_published_only_once_fetched_for_a_request(
        ) -> None:
    # the disk holds A from an earlier process: no origin, so no STORAGE event; a request
    # for A fetches it up, and its host copy is published under that request's hashes
    rig = Rig(host=4, disk=8, adopted=A)
    follow = [*A, 1, 2]
    rig.vllm.live["r"] = follow
    assert rig.side.matched_tokens("r", follow, "", 0) is None
    rig.run()
    assert rig.take() == [stored(A, 0, 3)]
    rig.side.allocated("r", [[1, 2, 3, 4]], 12)
    assert rig.events.kept == 3  # the host copies; the disk's are not published


def test_a_fetch_whose_request_left_before_it_landed_publishes_nothing() -> None:
    rig = Rig(host=4, disk=8, adopted=A)
    rig.vllm.live["r"] = [*A, 1]
    assert rig.side.matched_tokens("r", [*A, 1], "", 0) is None
    rig.side.finished("r")  # aborted while its fetch is on its way: its origins go
    assert rig.events.kept == 0
    rig.run()
    assert rig.take() == []


def test_each_kv_cache_group_is_published_under_its_group_index() -> None:
    # a full-attention group and a window of 8 tokens: of a 16-token prompt the full group
    # stores 4 blocks, the window group the window before the prompt's boundary (blocks 1-2),
    # each published under vLLM's hash of the block and its group's index
    rig = Rig(host=8, windows=(None, Window(8, 0, BS)))
    rig.serve("b", B, groups=2)
    assert rig.take() == [stored(B, 0, 4), stored(B, 1, 2, group=1)]


def test_only_host_and_disk_are_published() -> None:
    # a shared store's residency (or the device's) is never claimed, even for a known block
    rig = Rig()
    rig.serve("a", A)
    assert rig.take() == [stored(A, 0, 3)]
    first = hash_blocks(FP.namespace(""), A, BS)[0]
    for medium in (Medium.REDIS, Medium.DEVICE):
        assert rig.events.take([ResidencyChange(first, medium, ChangeKind.STORED)]) == []
    # a change of one block of a chain is an event of its own, its parent named
    assert rig.events.take([ResidencyChange(first, Medium.HOST, ChangeKind.REMOVED)]) == [
        removed(A, 0, 1)]


def test_a_cache_reset_is_one_all_blocks_cleared_and_nothing_withdrawn_after_it() -> None:
    # host 4: A published; vLLM resets (kvtier drops its host blocks) -> AllBlocksCleared,
    # never a removal of A, and nothing of A kept; B after the reset is published as usual
    rig = Rig(host=4)
    rig.serve("a", A)
    assert rig.take() == [stored(A, 0, 3)]
    rig.events.reset()
    rig.side.reset()
    assert rig.take() == [AllBlocksCleared()] and rig.events.kept == 0
    rig.serve("b", B)
    assert rig.take() == [stored(B, 0, 4)]
