"""`kvtier selftest` passes on exact restores and catches a corrupted host tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.selftest import run_selftest
from kvtier.cli import main
from kvtier.engine.llm_engine import LLMEngine
from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel


def test_selftest_passes_and_restores_something(tiny: LoadedModel) -> None:
    report = run_selftest(tiny, conversations=3, turns=2)
    assert report.ok, report.as_dict()
    assert report.restored_tokens > 0 and report.blocks_compared > 0


def test_selftest_reports_corruption_with_a_diff(tiny: LoadedModel,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # flip the host copy of every demoted block before it is woken
    original = LLMEngine.demote_cached

    def corrupting(self: LLMEngine) -> int:
        n = original(self)
        if self.tier.enabled:
            self.tier.worker.host.tensor.add_(1.0)
        return n

    monkeypatch.setattr(LLMEngine, "demote_cached", corrupting)
    report = run_selftest(tiny, conversations=2, turns=2)
    assert not report.ok
    assert report.byte_mismatches and "differs" in report.byte_mismatches[0]


def test_selftest_cli_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--model", "tiny", "--conversations", "2", "--turns", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_selftest_across_restarts_wakes_from_disk(tiny: LoadedModel, tmp_path: Path) -> None:
    report = run_selftest(tiny, conversations=2, turns=3, disk_kv_path=str(tmp_path / "kv"),
                          disk_kv_size=0.01, disk_kv_read_gbps=2.0)
    assert report.ok, report.as_dict()
    assert report.restarts == 2
    assert report.residency.get("disk", 0) == 4  # every conversation, every later round


def test_selftest_refuses_a_lossy_tier(tiny: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lossy"):
        run_selftest(tiny, disk_kv_path=str(tmp_path / "kv"), disk_kv_size=0.01,
                     kv_offload_dtype="int8")
