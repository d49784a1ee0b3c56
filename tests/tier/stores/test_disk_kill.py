"""A process SIGKILLed while it writes blocks leaves only blocks that verify. The disk tier:
the write order (old header wiped, payload, then header) makes a torn block invisible or a
header-checksum miss, never a wrong hit. The shared directory (what a P/D producer writes
its handoff to): a block is renamed into place whole, so a torn one is a temporary file no
reader opens. A real kill, mid-stream, at several moments."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tier.io.block_format import check, max_header_nbytes
from kvtier.tier.keys import Medium
from kvtier.tier.stores.disk.file import DiskStore
from kvtier.tier.stores.fs.blocks import BlockFiles, FsBlocks

SLOTS, PAYLOAD, BLOCK = 32, 1 << 20, 4  # 1 MiB payloads: a write takes long enough to be hit
NS = bytes(range(16))

WRITER = """
import hashlib, sys
from kvtier.tier.io.block_format import BlockHeader, payload_checksum, max_header_nbytes
from kvtier.tier.stores.disk.file import DiskStore
slots, size, block, directory = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = DiskStore(directory, slots, size, max_header_nbytes(block))
n = 0
while True:
    key = b"k%d" % n
    payload = hashlib.shake_128(key).digest(size)
    store.write(n % slots, BlockHeader(bytes(range(16)), key, (1, 2, 3, 4), size,
                                       payload_checksum(payload)), payload)
    n += 1
    if n == slots:
        print("ready", flush=True)
"""


def kill_mid_stream(delay_s: float, script: str, *args: object) -> None:
    """Run the writer `script` with `args`, and SIGKILL it `delay_s` after it said ready."""
    child = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)


def expected(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(PAYLOAD)


@pytest.mark.parametrize("delay_s", [0.0, 0.013, 0.071])
def test_a_writer_killed_mid_stream_leaves_only_blocks_that_verify(tmp_path: Path,
                                                                   delay_s: float) -> None:
    directory = tmp_path / "kv"
    kill_mid_stream(delay_s, WRITER, SLOTS, PAYLOAD, BLOCK, directory)
    store = DiskStore(directory, SLOTS, PAYLOAD, max_header_nbytes(BLOCK))  # its lock is free
    try:
        found = store.scan()
        assert len(found) >= SLOTS - 1  # at most the slot being written is lost
        out = bytearray(PAYLOAD)
        for slot, header in found:
            store.read(slot, out)
            assert check(header, namespace=NS, key=header.key, tokens=(1, 2, 3, 4),
                         payload=out) is None
            assert bytes(out) == expected(header.key)
    finally:
        store.close()


FS_PAYLOAD = 16 << 20  # one write(2) of a block this large is cut short by a kill, not whole
FS_WRITER = """
import hashlib, sys
from pathlib import Path
from kvtier.tier.io.block_format import BlockHeader, payload_checksum
from kvtier.tier.keys import Medium
from kvtier.tier.stores.fs.blocks import BlockFiles, FsBlocks
size, root = int(sys.argv[1]), Path(sys.argv[2])
store = FsBlocks(BlockFiles(root, bytes(range(16))), Medium("fs"), mac=None)
n = 0
while True:
    key = hashlib.sha256(b"%d" % n).digest()[:16]
    payload = hashlib.shake_128(key).digest(size)
    [error] = store.write([0], [BlockHeader(bytes(range(16)), key, (1, 2, 3, 4), size,
                                            payload_checksum(payload))], [memoryview(payload)])
    assert error is None, error
    n += 1
    if n == 8:
        print("ready", flush=True)
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.013, 0.071])
def test_a_shared_directory_writer_killed_mid_stream_leaves_whole_blocks(
        tmp_path: Path, delay_s: float) -> None:
    root = tmp_path / "shared"
    kill_mid_stream(delay_s, FS_WRITER, FS_PAYLOAD, root)
    try:
        check_whole(root)
    finally:
        shutil.rmtree(root)  # some 200 MB a case


def check_whole(root: Path) -> None:
    """Every block file under `root` reads whole and right, in the order it was written."""
    files = [f for f in (root / bytes(range(16)).hex()).rglob("*") if f.is_file()]
    torn = [f for f in files if f.name.startswith(".")]
    assert len(torn) <= 1  # at most the block being written, under its temporary name
    blocks = FsBlocks(BlockFiles(root, NS), Medium("fs"), mac=None)
    written, n = 0, 0
    out = memoryview(bytearray(FS_PAYLOAD))
    while (key := hashlib.sha256(b"%d" % n).digest()[:16]) and blocks.files.path(key).exists():
        header, payload = blocks.read(key, out)  # every block a reader finds is whole
        assert check(header, namespace=NS, key=key, tokens=(1, 2, 3, 4), payload=payload) \
            is None
        assert bytes(payload) == hashlib.shake_128(key).digest(FS_PAYLOAD)
        written, n = written + 1, n + 1
    assert written >= 8 and written == len(files) - len(torn)  # no gap: written in order
