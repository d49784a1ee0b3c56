"""Put this machine at a GPU's restore/recompute ratio, honestly labelled.

On 2 CPU cores a SmolLM2 prefix restores ~100x faster than it recomputes; on a GPU the
ratio is 2-20x (`kvtier plan`), and that is where restore-or-recompute is a real choice. A
benchmark given `--regime MODEL@HARDWARE[:TOKENS]` takes the ratio `kvtier plan` computes
for that model and GPU at TOKENS, measures this machine's prefill of TOKENS (cold prompts,
one output token, on a plain `vllm serve`), and caps kvtier's restores (`max_load_gbps`) so
that restoring TOKENS here takes recompute / ratio, as there. Every input is kept, to be
printed beside every result that uses the cap:

    cap_gbps = kv_bytes_per_token * TOKENS * ratio / recompute_here_s / 1e9
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.plan.analysis import analyze
from kvtier.plan.hardware import resolve_hardware
from kvtier.plan.models import resolve_model


@dataclass(frozen=True)
class Regime:
    """A GPU's ratio at `tokens`, and the cap that gives it to this machine."""

    model: str
    hardware: str
    tokens: int
    gpu_restore_s: float  # `kvtier plan`: transfer + overhead + one-token forward
    gpu_recompute_s: float
    ratio: float  # gpu_recompute_s / gpu_restore_s
    here_recompute_s: float  # median prefill of `tokens` cold tokens here
    here_kv_bytes_per_token: int
    cap_gbps: float  # max_load_gbps

    def line(self) -> str:
        """One line that says what every capped result stands for."""
        return (f"regime: {self.model} on {self.hardware} at {self.tokens} tokens restores "
                f"{self.ratio:.1f}x faster than it recomputes ({self.gpu_restore_s * 1e3:.1f} "
                f"vs {self.gpu_recompute_s * 1e3:.1f} ms, kvtier plan); here "
                f"{self.tokens} tokens recompute in {self.here_recompute_s * 1e3:.0f} ms, so "
                f"max_load_gbps={self.cap_gbps:.4g} (restore ~"
                f"{self.here_recompute_s / self.ratio * 1e3:.0f} ms)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse(spec: str, default_tokens: int) -> tuple[str, str, int]:
    """'llama-3.1-8b@h100-pcie-gen5[:768]' -> (model, hardware, tokens)."""
    model, at, rest = spec.partition("@")
    hardware, colon, tokens = rest.partition(":")
    if not at or not model or not hardware:
        raise ConfigError(f"--regime {spec!r}: write MODEL@HARDWARE[:TOKENS], e.g. "
                          "llama-3.1-8b@h100-pcie-gen5:768")
    if not colon:
        return model, hardware, default_tokens
    if not tokens.isdigit() or int(tokens) < 16:
        raise ConfigError(f"--regime {spec!r}: TOKENS must be a whole number >= 16")
    return model, hardware, int(tokens)


def gpu_costs(model: str, hardware: str, tokens: int) -> tuple[float, float]:
    """(restore_s, recompute_s) that `kvtier plan` gives `tokens` of `model` on `hardware`."""
    [plan] = analyze(resolve_model(model), resolve_hardware(hardware), "fp16",
                     [tokens]).contexts
    return plan.restore_s, plan.recompute_s


def recompute_here(url: str, tokens: int, tries: int = 3, seed: int = 99) -> float:
    """Median seconds this server takes for a cold prompt of `tokens` tokens (one output
    token): each prompt is new, so nothing is cached."""
    import httpx

    rng = random.Random(seed)
    took = []
    for _ in range(tries):
        ids = [rng.randrange(100, 49000) for _ in range(tokens)]
        began = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        took.append(time.perf_counter() - began)
    return statistics.median(took)


def regime(spec: str, default_tokens: int, url: str, kv_bytes_per_token: int) -> Regime:
    """The regime `spec` names, its cap computed against the server at `url`."""
    model, hardware, tokens = parse(spec, default_tokens)
    restore_s, recompute_s = gpu_costs(model, hardware, tokens)
    ratio = recompute_s / restore_s
    here = recompute_here(url, tokens)
    cap = kv_bytes_per_token * tokens * ratio / here / 1e9
    return Regime(model, hardware, tokens, restore_s, recompute_s, ratio, here,
                  kv_bytes_per_token, cap)


def on_plain_vllm(spec: str, default_tokens: int, model: Path, kv_bytes_per_token: int,
                  log: Path, **server: Any) -> Regime:
    """The regime `spec` names, measured on a plain `vllm serve` of `model` started for it
    (`server`: VllmServer's pool and limits, those the benchmark's own servers get), and
    printed."""
    from vllm_run import VllmServer  # tests/integrations, on the benchmarks' path

    plain = VllmServer(model, None, log_path=log, **server).start()
    try:
        found = regime(spec, default_tokens, plain.url, kv_bytes_per_token)
    finally:
        plain.close()
    print(found.line(), flush=True)
    return found
