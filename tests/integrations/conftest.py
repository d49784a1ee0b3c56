"""Real vLLM for the connector's tests: its own environment (`scripts/vllm_env.sh`, run by
`make test`), and SmolLM2-135M exported from the embedded GGUF as a Hugging Face directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from vllm_run import VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    ready = VLLM_PYTHON.exists() and subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True).returncode == 0
    if not ready:
        why = f"no vLLM environment at {VLLM_PYTHON}; run bash scripts/vllm_env.sh"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.model.export import export_hf
    from kvtier.model.loader import load_model

    return export_hf(load_model(None), tmp_path_factory.mktemp("hf") / "smollm2-135m")
