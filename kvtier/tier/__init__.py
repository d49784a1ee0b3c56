"""kvtier's KV tier as a library: host memory, then disk and a shared store below it.

The face, for any engine (kvtier's own, vLLM's through a KV connector):
  build(config, layout, namespace, block_size, prefill_tokens_per_s, faults) -> Tier
  Tier           the in-process driver: submit / reap / wait_any / wait / drain /
                 write_down_host / close, over
  Tier.manager   TierManager, scheduler side, no tensors: match (which starts a fetch below
                 host itself: FETCHING until it lands) / allocated / outcome / store /
                 finished / take_jobs / apply
  Tier.worker    TierWorker, bytes side: submit / poll / wait / wait_any / wait_layer / close
  TierStats      TierManager.report(): the scheduler side's counters, one frozen snapshot
  CATALOG        every counter family kvtier exports (Family: doc, typed labels, its vLLM
                 and kvtier serve names); counter_rows(TierStats) -> the report as Rows
  WorkerReport   TierWorker.report(): the link's traffic, host memory, the stores' state
  PageStore      the stores below host for an engine that owns its host memory (SGLang):
                 pages put from, and got into, rows the engine gives; verified
  KVLayout       the engine's KV memory: from_contiguous(kv) or from_layers({name: tensor})
  Fingerprint    the namespace every block key is chained from (change a field: no old hit)
  Faults         the one fault seam, given to build() (tests)
  Decline        why tokens found in the tier were recomputed (Match.declined_by)
  LoadPolicy     load_policy parsed: the planner (auto) or a fixed rule, deciding a prefix
                 found with what is queued `Ahead` of it (also run by `kvtier plan`)
  Residency      where a request's state lived, one enum from here to the HTTP header
  Grant, Refusal TierManager.retain(): a retention granted, or refused with the reason
  ResidencyChange, ChangeKind   TierManager.take_residency_changes(): a block became
                 resident on host or disk, or stopped being (a manager built to keep them)
  Job, Result, LoadDone, FetchDone, StoreDone   what crosses between the two sides
Inside: `books/` the scheduler side, `link/` device <-> host, `io/` host <-> the stores below,
`stores/<name>/` one folder per store (registered in `registry.py`), `builder.py` the one place
that wires them. Nothing here imports an engine; the books and the vocabulary are pure Python
(no torch), and the bytes side is imported only when first named, so bookkeeping alone never
loads torch.
"""

from typing import TYPE_CHECKING, Any

from kvtier.tier.books.manager import TierManager
from kvtier.tier.books.residency_log import ChangeKind, ResidencyChange
from kvtier.tier.books.returns import MAX_EXPECT_RETURN_S
from kvtier.tier.books.tenancy import Grant, Refusal
from kvtier.tier.catalog import (
    ALWAYS_LABELLED,
    BY_VLLM_KEY,
    CACHE_RESETS,
    CATALOG,
    DECLINED_TOKENS,
    HOOK_SECONDS,
    LOOKUP_TOKENS,
    LOSSY_RESTORED_TOKENS,
    RESET_DROPPED_HOST_BLOCKS,
    RESTORE_SECONDS,
    RESTORED_BLOCKS,
    RESTORED_TOKENS,
    STEP_SECONDS,
    Family,
    Kind,
    Label,
    Row,
    label_text,
)
from kvtier.tier.catalog import rows as counter_rows
from kvtier.tier.config import (
    GIB,
    MAX_TENANT_CHARS,
    SAFE_RAM_SHARE,
    TierConfig,
    check_fits,
    host_slot_count,
    knob_names,
)
from kvtier.tier.faults import NO_FAULTS, Faults
from kvtier.tier.fingerprint import Fingerprint
from kvtier.tier.handoff import Handoff, Wait
from kvtier.tier.hints import (
    MAX_PREFIXES,
    Hint,
    HintReply,
    KvHints,
    PrefixRetention,
    Purged,
    seconds,
)
from kvtier.tier.jobs import Event, FetchDone, Job, LoadDone, Reason, Result, StoreDone
from kvtier.tier.keys import (
    BlockKey,
    Medium,
    chain_parents,
    hash_block,
    hash_blocks,
    is_swap_key,
    partial_keys,
    swap_key,
)
from kvtier.tier.knobs import check_bounds, check_types
from kvtier.tier.layout import KVLayout, heads_first_coded_shape
from kvtier.tier.load_policy import Ahead, Decline, LoadPolicy, LoadRule
from kvtier.tier.match import FETCHING, NO_MATCH, Match, Prefetch, declines
from kvtier.tier.outcome import RequestOutcome
from kvtier.tier.planner import Calibration, Choice, Decision, Planner
from kvtier.tier.registry import ConfiguredStore
from kvtier.tier.registry import aliases as store_aliases
from kvtier.tier.registry import configured as configured_stores
from kvtier.tier.report import BelowReport, TenantCounts, TierStats, TransferCounts
from kvtier.tier.residency import Residency
from kvtier.tier.tenant_source import TenantSource, request_tenant, tenant_rule

