"""A neighbour who can write the shared directory (the MAC stops forged blocks, not files)
cannot steer the serving user's I/O: no planted link sends a write outside the store, no FIFO
blocks a read, no file of the wrong size is read (issue 42, items 2 and 3)."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import pytest

from kvtier.tier.io.block_format import BlockHeader, CorruptBlock, pack, payload_checksum
from kvtier.tier.io.store import StoreMiss
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import Medium
from kvtier.tier.stores.fs.blocks import BlockFiles, FsBlocks

NS = b"n" * 16
ROW = 4096  # one block's payload: what a host row holds


def block(key: bytes, fill: int = 7) -> tuple[BlockHeader, memoryview]:
    payload = bytes([fill]) * ROW
    return (BlockHeader(NS, key, (1, 2, 3), ROW, payload_checksum(payload)),
            memoryview(payload))


def store(root: Path) -> FsBlocks:
    return FsBlocks(BlockFiles(root / "store", NS), Medium("fs"), mac=None)


def write(blocks: FsBlocks, key: bytes, fill: int = 7) -> list[object]:
    header, payload = block(key, fill)
    return list(blocks.write([0], [header], [payload]))


def test_a_block_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    blocks = store(tmp_path)
    key = b"\xab" * 16
    assert write(blocks, key) == [None]
    out = memoryview(bytearray(ROW))
    header, payload = blocks.read(key, out)
    assert header == block(key)[0] and payload is out and bytes(out) == bytes([7]) * ROW
    assert os.listdir(blocks.files.path(key).parent) == [key.hex()]


def test_links_planted_for_the_block_are_never_written_through(tmp_path: Path) -> None:
    # The block's own name, and the temporary name a writer used to pick (`.<key>.<pid>.
    # <thread>`), are symlinks to a file outside the store: the write neither truncates nor
    # fills it (its rename replaces the block's link), and a read takes a link for no block.
    blocks = store(tmp_path)
    key = b"\x01" * 16
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 56)
    path = blocks.files.path(key)
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}").symlink_to(victim)
    assert write(blocks, key) == [None]
    assert victim.read_bytes() == b"x" * 56
    out = memoryview(bytearray(ROW))
    assert not path.is_symlink() and blocks.read(key, out)[0].key == key
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(CorruptBlock) as e:
        blocks.read(key, out)
    assert e.value.reason is Reason.SIZE


def test_a_linked_directory_makes_the_write_fail_not_land_outside(tmp_path: Path) -> None:
    # The block's subdirectory is a link to a directory outside the store: the write fails
    # (counted), and nothing is created out there.
    blocks = store(tmp_path)
    key = b"\x02" * 16
    outside = tmp_path / "outside"
    outside.mkdir()
    sub = blocks.files.path(key).parent
    sub.parent.mkdir(parents=True)
    sub.symlink_to(outside, target_is_directory=True)
    [error] = write(blocks, key)
    assert isinstance(error, OSError)
    assert os.listdir(outside) == [] and blocks.errors == 1


def test_a_fifo_is_a_size_miss_at_once(tmp_path: Path) -> None:
    blocks = store(tmp_path)
    key = b"\x03" * 16
    path = blocks.files.path(key)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    began = time.monotonic()
    with pytest.raises(CorruptBlock) as e:
        blocks.read(key, memoryview(bytearray(ROW)))
    assert e.value.reason is Reason.SIZE and "not a regular file" in str(e.value)
    assert time.monotonic() - began < 1.0  # never waits for a writer


def test_a_1_gib_file_is_a_size_miss_read_no_further(tmp_path: Path) -> None:
    blocks = store(tmp_path)
    key = b"\x04" * 16
    assert write(blocks, key) == [None]
    path = blocks.files.path(key)
    with path.open("r+b") as f:  # sparse: 1 GiB of length, no bytes on disk
        f.truncate(1 << 30)
    grew_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptBlock) as e:
        blocks.read(key, memoryview(bytearray(ROW)))
    assert e.value.reason is Reason.SIZE and str(1 << 30) in str(e.value)
    # peak RSS (KiB) did not grow by the file: nothing of it was read
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grew_before < 64 * 1024


@pytest.mark.parametrize("size", [0, ROW, ROW - 1])
def test_a_file_no_longer_than_a_row_is_a_size_miss(tmp_path: Path, size: int) -> None:
    blocks = store(tmp_path)
    key = b"\x05" * 16
    path = blocks.files.path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * size)
    with pytest.raises(CorruptBlock) as e:
        blocks.read(key, memoryview(bytearray(ROW)))
    assert e.value.reason is Reason.SIZE


def test_an_absent_block_is_missing(tmp_path: Path) -> None:
    with pytest.raises(StoreMiss) as e:
        store(tmp_path).read(b"\x06" * 16, memoryview(bytearray(ROW)))
    assert e.value.reason is Reason.MISSING


def test_concurrent_writers_of_one_block_never_share_a_temporary_name(tmp_path: Path) -> None:
    # Two writers of the same block (two instances on one directory): each writes its own
    # random name, and the reader sees one of the two whole blocks.
    blocks, other = store(tmp_path), store(tmp_path)
    key = b"\x07" * 16
    assert write(blocks, key, fill=1) == [None] and write(other, key, fill=2) == [None]
    out = memoryview(bytearray(ROW))
    blocks.read(key, out)
    assert bytes(out) == bytes([2]) * ROW
    assert pack(*block(key, 2)) == blocks.files.path(key).read_bytes()
