"""`kvtier selftest`: cold versus warm, checked. Conversations run twice on the same model:
once never offloaded, once with every turn's KV forced down to host memory and woken back.
With a store below host configured, the warm engine is also shut down and started again
before every round of turns, so the state comes back from that store across a restart.
Outputs must agree token by token and every restored block byte for byte."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.config import EngineConfig
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel
from kvtier.model.runner import resolve_device
from kvtier.sequence import SamplingParams
from kvtier.tier import BlockKey, Residency, TierConfig, configured_stores, knob_names


@dataclass
class SelftestReport:
    conversations: int = 0
    turns: int = 0
    restored_tokens: int = 0
    demoted_blocks: int = 0
    blocks_compared: int = 0
    restarts: int = 0  # warm engine shut down and started again (a store below host)
    residency: dict[Residency, int] = field(default_factory=dict)  # warm turns by residency
    token_mismatches: list[str] = field(default_factory=list)
    byte_mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.token_mismatches and not self.byte_mismatches and self.restored_tokens > 0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "residency": self.residency_counts(), "ok": self.ok}

    def residency_counts(self) -> dict[str, int]:
        """Warm turns by residency, keyed by the label ("disk"), as reports print them."""
        return {cls.value: n for cls, n in self.residency.items()}


def run_selftest(loaded: LoadedModel, conversations: int = 4, turns: int = 3,
                 max_tokens: int = 16, seed: int = 0, **knobs: Any) -> SelftestReport:
    """Never-offloaded reference vs. a tiered engine whose KV is demoted before every turn."""
    # Logits are comparable bit for bit only where the kernels are batch-invariant (CPU);
    # elsewhere tokens and KV bytes are still compared.
    invariant = resolve_device(knobs.get("device", "auto")).type == "cpu"
    common = {"batch_invariant": invariant, "num_device_blocks": 256, **knobs}
    # the reference has no tier: every tier knob (the stores' flat names too) is the warm's
    tier = {"kv_offloading_size": 0.25,
            **{k: common.pop(k) for k in knob_names() if k in common}}
    if tier.get("kv_offload_dtype"):
        raise ConfigError("kvtier selftest checks exactness; kv_offload_dtype is lossy by "
                          "design (benchmarks/lossy.py measures how close it is)")
    restart = bool(configured_stores(TierConfig.of(**tier)))
    ref = LLMEngine(EngineConfig.from_knobs(model=loaded.source, **common), loaded=loaded)

    def warm_engine() -> LLMEngine:
        return LLMEngine(EngineConfig.from_knobs(model=loaded.source, **common, **tier),
                         loaded=loaded)

    tiered = warm_engine()
    rng = random.Random(seed)
    vocab = loaded.spec.vocab_size
    report = SelftestReport(conversations=conversations)
    histories = [[rng.randrange(3, vocab) for _ in range(rng.randrange(40, 120))]
                 for _ in range(conversations)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=5 if invariant else None)
    try:
        for turn in range(turns):
            if restart and turn > 0:  # a clean shutdown writes every block down
                tiered.close()
                tiered = warm_engine()
                report.restarts += 1
            for i, history in enumerate(histories):
                report.demoted_blocks += tiered.demote_cached()
                want = _one(ref, history, params)
                got = _one(tiered, history, params)
                report.turns += 1
                report.restored_tokens += got.num_restored_tokens
                report.residency[got.residency] = report.residency.get(got.residency, 0) + 1
                if got.token_ids != want.token_ids or got.logprobs != want.logprobs:
                    first = next((j for j, (a, b) in enumerate(zip(got.token_ids,
                                  want.token_ids)) if a != b), min(len(got.token_ids),
                                                                   len(want.token_ids)))
                    report.token_mismatches.append(
                        f"conversation {i} turn {turn}: first difference at output token "
                        f"{first}: warm {got.token_ids[first:first + 5]} vs cold "
                        f"{want.token_ids[first:first + 5]} (residency {got.residency})")
                _compare_blocks(ref, tiered, report, f"conversation {i} turn {turn}")
                histories[i] = history + got.token_ids + [rng.randrange(3, vocab)
                                                          for _ in range(12)]
    finally:
        tiered.close()
    return report


def _one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Any:
    rid = engine.add_request(prompt, params)
    return engine.run_to_completion([rid])[rid]


def _compare_blocks(ref: LLMEngine, tiered: LLMEngine, report: SelftestReport, where: str
                    ) -> None:
    """Every block both engines hold under one key must hold the same bytes."""
    shared: list[tuple[BlockKey, int, int]] = [
        (k, b, ref.pool.index[k]) for k, b in tiered.pool.index.items() if k in ref.pool.index
    ]
    for key, mine, theirs in shared:
        report.blocks_compared += 1
        if not torch.equal(tiered.runner.kv[mine], ref.runner.kv[theirs]):
            diff = (tiered.runner.kv[mine].float() - ref.runner.kv[theirs].float()).abs()
            report.byte_mismatches.append(
                f"{where}: block {key.hex()[:12]} differs in {int((diff > 0).sum())} values "
                f"(max |diff| {float(diff.max()):.3g})")