if TYPE_CHECKING:
    from kvtier.tier.builder import (
        SchedulerTier,
        build,
        build_scheduler_side,
        build_worker_side,
        host_slot_nbytes,
    )
    from kvtier.tier.driver import Tier
    from kvtier.tier.pages import PageStore
    from kvtier.tier.worker import TierWorker, WorkerReport

__all__ = [
    "ALWAYS_LABELLED",
    "BY_VLLM_KEY",
    "CACHE_RESETS",
    "CATALOG",
    "DECLINED_TOKENS",
    "FETCHING",
    "GIB",
    "HOOK_SECONDS",
    "LOOKUP_TOKENS",
    "LOSSY_RESTORED_TOKENS",
    "MAX_EXPECT_RETURN_S",
    "MAX_PREFIXES",
    "MAX_TENANT_CHARS",
    "NO_FAULTS",
    "NO_MATCH",
    "RESET_DROPPED_HOST_BLOCKS",
    "RESTORED_BLOCKS",
    "RESTORED_TOKENS",
    "RESTORE_SECONDS",
    "SAFE_RAM_SHARE",
    "STEP_SECONDS",
    "Ahead",
    "BelowReport",
    "BlockKey",
    "Calibration",
    "ChangeKind",
    "Choice",
    "ConfiguredStore",
    "Decision",
    "Decline",
    "Event",
    "Family",
    "Faults",
    "FetchDone",
    "Fingerprint",
    "Grant",
    "Handoff",
    "Hint",
    "HintReply",
    "Job",
    "KVLayout",
    "Kind",
    "KvHints",
    "Label",
    "LoadDone",
    "LoadPolicy",
    "LoadRule",
    "Match",
    "Medium",
    "PageStore",
    "Planner",
    "Prefetch",
    "PrefixRetention",
    "Purged",
    "Reason",
    "Refusal",
    "RequestOutcome",
    "Residency",
    "ResidencyChange",
    "Result",
    "Row",
    "SchedulerTier",
    "StoreDone",
    "TenantCounts",
    "TenantSource",
    "Tier",
    "TierConfig",
    "TierManager",
    "TierStats",
    "TierWorker",
    "TransferCounts",
    "Wait",
    "WorkerReport",
    "build",
    "build_scheduler_side",
    "build_worker_side",
    "chain_parents",
    "check_bounds",
    "check_fits",
    "check_types",
    "configured_stores",
    "counter_rows",
    "declines",
    "hash_block",
    "hash_blocks",
    "heads_first_coded_shape",
    "host_slot_count",
    "host_slot_nbytes",
    "is_swap_key",
    "knob_names",
    "label_text",
    "partial_keys",
    "request_tenant",
    "seconds",
    "store_aliases",
    "swap_key",
    "tenant_rule",
]


def __getattr__(name: str) -> Any:
    """The bytes side (torch) on first use: `build*`, `Tier`, `TierWorker`."""
    if name in ("SchedulerTier", "Tier", "build", "build_scheduler_side", "build_worker_side",
                "host_slot_nbytes"):
        from kvtier.tier import builder

        return getattr(builder, name)
    if name == "PageStore":
        from kvtier.tier import pages

        return pages.PageStore
    if name in ("TierWorker", "WorkerReport"):
        from kvtier.tier import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'kvtier.tier' has no attribute {name!r}")
