"""The shared filesystem store, added as one folder: blocks cross processes byte-exact through
a directory, a damaged, cut or foreign file is a miss and is removed, another secret's
blocks are never found, and its knobs refuse bad values with the knob's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_tier_faults import (
    BASE,
    BLOCK,
    CHILD,
    Engine,
    assert_same,
    greedy_answers,
    prompt,
    woken_on_b,
)

from kvtier.errors import ConfigError
from kvtier.model.loader import LoadedModel
from kvtier.tier import TierConfig
from kvtier.tier.io.block_format import BlockHeader, pack, unpack
from kvtier.tier.keys import Medium

FS = Medium("fs")
SECRET = "a-shared-secret-of-32-bytes-xxxx"


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> Any:
    return greedy_answers(tiny)


def knobs(directory: Path, **more: Any) -> dict[str, Any]:
    return {"kv_stores": {"fs": {"path": str(directory), "read_gbps": 1.0}}, **more}


def written(directory: Path, **more: Any) -> list[int]:
    """Process A serves one turn through the directory and exits; the next turn's prompt."""
    first = prompt(3)
    done = subprocess.run([sys.executable, "-c", CHILD,
                           json.dumps({**BASE, **knobs(directory, **more)}), json.dumps(first)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return [*first, *json.loads(done.stdout.strip().splitlines()[-1]), 3, 4, 5, 6]


def test_a_conversation_from_process_a_wakes_on_b(tiny: LoadedModel, tmp_path: Path,
                                                  reference: Any) -> None:
    stats = woken_on_b(tiny, written(tmp_path), reference, "fs", **knobs(tmp_path))
    assert stats["fs"]["hits"] == 6 and stats["fs"]["errors"] == 0


@pytest.mark.parametrize("damage, reason", [("payload", "checksum"), ("cut", "truncated"),
                                            ("foreign", "fingerprint"), ("fifo", ""),
                                            ("huge", "size")])
def test_a_damaged_file_is_a_miss_and_is_removed(damage: str, reason: str, tiny: LoadedModel,
                                                 tmp_path: Path, reference: Any) -> None:
    ids = written(tmp_path)
    b = Engine(tiny, **knobs(tmp_path))
    try:
        path = b.engine.tier.worker.store(FS).files.path(b.keys(ids)[2])
        header, payload = unpack(path.read_bytes())
        if damage == "payload":
            bad = bytearray(payload)
            bad[100] ^= 0x40
            path.write_bytes(pack(header, bytes(bad)))
        elif damage == "cut":  # the file's last 10 bytes lost
            path.write_bytes(pack(header, payload)[:-10])
        elif damage == "fifo":  # a neighbour's FIFO, which a read would wait on: the lookup
            # takes only regular files, so it is never read (one swapped in after the
            # lookup is a size miss at once: tests/tier/stores/test_fs_blocks.py)
            path.unlink()
            os.mkfifo(path)
        elif damage == "huge":  # 1 GiB (sparse): never read
            with path.open("r+b") as f:
                f.truncate(1 << 30)
        else:
            foreign = BlockHeader(b"\x01" * 16, header.key, header.tokens,
                                  header.payload_nbytes, header.checksum)
            path.write_bytes(pack(foreign, payload))
        out = b.run(ids)
        stats = b.deep()
    finally:
        b.close()
    assert_same(out, reference(ids))
    assert out.residency == "remote" and out.num_restored_tokens == 2 * BLOCK
    assert stats["misses"] == ({f"fs:{reason}": 1} if reason else {})
    # the bad file was removed; the recomputed block was written again, whole and good
    assert not path.exists() or path.read_bytes() == pack(header, payload)


def test_another_secret_never_finds_the_blocks(tiny: LoadedModel, tmp_path: Path,
                                               reference: Any) -> None:
    ids = written(tmp_path, remote_kv_secret=SECRET)
    b = Engine(tiny, **knobs(tmp_path, remote_kv_secret="another-secret-of-32-bytes-yyyyy"))
    try:
        out = b.run(ids)
    finally:
        b.close()
    assert out.residency != "remote" and out.num_restored_tokens == 0
    assert_same(out, reference(ids))
    same = Engine(tiny, **knobs(tmp_path, remote_kv_secret=SECRET))
    try:
        again = same.run(ids)
    finally:
        same.close()
    assert again.residency == "remote" and again.num_restored_tokens == 6 * BLOCK


@pytest.mark.parametrize("stores, why", [
    ({"fs": {}}, "needs 'path'"),
    ({"fs": {"path": "  "}}, "needs 'path'"),
    ({"fs": {"path": "/tmp/x", "size": 3}}, "unknown knob"),
    ({"fs": {"path": "/tmp/x", "read_gbps": float("nan")}}, "read_gbps"),
    ({"fs": {"path": "/tmp/x", "read_gbps": -1}}, "read_gbps"),
    ({"fs": {"path": 7}}, "must be a string"),
    ({"fs": {"path": "/tmp/x", "fsync": "yes"}}, "true or false"),
    ({"fs": "/tmp/x"}, "object of that store's knobs"),
    ({"s3": {}}, "no store"),
    ({"disk": {"path": "/tmp/x"}}, r"kv_stores\['disk'\]\['path'\] is set but "
                                   r"kv_stores\['disk'\]\['size'\] is 0"),
    ({"disk": {"path": "/tmp/x", "size": 1, "disk_kv_size": 2}}, "both set"),
    ({"redis": {"url": "redis://h:1/0", "ttl": 3}}, "unknown knob 'ttl'"),
    ({"tests.nowhere:STORE": {}}, "cannot be imported"),
    ({"kvtier.tier.config:GIB": {}}, "no store kind"),
])
def test_bad_knobs_are_config_errors_naming_them(stores: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        TierConfig.of(kv_offloading_size=1, kv_stores=stores).validate()


def test_a_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        TierConfig.of(kv_offloading_size=1, kv_stores={"fs": {"path": str(tmp_path / "f")}}
                   ).validate()
    with pytest.raises(ConfigError, match="staged through host memory"):
        TierConfig.of(kv_stores={"fs": {"path": str(tmp_path)}}).validate()
