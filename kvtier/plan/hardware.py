"""The machines `kvtier plan` reasons about: GPU memory, host RAM, the link between, FLOPs.

Primitives: `HARDWARE` (name -> Hardware, read-only presets), `resolve_hardware(name,
**overrides)` (a preset or `this-machine`, explicit numbers winning), `measure_this_machine()`.
Every preset figure is per GPU except `host_gib` and `gpus`, which are per node.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tier import GIB

THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class Hardware:
    """One serving node as the planner sees it (per-GPU figures, node-wide RAM)."""

    name: str
    hbm_gib: float  # GPU memory per GPU
    host_gib: float  # host RAM of the whole node
    link_gbps: float  # effective host -> device GB/s per GPU (pinned copies, not the spec sheet)
    flops: float  # dense bf16/fp16 tensor FLOP/s per GPU (no sparsity)
    mfu: float  # model-FLOPs utilisation a prefill reaches
    transfer_overhead_s: float  # fixed cost of a wake: job submit, sync, the step that notices it
    hbm_gbps: float  # GPU memory bandwidth, for the memory-bound decode and one-token forward
    description: str = ""
    prefill_tps: float | None = None  # measured prefill tokens/s of the planned model, if known
    gpus: int = 1  # GPUs per node
    # Prefill and decode share one compute resource step by step, as on a CPU: a prefill
    # waits for the running step and its rows share steps with the other sessions' decodes.
    shared_compute: bool = False
    # Fixed cost of one engine step, weight stream included (plus interpreter and kernel
    # launches): measured for this-machine, where it is most of a short prefill.
    step_fixed_s: float = 0.0
    # Extra cost of one more decoding sequence in a step (its matmul row, attention over its
    # context, sampling); 0 means one prefill token's worth. Measured for this-machine.
    decode_row_s: float = 0.0
    # Extra step cost per token of cached context a prefill attends to (gathering it and
    # attending over it); 0 means the FLOP-based attention term only. Measured for this-machine.
    context_token_s: float = 0.0

    def __post_init__(self) -> None:
        positive = ("hbm_gib", "host_gib", "link_gbps", "flops", "mfu", "hbm_gbps", "gpus")
        for key in positive:
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"hardware {self.name!r}: {key}={value!r} must be > 0")
        if self.mfu > 1:
            raise ConfigError(f"hardware {self.name!r}: mfu={self.mfu} is a fraction in (0, 1]")
        if self.transfer_overhead_s < 0:
            raise ConfigError(
                f"hardware {self.name!r}: transfer_overhead_s={self.transfer_overhead_s} < 0"
            )
        if self.prefill_tps is not None and not self.prefill_tps > 0:
            raise ConfigError(f"--prefill-tps {self.prefill_tps} must be > 0")

    @property
    def effective_flops(self) -> float:
        return self.flops * self.mfu

    def with_overrides(self, **fields: Any) -> Hardware:
        """The same machine with every field given a non-None value replaced."""
        given = {k: v for k, v in fields.items() if v is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown hardware fields {sorted(unknown)}")
        return dataclasses.replace(self, **given) if given else self


# Links: PCIe moves 128b/130b-encoded lanes, and pinned cudaMemcpy host->device typically
# realises ~80% of the raw per-direction rate: Gen4 x16 32 GB/s raw -> ~25 GB/s (the seed's
# figure), Gen5 x16 64 GB/s raw -> ~50 GB/s. NVLink-C2C on GH200 is 900 GB/s total, 450 GB/s
# per direction; that peak is used as is, measured copies come in somewhat under it.
# FLOPs: vendor datasheets, dense bf16 tensor cores (half the "with sparsity" number).
# mfu 0.5: what a large prefill (flash attention, big GEMMs) reaches on these parts; the
# attention share at 100k+ tokens runs about there too (FlashAttention-2/3 causal forward).
# transfer_overhead_s 5 ms: submit and sync of the load jobs plus about one engine step before
# the finished load is noticed; an estimate, not a measurement (override it with a flag).
# With these, Llama-3.1-8B on h100-sxm predicts restore beating recompute ~2.7x at 1k tokens,
# ~10x at 8k and ~24x at 64k (~38x at 128k): the span of vLLM's published "2x-22x lower TTFT
# from the CPU tier, Llama-3.1-8B on H100, depending on prompt size".
# host_gib: common configurations (DGX A100 1 TB, DGX H100/H200 2 TB, GH200 480 GB LPDDR5X).
_PRESETS = (
    Hardware("a100-80g-pcie-gen4", hbm_gib=80, host_gib=1024, link_gbps=25.0, flops=312e12,
             mfu=0.5, transfer_overhead_s=0.005, hbm_gbps=1935.0, gpus=8,
             description="8x A100 80GB, PCIe Gen4 x16 per GPU (~25 GB/s pinned H2D), 1 TiB RAM"),
    Hardware("h100-sxm", hbm_gib=80, host_gib=2048, link_gbps=50.0, flops=989e12, mfu=0.5,
             transfer_overhead_s=0.005, hbm_gbps=3350.0, gpus=8,
             description="8x H100 SXM5 (HGX), PCIe Gen5 x16 host link per GPU (~50 GB/s pinned "
                         "H2D of 64 raw), 2 TiB RAM"),
    Hardware("h100-pcie-gen5", hbm_gib=80, host_gib=1024, link_gbps=50.0, flops=756e12,
             mfu=0.5, transfer_overhead_s=0.005, hbm_gbps=2000.0, gpus=8,
             description="8x H100 PCIe (HBM2e 2.0 TB/s), PCIe Gen5 x16 (~50 GB/s), 1 TiB RAM"),
    Hardware("h200", hbm_gib=141, host_gib=2048, link_gbps=50.0, flops=989e12, mfu=0.5,
             transfer_overhead_s=0.005, hbm_gbps=4800.0, gpus=8,
             description="8x H200 SXM (141 GB HBM3e), PCIe Gen5 x16 (~50 GB/s), 2 TiB RAM"),
    Hardware("gh200-nvlink-c2c", hbm_gib=96, host_gib=480, link_gbps=450.0, flops=989e12,
             mfu=0.5, transfer_overhead_s=0.005, hbm_gbps=4000.0, gpus=1,
             description="1x GH200 (96 GB HBM3), NVLink-C2C to 480 GB LPDDR5X at 450 GB/s per "
                         "direction (peak; measured copies run somewhat lower)"),
    Hardware("l40s", hbm_gib=48, host_gib=768, link_gbps=25.0, flops=362e12, mfu=0.5,
             transfer_overhead_s=0.005, hbm_gbps=864.0, gpus=8,
             description="8x L40S (48 GB GDDR6, 362 TFLOPS bf16 dense with fp32 accumulate), "
                         "PCIe Gen4 x16 (~25 GB/s)"),
)
HARDWARE: Mapping[str, Hardware] = MappingProxyType({h.name: h for h in _PRESETS})


def hardware_names() -> tuple[str, ...]:
    return (*HARDWARE, THIS_MACHINE)


def resolve_hardware(name: str, **overrides: Any) -> Hardware:
    """A preset (or `this-machine`, measured now) with explicit numbers overriding its fields."""
    if name == THIS_MACHINE:
        base = measure_this_machine()
    elif name in HARDWARE:
        base = HARDWARE[name]
    else:
        raise ConfigError(
            f"--hardware {name!r} is not a preset; choose one of {', '.join(hardware_names())} "
            "(or pass --hbm-gib, --host-gib, --link-gbps, --flops to describe your own)"
        )
    return base.with_overrides(**overrides)


def meminfo_gib(field: str = "MemTotal", text: str | None = None) -> float:
    """A /proc/meminfo field in GiB (0.0 where there is no /proc)."""
    try:
        lines = (text if text is not None else Path("/proc/meminfo").read_text()).splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GIB  # the field is in kB
    return 0.0


def _best_seconds(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_copies(cuda: bool) -> tuple[float, float]:
    """(link GB/s, memory GB/s): pinned host -> device and device -> device on CUDA; on the
    CPU a DRAM -> DRAM copy is both the "link" and (read + write) the memory bandwidth."""
    import torch

    nbytes = 256 << 20 if cuda else 64 << 20
    if cuda:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev2 = torch.empty_like(dev)

        def h2d() -> None:
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        def d2d() -> None:
            dev2.copy_(dev)
            torch.cuda.synchronize()

        h2d()
        return nbytes / _best_seconds(h2d) / 1e9, 2 * nbytes / _best_seconds(d2d) / 1e9
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    seconds = _best_seconds(lambda: b.copy_(a))
    return nbytes / seconds / 1e9, 2 * nbytes / seconds / 1e9


@dataclass(frozen=True)
class _StepCosts:
    flops: float  # marginal prefill FLOP/s
    fixed_s: float  # what a step costs before its tokens
    decode_row_s: float  # what one more decoding sequence adds to a step
    context_token_s: float  # what a token of cached context adds to a prefill's step
    note: str


def _measure_steps(short: int = 32, long: int = 256, rows: int = 4) -> _StepCosts:
    """kvtier's default model here: prefill at two lengths (what a step costs apart from
    what a token costs), `short` tokens after a cached `long`-token prefix (what context
    adds), then decode of 1 and `rows` sequences (what a decode row adds)."""
    from kvtier.llm import LLM
    from kvtier.plan.models import shape_from_spec
    from kvtier.sequence import SamplingParams

    llm = LLM(None)  # prefix caching on: the context measurement reuses a cached prefix
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)

        def prompt(n: int, salt: int) -> list[int]:
            return [100 + (i * 37 + salt) % 5000 for i in range(n)]

        def ttft(n: int, salt: int) -> float:
            return llm.generate([prompt(n, salt)], params)[0].metrics.ttft_s or 0.0

        def itl(batch: int, salt: int) -> float:
            decode = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
            outs = llm.generate([prompt(64, salt + k) for k in range(batch)], decode)
            return statistics.median((o.metrics.decode_s or 0.0) / 8 for o in outs)

        # Medians, not minimums: the prediction is of a p50, on a machine whose speed drifts.
        # Salts keep every prompt's first block distinct, so nothing hits the prefix cache
        # except where the context measurement means it to.
        ttft(short, 0)  # warm-up
        t_short = statistics.median(ttft(short, k) for k in range(1, 4))
        t_long = statistics.median(ttft(long, k) for k in range(11, 14))
        t_ctx = statistics.median(  # `short` new tokens after a cached prefix of `long`
            llm.generate([prompt(long, k) + prompt(short, 900 + k)], params)[0].metrics.ttft_s
            or 0.0 for k in range(11, 14))
        one = statistics.median(itl(1, 50 + k) for k in range(3))
        many = statistics.median(itl(rows, 60 + rows * k) for k in range(3))
        shape = shape_from_spec(llm.engine.spec)
    finally:
        llm.shutdown()
    per_token = max((t_long - t_short) / (long - short), 1e-9)
    fixed = max(t_short - short * per_token, 0.0)
    row = max((many - one) / (rows - 1), 0.0)
    context = max((t_ctx - t_short) / long, 0.0)
    note = (f"{shape.name} prefill: {fixed * 1e3:.0f} ms per step + "
            f"{per_token * 1e3:.2f} ms per token ({long / t_long:,.0f} tokens/s at {long}) + "
            f"{context * 1e6:.0f} us per cached token; "
            f"decode: {one * 1e3:.0f} ms per step + {row * 1e3:.1f} ms per extra sequence")
    return _StepCosts(2.0 * shape.num_params / per_token, fixed, row, context, note)


def measure_this_machine() -> Hardware:
    """Measure now: the copy rate, RAM, and kvtier's own prefill (as achieved FLOP/s, mfu 1)."""
    import torch

    cuda = torch.cuda.is_available()
    link, memory = _measure_copies(cuda)
    steps = _measure_steps()
    ram = meminfo_gib("MemTotal") or 1.0
    if cuda:
        hbm = torch.cuda.get_device_properties(0).total_memory / GIB
        where = f"{torch.cuda.get_device_name(0)}, pinned host->device {link:.1f} GB/s"
        host = ram
    else:  # the device pool and the host tier share one DRAM: split it between them
        hbm, host = ram / 2, ram / 2
        where = f"CPU only (device pool and host tier share DRAM), DRAM copy {link:.1f} GB/s"
    return Hardware(
        THIS_MACHINE, hbm_gib=hbm, host_gib=host, link_gbps=link, flops=steps.flops, mfu=1.0,
        transfer_overhead_s=0.0005, hbm_gbps=memory, gpus=1, shared_compute=not cuda,
        step_fixed_s=steps.fixed_s, decode_row_s=steps.decode_row_s,
        context_token_s=steps.context_token_s,
        description=f"measured: {where}, {steps.note}, {ram:.1f} GiB RAM",
    )
