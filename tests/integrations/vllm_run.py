"""Starting the vLLM driver (`vllm_driver.py`) in the vLLM environment and reading what it
printed; shared by the connector's tests and its benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "scripts" / "vllm_driver.py"
# SmolLM2-135M in float32 on vLLM CPU, 128-token blocks: 30 layers x 3 KV heads x 128 x 2 x 64
KV_BYTES_PER_BLOCK = 30 * 3 * 128 * 2 * 64 * 4
MARK = "KVTIER_RESULT "


def run_vllm(python: Path, model: Path, spec: dict[str, Any], env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    spec = {"kv_bytes_per_block": KV_BYTES_PER_BLOCK, **spec}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # prompts outgrow argv
        json.dump(spec, f)
        f.flush()
        proc = subprocess.run(
            [str(python), str(DRIVER), str(model), "@" + f.name], capture_output=True,
            text=True, timeout=900, cwd=ROOT, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise AssertionError(f"vLLM driver exited {proc.returncode}")
    return proc


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return parse(proc.stdout)["results"]


def parse(stdout: str) -> dict[str, Any]:
    """The driver's result line (vLLM logs to stdout as well)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
    assert lines, f"the vLLM driver printed no result; its output ends: {stdout[-2000:]}"
    return json.loads(lines[-1][len(MARK):])
