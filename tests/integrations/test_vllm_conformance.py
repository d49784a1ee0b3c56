"""What kvtier's connector uses of vLLM, checked against the vLLM the tests run (0.32, the
CPU build) and against 0.34's own classes (its wheel laid over that environment by
`scripts/vllm_overlay.sh`: no forward pass, its compiled parts need CUDA), with the checker
itself shown to catch what it looks for."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / ".vllm-0.34.0"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_conformance",
                                                  ROOT / "scripts" / "vllm_conformance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Base(ABC):
    def hook(self, request, block_ids):  # type: ignore[no-untyped-def]
        """A hook a connector overrides (vLLM's base classes give defaults)."""
        return None

    @abstractmethod
    def must(self) -> None: ...


class Renamed(Base):
    def hook(self, req, block_ids):  # type: ignore[no-untyped-def]
        """The same hook, a parameter renamed."""


@dataclasses.dataclass
class Data:
    field_a: int = 0


class Assigned:
    def __init__(self) -> None:
        self.set_here = 1


def test_the_checker_catches_a_renamed_parameter_a_missing_hook_and_a_gone_field() -> None:
    c = checker()
    problems = c.signature_problems(Base, Renamed)
    assert problems == ["abstract method left: must",
                        "hook: vLLM's takes (self, request, block_ids), kvtier's (self, req, "
                        "block_ids)"]
    assert c.has(Data, "field_a") and c.has(Assigned, "set_here")
    assert not c.has(Data, "gone") and not c.has(Assigned, "gone")


def run(python: Path, version: str, overlay: Path | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(overlay) if overlay else ""}
    return subprocess.run([str(python), str(ROOT / "scripts" / "vllm_conformance.py"),
                           "--expect", version], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.mark.vllm
def test_the_connector_conforms_to_the_vllm_the_tests_run(vllm_python: Path) -> None:
    out = run(vllm_python, "0.32.0", None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 problem(s)" in out.stdout


@pytest.mark.vllm
def test_the_connector_conforms_to_vllm_0_34s_classes(vllm_python: Path) -> None:
    if not (OVERLAY / ".unpacked-vllm-0.34.0").exists():
        pytest.skip("vLLM 0.34's wheel is not unpacked: bash scripts/vllm_overlay.sh")
    out = run(vllm_python, "0.34.0", OVERLAY)
    assert out.returncode == 0, out.stdout + out.stderr
    # what 0.34 changed that kvtier reads, and follows: a resumed request comes whole
    assert "followed: CachedRequestData.resumed_req_ids is gone" in out.stdout
