"""KvtierConnector: kvtier's tier under vLLM, through vLLM's KV-connector API (V1).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"kv_offloading_size": 4, "disk_kv_path": "/var/cache/kvtier",
                                    "disk_kv_size": 100, "remote_kv_url": "redis://host:6379/0"}}'

Each hook is a few lines over the tier library: the scheduler process holds a
`TierManager` (`SchedulerSide`: the host, disk and Redis indexes and the planner), each
worker process a `TierWorker` (`WorkerSide`: the host pool, the disk file, the Redis I/O),
joined by this step's jobs in the connector metadata and their results in the worker
metadata. vLLM keeps stepping while jobs are outstanding (`has_pending_push_work`), so the
write-on of a finished request's blocks to disk and Redis lands even when nothing follows.
Under tensor parallelism every rank's worker side keeps its own heads (`parallel.py`) and
the scheduler combines each job's ranks (`ranks.py`); under vLLM's hybrid allocator each KV
cache group keeps its own blocks, a sliding window only its window (`groups.py`). When vLLM
publishes KV events, kvtier's host and disk tiers are published beside its GPU (`events.py`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvtier.integrations.kit.counters import Count, merge, nest
from kvtier.integrations.kit.epochs import ChainIdentity
from kvtier.integrations.kit.events import UNPUBLISHED, KVEvents
from kvtier.integrations.kit.handoff import INVALID, expected, handed, invalid
from kvtier.integrations.kit.hook_clock import HookClock, timed
from kvtier.integrations.kit.identity import AdapterMemo, adapter_identity
from kvtier.integrations.kit.ranks import RankResults
from kvtier.integrations.vllm.deployment_plan import announce, deployment_plan
from kvtier.integrations.vllm.origins import kv_events
from kvtier.integrations.vllm.scheduler_side import Scheduled, SchedulerSide
from kvtier.integrations.vllm.settings import check_vllm_version, prior, settings
from kvtier.integrations.vllm.stats import KvtierPromMetrics, KvtierStats
from kvtier.integrations.vllm.worker_side import WorkerSide
from kvtier.tier import (
    HOOK_SECONDS,
    STEP_SECONDS,
    Faults,
    Job,
    Result,
    SchedulerTier,
    build_scheduler_side,
    request_tenant,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: the jobs to run around this forward pass, and the
    device blocks vLLM must recompute though it believes them restored (fail closed)."""

    jobs: tuple[Job, ...] = ()
    invalid: tuple[int, ...] = ()
    # finished requests whose last stores are among `jobs`: done once this step has saved
    sending: tuple[str, ...] = ()
    idle: bool = False  # no tokens scheduled: the worker may wait for fetches below host
    # loads among `jobs` vLLM waits on apart (job, request): not waited for in this step
    async_loads: tuple[tuple[int, str], ...] = ()
    received: tuple[str, ...] = ()  # requests vLLM waits on whose load was dropped


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once a step: how those jobs ended, per worker rank (vLLM merges
    the ranks' metadata; the scheduler combines each job's ranks, `RankResults`)."""

    by_rank: tuple[tuple[int, tuple[Result, ...]], ...] = ()
    # the worker's seconds in each hook since its last metadata, summed over its ranks
    hook_seconds: tuple[tuple[str, float], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.by_rank + other.by_rank,
                                    self.hook_seconds + other.hook_seconds)


def log_beside_vllm() -> None:
    """kvtier's log lines go where vLLM's do, at its level: vLLM configures only its own
    logger, so kvtier's INFO lines (who the tenants are, how the tier is sized) were lost."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:  # configured already, or vLLM's logging is off
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_beside_vllm()
        self.clock = HookClock()  # kvtier's own seconds in each hook (hook_clock.py)
        self._worker_hooks: Counter[str] = Counter()  # from the worker ranks' metadata
        check_vllm_version(vllm.__version__)
        self.config, self.settings = settings(
            self._kv_transfer_config.kv_connector_extra_config)
        scheduler = role is KVConnectorRole.SCHEDULER
        rank = 0 if scheduler else int(vllm_config.parallel_config.rank)
        plan = deployment_plan(vllm_config, kv_cache_config, self.config, self.settings, rank)
        self.tier: SchedulerTier | None = None
        self.scheduler: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.rank = rank
        self.world_size = plan.world_size
        self._ranks = RankResults(plan.world_size)
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[list[int]]] = {}  # per KV cache group
        self._adapters = AdapterMemo()  # this scheduler's view of the LoRA adapters it serves
        self.events: KVEvents | None = None  # only when vLLM publishes KV events
        # what block keys are chained from: moved to a new identity by each cache reset
        self.identity = ChainIdentity(plan.fingerprint, self.settings.model_identity_file)
        if scheduler:
            announce(plan, self.config)
            self.events = kv_events(vllm_config, kv_cache_config, self._requests.get,
                                    plan.block_size)
            self.tier = build_scheduler_side(plan.config, plan.block_size, plan.block_nbytes,
                                             prior(), plan.namespace, plan.expected.coded_shape,
                                             residency=self.events is not None)
            # vLLM's kv_role: a producer never loads from the tier, a consumer never stores
            role_of = self._kv_transfer_config
            self.scheduler = SchedulerSide(self.tier.manager, plan.block_size,
                                           self.identity.seed, plan.world_size,
                                           plan.windows, self.events or UNPUBLISHED,
                                           self.settings.async_loads,
                                           loads=role_of.is_kv_consumer,
                                           stores=role_of.is_kv_producer)
        else:
            role_of = self._kv_transfer_config  # a producer only: its writes land first
            self.worker_side = WorkerSide(plan.config, plan.expected, plan.namespace,
                                          plan.block_size, Faults.from_env(rank),
                                          writes_first=not role_of.is_kv_consumer)

    # -- scheduler side -----------------------------------------------------------------

    @timed(begins_step=True)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if request.mm_features or request.prompt_embeds is not None:
            return 0, False  # multimodal or embedding prompts: never stored, never loaded
        salt = _salt(request, self._adapters)
        if salt is None:
            return 0, False  # a LoRA adapter whose bytes kvtier cannot see: never cached
        self._requests[request.request_id] = request
        # the tenant whose quotas and counters its stores count against: its cache_salt where
        # the operator says its router sets it (kv_tenant_from), else the one tenant
        tenant = request_tenant(self.config.tenant_source, request.cache_salt)
        # a decode whose prefill ran on another engine waits for its blocks (handoff.py)
        handoff = expected(request.kv_transfer_params, self.settings.kv_handoff_wait_s)
        n = self.scheduler.matched_tokens(request.request_id, request.all_token_ids, salt,
                                          num_computed_tokens, request.num_prompt_tokens,
                                          tenant=tenant, handoff=handoff)
        return n, bool(n) and self.scheduler.loads_async(request.request_id)

    @timed(begins_step=True)
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if request.request_id in self._requests:
            self._blocks[request.request_id] = block_ids
            self.scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    @timed(begins_step=True)
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._requests:
                self._blocks[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.34 re-sends a resumed request in full among the new ones (above) and has no
        # resumed_req_ids; before it, a resumed one came here with all its blocks
        resumed = getattr(cached, "resumed_req_ids", ())
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if rid not in self._blocks or new_ids is None:
                continue
            if rid in resumed:
                self._blocks[rid] = [list(ids) for ids in new_ids]
            else:
                for have, more in zip(self._blocks[rid], new_ids):
                    have.extend(more)
        scheduled = [Scheduled(rid, self._blocks[rid], self._requests[rid].num_computed_tokens + n)
                     for rid, n in scheduler_output.num_scheduled_tokens.items()
                     if rid in self._requests and rid in self._blocks]
        sending = tuple(self.scheduler.take_sending())  # their stores are in this step's jobs
        jobs = tuple(self.scheduler.step(scheduled))
        return KvtierMetadata(jobs, tuple(sorted(self.scheduler.take_invalid())), sending,
                              idle=scheduler_output.total_num_scheduled_tokens == 0,
                              async_loads=tuple(self.scheduler.take_async()),
                              received=tuple(self.scheduler.take_received()))

    @timed()
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            for hook, seconds in meta.hook_seconds:
                self._worker_hooks[hook] += seconds
            for rank, results in meta.by_rank:
                combined = self._ranks.add(rank, results)
                if combined:
                    self.scheduler.apply(combined)

    @timed()
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    @timed()
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Full blocks are stored as they fill; a sliding-window group's window before the
        request's final boundary is stored in the next step, and vLLM holds those blocks
        until the worker says the copies are done (`get_finished`). The request's own asks
        in its kv_transfer_params (retention, expect-return: `kv_hints.py`) and the actions
        of its `kv_hints` envelope (`hint_actions.py`) are answered in the params it ends
        with, with or without the residency details."""
        assert self.scheduler is not None
        hold = self.scheduler.finish_windows(request.request_id, block_ids,
                                             request.num_computed_tokens)
        asks = request.kv_transfer_params
        answers = self.scheduler.answer(request.request_id, asks,
                                        getattr(request, "kv_hints", None))
        # a prefill whose decode runs elsewhere: what it hands off (handoff.py)
        answers.update(handed(asks, self.scheduler.handed_tokens(request.request_id),
                              self.scheduler.manager.hands_off))
        bad = invalid(asks)
        if bad:
            answers[INVALID] = bad
        params = self.scheduler.finished(request.request_id)
        self._requests.pop(request.request_id, None)  # live until now: its blocks' origins
        self._blocks.pop(request.request_id, None)
        if not self.settings.enable_residency_details:
            params = {}  # where another tenant's prefix lived is nobody else's business
        return hold, {**params, **answers} or None

    def reset_cache(self) -> bool:
        """vLLM forgot its prefix cache (`reset_prefix_cache(reset_connector=True)`, a pause or
        sleep that clears caches: what a weight update must be followed by). The weights may
        have changed in place, so nothing cached before is served again and nothing computed
        after is stored under the old identity (`epochs.py`)."""
        if self.scheduler is None:
            return True  # vLLM resets the scheduler's connector; a worker keeps no index
        self.identity.reset()
        self.scheduler.reset()
        if self.events is not None:
            self.events.reset()
        return True

    @timed()
    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's host and disk residency since the last step as vLLM's KV events (medium
        CPU, STORAGE) under vLLM's own block hashes, when vLLM publishes KV events."""
        if self.events is None or self.tier is None:
            return ()
        return self.events.take(self.tier.manager.take_residency_changes())

    @timed()
    def has_pending_push_work(self) -> bool:
        """Jobs decided or running (writes on to disk and Redis): keep vLLM stepping."""
        return self.scheduler is not None and self.scheduler.busy

    @timed()
    def get_kv_connector_stats(self) -> KvtierStats | None:
        """Scheduler side: kvtier's counters since the last step (worker side: none), with
        the seconds its hooks took and the steps they ran in (`hook_clock.py`)."""
        if self.scheduler is None:
            return None
        self.clock.end_step()  # vLLM calls this once a step, in its update
        hooks, step = self.clock.take()
        # the worker ranks run side by side: their mean is what a step waits for
        hooks.update({h: s / self.world_size for h, s in self._worker_hooks.items()})
        self._worker_hooks.clear()
        own: dict[Count, float] = {(HOOK_SECONDS, (h,)): s for h, s in hooks.items()}
        own[STEP_SECONDS, ()] = step
        data = merge(self.scheduler.take_stats(), nest(own))
        return KvtierStats(data=data) if data else None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Block, then head, token, channel in each layer (LBHNC): a block of a layer is one
        dense run, as on vLLM CPU; on CUDA FlashAttention's default would be LBNHC."""
        return "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side --------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """This step's metadata, bound before the forward pass: its jobs below host (writes
        on, fetches) start now. vLLM calls `start_load_kv` after the forward pass when no
        load is synchronous, and a write started there waited a whole prefill (a handoff's
        decode waited for it: `benchmarks/vllm_pd.py`)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, KvtierMetadata):
            self.worker_side.start_below(connector_metadata.jobs)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register(kv_caches)

    @timed()
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtierMetadata):
            self.worker_side.load(meta.jobs, meta.invalid, meta.idle, meta.async_loads,
                                  meta.received)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks are copied in wait_for_save, all layers at once

    @timed()
    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvtierMetadata):
                self.worker_side.save(meta.jobs, meta.sending)

    @timed()
    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose held blocks this worker has copied (vLLM may free them),
        and requests whose asynchronous loads landed (vLLM may schedule them)."""
        if self.worker_side is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KvtierMetadata) and meta.idle
        return (self.worker_side.take_sent() or None,
                self.worker_side.take_received(idle) or None)

    @timed()
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors() if self.worker_side is not None else set()

    @timed()
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker_side is None:
            return None
        results = self.worker_side.take_results()
        hooks, _ = self.clock.take()
        return KvtierWorkerMetadata(((self.rank, tuple(results)),) if results else (),
                                    tuple((h, s) for h, s in hooks.items() if s > 0))

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.tier is not None:
            self.tier.close()


def _salt(request: Request, adapters: AdapterMemo) -> str | None:
    """A request's namespace beyond the engine's: its cache_salt and its LoRA adapter's weights
    (their digest, not the adapter's name); None when the adapter cannot be identified."""
    adapter: str | None = ""
    if request.lora_request is not None:
        adapter = adapter_identity(request.lora_request, adapters)
        if adapter is None:
            return None
    return f"{request.cache_salt or ''}\x00lora={adapter}"
