"""`kvtier selftest` passes on exact restores and catches a corrupted host tier."""

from __future__ import annotations

import pytest

from kvtier.cli import main
from kvtier.engine import LLMEngine
from kvtier.model.loader import LoadedModel
from kvtier.selftest import run_selftest


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
        if self.tier is not None:
            self.tier.host.tensor.add_(1.0)
        return n

    monkeypatch.setattr(LLMEngine, "demote_cached", corrupting)
    report = run_selftest(tiny, conversations=2, turns=2)
    assert not report.ok
    assert report.byte_mismatches and "differs" in report.byte_mismatches[0]


def test_selftest_cli_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--model", "tiny", "--conversations", "2", "--turns", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
