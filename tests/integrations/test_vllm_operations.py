"""kvtier under real vLLM as an operator runs it: a disk tier sized to the filesystem it is on,
many clients at once on a small pool, and counters that still mean one thing each."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_run import ONE_PROCESS, parse, run_vllm

pytestmark = pytest.mark.vllm

SLOT_BYTES = 4096 + 30 * 3 * 128 * 2 * 64 * 4  # one 128-token block of SmolLM2 on disk
DISK_SLOTS = 10
DISK_GIB = DISK_SLOTS * SLOT_BYTES / 2**30
# The slot file and 8 MiB more: the old read-rate calibration (47 MB of scratch beside the
# file) died here with "No space left on device".
TMPFS_BYTES = DISK_SLOTS * SLOT_BYTES + 4096 + (8 << 20)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs just large enough for the disk tier's file (skipped where mounting is not
    allowed: an unprivileged container)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_small_tmpfs_disk_serves_after_a_restart_16_clients_count_once_salts_stay_apart(
        vllm_python: Path, smollm2_hf: Path, small_tmpfs: Path) -> None:
    rng = random.Random(7)
    clients = [[rng.randrange(100, 49000) for _ in range(256)] for _ in range(16)]
    last = [rng.randrange(100, 49000) for _ in range(1024)]
    connector = {"kv_offloading_size": 0.25, "disk_kv_path": str(small_tmpfs / "kv"),
                 "disk_kv_size": DISK_GIB}
    # Process 1: 16 clients at once on a 24-block pool (they wait, are preempted, and vLLM
    # asks the connector again each step), then one prompt whose 8 blocks go down last, and
    # that prompt again (vLLM's own prefix hit: the reference for a restore of it).
    first = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": connector, "blocks": 24, "max_num_seqs": 16, "concurrent": clients,
        "prompts": [last, last], "metrics": True}, env=ONE_PROCESS).stdout)
    offered = sum(map(len, clients)) + 2 * len(last)
    m = first["metrics"]
    assert 0 < m["vllm:kvtier_lookup_tokens"] <= offered  # once per request, not per retry
    assert m["vllm:kvtier_written_blocks{tier=disk}"] >= 8
    assert not any(k.startswith("vllm:kvtier_write_failures") for k in m)
    # Process 2 on the same small filesystem finds the last prompt on disk, exactly; then the
    # same tokens under a cache_salt find nothing, though kvtier's host now holds them.
    second = parse(run_vllm(vllm_python, smollm2_hf, {
        "connector": connector, "blocks": 24, "prompts": [last, last],
        "salts": [None, "tenant-b"], "metrics": True}, env=ONE_PROCESS).stdout)
    woken, salted = second["results"]
    assert woken["kv_transfer_params"]["kvtier_residency"] == "disk"
    assert woken["kv_transfer_params"]["kvtier_restored_tokens"] == 7 * 128
    assert salted["kv_transfer_params"]["kvtier_restored_tokens"] == salted["cached"] == 0
    assert salted["tokens"] == woken["tokens"]
    # bit for bit what process 1 answered over its own cached prefix (vllm_run.prompts)
    hit = first["results"][1]
    assert hit["cached"] == 7 * 128
    assert (woken["tokens"], woken["logprobs"]) == (hit["tokens"], hit["logprobs"])
