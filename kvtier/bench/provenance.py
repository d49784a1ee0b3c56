"""Where a result came from: the git commit and the machine, written beside every number."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_sha() -> str:
    """Short SHA of the checkout kvtier runs from ('unknown' outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> dict[str, Any]:
    """CPU model, cores, torch version and threads, and the GPU when there is one."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
