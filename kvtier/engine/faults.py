"""Injected failures: the engine's own (one failing request fails alone, through a real
server process) and the tier's (`tier.Faults`, passed on to `build()`). Off unless a test
passes them to `LLMEngine`, or sets the environment, read once when an engine is built:

  KVTIER_FAULT_SAMPLE_SEED=N  a request with seed N fails in sampling (its own failure)
  KVTIER_FAULT_STEP_SEED=N    a forward pass holding a request with seed N fails (the step's)
  KVTIER_FAULT_FATAL_SEED=N   once a request with seed N arrives, every step fails (the
                              engine cannot go on: the server must say so and exit)
  KVTIER_FAULT_LOADS=1        every host -> device load fails (`tier.Faults.from_env`)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.sequence import SamplingParams
from kvtier.tier import Faults


class InjectedEngineFault(RuntimeError):
    """A failure a test asked for."""


def _seed(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


@dataclass
class EngineFaults:
    sample_seed: int | None = None
    step_seed: int | None = None
    fatal_seed: int | None = None
    tier: Faults = field(default_factory=Faults)  # what the tier makes fail
    fatal: bool = field(default=False, init=False)

    @classmethod
    def from_env(cls) -> EngineFaults:
        return cls(_seed("KVTIER_FAULT_SAMPLE_SEED"), _seed("KVTIER_FAULT_STEP_SEED"),
                   _seed("KVTIER_FAULT_FATAL_SEED"), Faults.from_env())

    def admitted(self, params: SamplingParams) -> None:
        if self.fatal_seed is not None and params.seed == self.fatal_seed:
            self.fatal = True

    def before_step(self) -> None:
        if self.fatal:
            raise InjectedEngineFault("injected: the engine is broken for good")

    def before_forward(self, params: Iterable[SamplingParams]) -> None:
        if self.step_seed is not None and any(p.seed == self.step_seed for p in params):
            raise InjectedEngineFault("injected: this forward pass failed")

    def failed_sampling(self, params: SamplingParams) -> bool:
        return self.sample_seed is not None and params.seed == self.sample_seed
