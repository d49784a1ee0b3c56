"""Host -> vLLM copy paths on the CPU: what a whole-block wake costs in the worker's copy alone.

A 2048-token SmolLM2-135M session under vLLM's CPU backend is 16 blocks of 128 tokens,
30 layers each, 94 MB. vLLM 0.32 keeps its per-layer KV tensors side by side in one
allocation; kvtier's host slot holds one block for all layers. Rows:
  per layer    one copy_ per (run of blocks, layer): 480 calls of 196 KB for scattered blocks
  stacked      one strided copy_ per run of blocks across all layers (`stacked_layers`)
each on one thread and shared by a two-thread `CopyTeam`; plus one contiguous 94 MB copy on
two threads (the machine's peak for this size).

  python benchmarks/copy_paths.py [--trials 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.tier.layout import KVLayout
from kvtier.tier.link.copy import CopyTeam, copy_blocks
from kvtier.tier.link.threads import use_one_thread

LAYERS, POOL, HEADS, TOKENS, WIDTH = 30, 48, 3, 128, 128  # vLLM's [blocks, heads, tokens, 2*dim]
SLOTS, WAKE_BLOCKS = 64, 16


def vllm_layout(stacked: bool) -> KVLayout:
    """vLLM's one allocation, or the same layers with a gap between two (no stacked view)."""
    size = POOL * HEADS * TOKENS * WIDTH
    buf = torch.zeros(LAYERS * size + (0 if stacked else 64))
    offsets = [i * size + (0 if stacked or i < LAYERS // 2 else 64) for i in range(LAYERS)]
    return KVLayout.from_layers([buf[o : o + size].view(POOL, HEADS, TOKENS, WIDTH)
                                 for o in offsets], heads_first=True)


def timed(fn: Callable[[], Any], trials: int) -> list[float]:
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.trials < 1:
        raise SystemExit("--trials must be at least 1")
    use_one_thread()
    host = torch.randn(SLOTS, LAYERS, HEADS, TOKENS, WIDTH)
    nbytes = WAKE_BLOCKS * host[0].numel() * host.element_size()
    rng = random.Random(0)
    team = CopyTeam(2)
    rows: dict[str, list[float]] = {}
    for name, stacked in (("per layer", False), ("stacked", True)):
        layout = vllm_layout(stacked)
        for threads, by in (("1 thread", None), ("2 threads", team)):
            def wake(layout: KVLayout = layout, by: CopyTeam | None = by) -> None:
                copy_blocks(layout, host, rng.sample(range(POOL), WAKE_BLOCKS),
                            rng.sample(range(SLOTS), WAKE_BLOCKS), store=False, team=by)
            wake()  # the team's threads start
            rows[f"{name}, {threads}"] = timed(wake, args.trials)
    team.close()
    src = host[:WAKE_BLOCKS].clone()
    dst = torch.zeros_like(src)
    torch.set_num_threads(2)
    rows["one contiguous copy, 2 threads"] = timed(lambda: dst.copy_(src), args.trials)
    print(f"{nbytes / 1e6:.0f} MB per wake ({WAKE_BLOCKS} scattered blocks), "
          f"{args.trials} trials")
    print(f"{'copy':34} {'p50 ms':>8} {'min ms':>8} {'p50 GB/s':>9}")
    summary = {}
    for name, ts in rows.items():
        p50 = statistics.median(ts)
        summary[name] = {"p50_s": p50, "min_s": min(ts), "gbps_p50": nbytes / p50 / 1e9}
        print(f"{name:34} {p50 * 1e3:8.1f} {min(ts) * 1e3:8.1f} {nbytes / p50 / 1e9:9.1f}")
    path = write_result("copy_paths", {"bytes": nbytes, "trials": args.trials,
                                       "rows": summary}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
