"""Restore or recompute on a given model and machine, per context length, and what it buys.

Primitives: `analyze(model, hardware, kv_dtype, contexts) -> PlanResult`; underneath,
`pick_tensor_parallel`, `calibration_for` and `planner_for` turn a model and a machine into
the `kvtier.tier.planner.Planner` the scheduler uses online, so plan and engine cannot disagree.

    restore_s   = session_bytes / (tp * link) + overhead + one-token forward (weights / HBM BW)
    recompute_s = (2 * params * T + 2 * layers * hidden * T**2) / (tp * flops * mfu)
    sessions    = replicas * floor((tp * HBM * (1 - ACTIVATION_FRACTION) - weights) / session)
    + tier      = replicas * floor(host pool per replica / session)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.plan.hardware import GIB, Hardware
from kvtier.plan.models import ModelShape
from kvtier.tier import SAFE_RAM_SHARE, Calibration, Choice, Planner

# HBM kept out of the KV budget for activations, CUDA context, graphs and workspace: the 10%
# vLLM's default gpu_memory_utilization=0.9 leaves, which is also what large prefills need.
ACTIVATION_FRACTION = 0.10
# Share of host RAM the tier takes by default; the rest stays for the OS, page cache, the
# server process and staging the weights at load time.
HOST_USABLE_FRACTION = 0.5
# Automatic tensor parallelism: the smallest power of two whose GPUs hold the weights in at
# most this share of their usable HBM (the rest is the KV pool), as people deploy 70B on 4.
WEIGHTS_MAX_SHARE = 0.5


@dataclass(frozen=True)
class ContextPlan:
    """One context length: bytes, both costs, the decision and the sessions a node holds."""

    context: int
    kv_bytes_per_token: int
    session_bytes: int
    transfer_s: float  # bytes over the link only
    restore_s: float  # transfer + fixed overhead + the one-token forward a restore still needs
    recompute_s: float
    decision: Choice
    speedup: float  # recompute_s / restore_s
    sessions_device: int  # per node, HBM only
    sessions_with_tier: int  # per node, HBM plus the host pool


@dataclass(frozen=True)
class PlanResult:
    model: ModelShape
    hardware: Hardware
    kv_dtype: str
    tensor_parallel: int
    replicas: int  # model copies per node (gpus // tensor_parallel)
    calibration: Calibration  # what the scheduler's planner would start from
    kv_bytes_per_token: int
    crossover_tokens: float | None  # restore wins above this context
    kv_room_bytes: int  # per replica: HBM left for KV after weights and activations
    host_pool_bytes: int  # per replica (kv_offloading_size)
    pinned_bytes: int  # node-wide page-locked RAM the tier reserves
    contexts: tuple[ContextPlan, ...]
    warnings: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": asdict(self.model),
            "hardware": asdict(self.hardware),
            "kv_dtype": self.kv_dtype,
            "tensor_parallel": self.tensor_parallel,
            "replicas": self.replicas,
            "calibration": asdict(self.calibration),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "crossover_tokens": self.crossover_tokens,
            "weights_bytes": self.model.weights_bytes,
            "kv_room_bytes": self.kv_room_bytes,
            "host_pool_bytes": self.host_pool_bytes,
            "pinned_bytes": self.pinned_bytes,
            "contexts": [asdict(c) for c in self.contexts],
            "warnings": list(self.warnings),
        }


def usable_hbm_bytes(hardware: Hardware, tp: int) -> float:
    return tp * hardware.hbm_gib * GIB * (1 - ACTIVATION_FRACTION)


def pick_tensor_parallel(model: ModelShape, hardware: Hardware) -> int:
    """Smallest power of two (up to the node's GPUs) holding the weights in WEIGHTS_MAX_SHARE
    of usable HBM; failing that, the one that merely fits them; failing that, all GPUs."""
    sizes = [1 << i for i in range(hardware.gpus.bit_length()) if 1 << i <= hardware.gpus]
    for share in (WEIGHTS_MAX_SHARE, 1.0):
        for tp in sizes:
            if model.weights_bytes <= share * usable_hbm_bytes(hardware, tp):
                return tp
    return sizes[-1]


def calibration_for(model: ModelShape, hardware: Hardware, tp: int = 1) -> Calibration:
    """The planner's numbers for this model on `tp` GPUs of this machine.

    Each GPU restores its shard of the KV over its own link (tp links in parallel; on boards
    where two GPUs share a switch uplink, pass half the link speed). A `prefill_tps` given by
    the user replaces the FLOP-based linear term; the attention term always comes from FLOPs.
    """
    compute = tp * hardware.effective_flops
    one_token_forward_s = model.weights_bytes / (tp * hardware.hbm_gbps * 1e9)
    linear_tps = hardware.prefill_tps or compute / (2.0 * model.num_params)
    return Calibration(
        link_gbps=tp * hardware.link_gbps,
        transfer_overhead_s=hardware.transfer_overhead_s + one_token_forward_s,
        prefill_tokens_per_s=linear_tps,
        attention_s_per_token2=4.0 * model.num_layers * model.hidden_size / compute,
    )


def planner_for(model: ModelShape, hardware: Hardware, tp: int = 1) -> Planner:
    return Planner(calibration_for(model, hardware, tp))


def check_contexts(contexts: Sequence[int]) -> list[int]:
    if not contexts:
        raise ConfigError("--context needs at least one token count, e.g. --context 1024,8192")
    bad = [c for c in contexts if not isinstance(c, int) or c < 1]
    if bad:
        raise ConfigError(f"--context values {bad} must be positive whole token counts")
    return list(contexts)


def analyze(model: ModelShape, hardware: Hardware, kv_dtype: str, contexts: Sequence[int],
            tensor_parallel: int | None = None, host_pool_gib: float | None = None
            ) -> PlanResult:
    """Per context: bytes, restore vs recompute through `Planner`, and sessions per node.

    `host_pool_gib` is the pool each replica pins (vLLM's kv_offloading_size); by default the
    node's HOST_USABLE_FRACTION of RAM split across its replicas.
    """
    contexts = check_contexts(contexts)
    tp = tensor_parallel or pick_tensor_parallel(model, hardware)
    if tp < 1 or tp > hardware.gpus:
        raise ConfigError(f"--tp {tp} must be between 1 and the node's {hardware.gpus} GPUs "
                          "(raise --gpus for a bigger node)")
    replicas = hardware.gpus // tp
    planner = planner_for(model, hardware, tp)
    per_token = model.kv_bytes_per_token(kv_dtype)
    kv_room = int(usable_hbm_bytes(hardware, tp) - model.weights_bytes)
    if host_pool_gib is None:
        pool = int(hardware.host_gib * GIB * HOST_USABLE_FRACTION / replicas)
    elif host_pool_gib < 0:
        raise ConfigError(f"--kv-offloading-size {host_pool_gib} GiB must be >= 0")
    else:
        pool = int(host_pool_gib * GIB)
    plans = []
    for context in contexts:
        session = context * per_token
        decision = planner.decide(context, session)
        device = replicas * (kv_room // session) if kv_room > 0 else 0
        host = replicas * (pool // session) if kv_room > 0 else 0
        plans.append(ContextPlan(
            context=context, kv_bytes_per_token=per_token, session_bytes=session,
            transfer_s=session / (planner.calibration.link_gbps * 1e9),
            restore_s=decision.restore_s, recompute_s=decision.recompute_s,
            decision=decision.choice, speedup=decision.recompute_s / decision.restore_s,
            sessions_device=device, sessions_with_tier=device + host,
        ))
    crossover = planner.crossover_tokens(per_token)
    return PlanResult(
        model=model, hardware=hardware, kv_dtype=kv_dtype, tensor_parallel=tp,
        replicas=replicas, calibration=planner.calibration, kv_bytes_per_token=per_token,
        crossover_tokens=None if crossover is None or math.isinf(crossover) else crossover,
        kv_room_bytes=kv_room, host_pool_bytes=pool, pinned_bytes=pool * replicas,
        contexts=tuple(plans),
        warnings=tuple(_warnings(model, hardware, tp, kv_room, pool * replicas)),
    )


def _warnings(model: ModelShape, hardware: Hardware, tp: int, kv_room: int, pinned: int
              ) -> list[str]:
    out = []
    if kv_room <= 0:
        out.append(
            f"{model.name} weights ({model.weights_bytes / GIB:.1f} GiB) leave no KV room in "
            f"{1 - ACTIVATION_FRACTION:.0%} of {tp} x {hardware.hbm_gib:.1f} GiB; spread it over "
            "more GPUs (--tp, --gpus) or pick bigger ones (--hbm-gib)"
        )
    ram = hardware.host_gib * GIB
    if pinned > SAFE_RAM_SHARE * ram:
        out.append(
            f"pinned host pool {pinned / GIB:.1f} GiB exceeds {SAFE_RAM_SHARE:.0%} of the "
            f"node's {hardware.host_gib:.1f} GiB RAM (page-locked memory cannot be swapped out; "
            "the engine refuses such a pool); lower --kv-offloading-size"
        )
    return out
