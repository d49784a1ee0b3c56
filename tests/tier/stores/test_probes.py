"""The disk tier's read-rate calibration: measured where there is room, a slow guess (and a
warning) where there is not, so a disk that fits the slot file always starts."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from kvtier.tier.stores.disk import probe as probes

Usage = namedtuple("Usage", "total used free")


def test_the_calibration_reads_back_what_it_wrote_and_leaves_nothing(tmp_path: Path) -> None:
    gbps = probes.measure_disk_gbps(tmp_path, 4096, blocks=4)
    assert gbps > 0 and gbps != probes.UNMEASURED_DISK_GBPS
    assert os.listdir(tmp_path) == []


def test_a_filesystem_the_slot_file_filled_gets_a_slow_guess_not_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10**9, 10**9 - 4096, 4096))
    with caplog.at_level(logging.WARNING):
        assert probes.measure_disk_gbps(tmp_path, 4096, blocks=4) == probes.UNMEASURED_DISK_GBPS
    assert "could not be measured" in caplog.text and "disk_kv_read_gbps" in caplog.text
    assert os.listdir(tmp_path) == []


def test_a_write_that_runs_out_of_space_midway_is_the_same_guess(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite

    def full(fd: int, data: bytes, offset: int) -> int:
        if offset > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    assert probes.measure_disk_gbps(tmp_path, 4096, blocks=4) == probes.UNMEASURED_DISK_GBPS
    assert os.listdir(tmp_path) == []  # the scratch is removed on the way out
