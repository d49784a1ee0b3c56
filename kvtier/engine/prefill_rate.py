"""How fast this machine prefills: the planner's starting recompute speed, measured once on
the engine's own runner before the tier is built (the planner refines it from real steps)."""

from __future__ import annotations

import time

import torch

from kvtier.engine.batch import ScheduledSeq
from kvtier.model.runner import ModelRunner
from kvtier.sequence import SamplingParams
from kvtier.sequence import Sequence as Request

CALIBRATION_PREFILL_TOKENS = 256


def measure_prefill(runner: ModelRunner) -> float:
    """Prefill tokens per second on this machine (the planner's starting recompute speed)."""
    tokens = min(CALIBRATION_PREFILL_TOKENS, runner.num_blocks * runner.block_size - 1)
    seq = Request("calibration", [1 + (i * 7) % 50 for i in range(tokens)],
                  SamplingParams(max_tokens=1, temperature=0.0))
    used = list(range(-(-tokens // runner.block_size)))
    chunk = ScheduledSeq(seq, 0, tokens, used)
    runner.execute([chunk])  # warm-up
    start = time.perf_counter()
    runner.execute([chunk])
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)
