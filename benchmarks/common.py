"""Shared by the benchmarks: machine facts, the copy roofline, and result files."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.provenance import git_sha, hardware


def copy_peak_gbps(device: str = "cpu", mib: int = 256, repeats: int = 7) -> float:
    """Best-of-N bytes copied per second by one tensor copy: the machine's memory roofline."""
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return src.numel() * src.element_size() / best / 1e9


def write_result(name: str, payload: dict[str, Any], out_dir: str | None = None) -> Path:
    """Write JSON with the command, git SHA and hardware beside the numbers; returns the path."""
    directory = Path(out_dir or Path(__file__).parent / "results")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    doc = {"command": " ".join([sys.executable, *sys.argv]), "git_sha": git_sha(),
           "hardware": hardware(), **payload}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)  # never a half-written result file
    return path
