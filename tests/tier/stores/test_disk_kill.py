"""A process SIGKILLed while it writes blocks to the disk tier leaves only blocks that verify:
the write order (old header wiped, payload, then header) makes a torn block invisible or a
header-checksum miss, never a wrong hit. A real kill, mid-stream, at several moments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tier.io.block_format import check, max_header_nbytes
from kvtier.tier.stores.disk.file import DiskStore

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


def expected(key: bytes) -> bytes:
    import hashlib

    return hashlib.shake_128(key).digest(PAYLOAD)


@pytest.mark.parametrize("delay_s", [0.0, 0.013, 0.071])
def test_a_writer_killed_mid_stream_leaves_only_blocks_that_verify(tmp_path: Path,
                                                                   delay_s: float) -> None:
    directory = tmp_path / "kv"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(SLOTS), str(PAYLOAD),
                              str(BLOCK), str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(delay_s)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
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
