"""kvtier as SGLang's HiCache storage backend, against SGLang's own classes: the cases in
sglang_cases.py run in a child pytest with `.sglang-libs` on its path (scripts/sglang_env.sh
installs it; `make test` does). SGLang itself cannot serve here: its wheel has no CPU kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / ".sglang-libs"


def test_kvtier_keeps_sglangs_hicache_storage_contract(redis_server: Any) -> None:
    if not any(LIBS.glob(".installed-*")):
        why = "SGLang's classes are not installed (bash scripts/sglang_env.sh)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the SGLang backend's tests")
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(LIBS), "KVTIER_TEST_REDIS_URL": redis_server.url}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).with_name("sglang_cases.py"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
