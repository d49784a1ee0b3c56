"""The disk tier's slot file: exact round trips, found again after a restart, and every way
the file can go wrong (truncation, flipped bytes, torn writes, no space) is a miss."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.tier.fingerprint import Fingerprint
from kvtier.tier.io.block_format import (
    MAGIC,
    BlockHeader,
    CorruptBlock,
    check,
    max_header_nbytes,
    payload_checksum,
    tensor_bytes,
)
from kvtier.tier.stores.disk.file import FILE_HEADER_NBYTES, FILE_NAME, OWNER_FILE, DiskStore

NS = Fingerprint("w" * 64, "llama", "float32", 4, "t" * 64).namespace()
BLOCK_SIZE = 4
ROW_SHAPE = (2, BLOCK_SIZE, 2, 2, 8)  # [num_layers, block_size, 2, num_kv_heads, head_dim]
ROW_NBYTES = 2 * BLOCK_SIZE * 2 * 2 * 8 * 4  # float32
HEADER_NBYTES = max_header_nbytes(BLOCK_SIZE)


def make_store(directory: Path, num_slots: int = 4, payload_nbytes: int = ROW_NBYTES
               ) -> DiskStore:
    return DiskStore(directory, num_slots, payload_nbytes, HEADER_NBYTES)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    with make_store(tmp_path / "kv") as s:
        yield s


def block(i: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, BlockHeader]:
    """Host row i (seeded) and its header."""
    row = torch.randn(ROW_SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)
    data = tensor_bytes(row)
    tokens = tuple(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))
    return row, BlockHeader(NS, f"key-{i}".encode(), tokens, len(data), payload_checksum(data))


def flip(path: Path, offset: int) -> None:
    """Flip one bit of the byte at `offset`, behind the store's back."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def refusal(store: DiskStore, slot: int, header: BlockHeader, out: torch.Tensor) -> str | None:
    """What a reader decides about `slot`: a CorruptBlock reason, a check reason, or None."""
    try:
        found = store.read(slot, tensor_bytes(out))
    except CorruptBlock as e:
        return e.reason
    return check(found, namespace=NS, key=header.key, tokens=header.tokens,
                 payload=tensor_bytes(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_round_trip_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    nbytes = ROW_NBYTES * torch.empty((), dtype=dtype).element_size() // 4
    with make_store(tmp_path / "kv", payload_nbytes=nbytes) as store:
        rows = {slot: block(slot, dtype) for slot in (0, 3, 1)}
        for slot, (row, header) in rows.items():
            store.write(slot, header, tensor_bytes(row))
        for slot, (row, header) in rows.items():
            out = torch.empty(ROW_SHAPE, dtype=dtype)
            assert store.read(slot, tensor_bytes(out)) == header
            assert torch.equal(out, row)
            assert refusal(store, slot, header, out) is None


def test_geometry_is_page_aligned(store: DiskStore) -> None:
    assert store.slot_nbytes == 4096 + 4096  # header page + one page for a 1 KiB payload
    assert store.file_nbytes == FILE_HEADER_NBYTES + 4 * store.slot_nbytes
    assert os.stat(store.path).st_size == store.file_nbytes
    assert os.stat(store.path).st_blocks * 512 >= store.file_nbytes  # reserved, not sparse


def test_modes_are_0700_and_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with make_store(tmp_path / "a" / "kv") as s:
            assert stat.S_IMODE(os.stat(tmp_path / "a" / "kv").st_mode) == 0o700
            assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_restart_finds_every_block_with_its_header(tmp_path: Path) -> None:
    blocks = {slot: block(slot) for slot in (2, 0)}
    with make_store(tmp_path / "kv") as first:
        for slot, (row, header) in blocks.items():
            first.write(slot, header, tensor_bytes(row))
        first.flush()
    with make_store(tmp_path / "kv") as second:
        assert second.scan() == [(0, blocks[0][1]), (2, blocks[2][1])]
        out = torch.empty(ROW_SHAPE)
        assert refusal(second, 2, blocks[2][1], out) is None
        assert torch.equal(out, blocks[2][0])


def test_another_geometry_recreates_the_file_empty(tmp_path: Path) -> None:
    with make_store(tmp_path / "kv") as first:
        row, header = block(1)
        first.write(1, header, tensor_bytes(row))
    with make_store(tmp_path / "kv", num_slots=6, payload_nbytes=2 * ROW_NBYTES) as second:
        assert second.scan() == []
        assert os.stat(second.path).st_size == second.file_nbytes
    assert sorted(os.listdir(tmp_path / "kv")) == [OWNER_FILE, FILE_NAME]  # no temporary


def test_a_damaged_file_header_recreates_the_file_empty(tmp_path: Path) -> None:
    with make_store(tmp_path / "kv") as first:
        row, header = block(1)
        first.write(1, header, tensor_bytes(row))
        flip(first.path, 20)  # a geometry field
    with make_store(tmp_path / "kv") as second:
        assert second.scan() == []


def test_invalidate_hides_a_slot_from_read_and_scan(tmp_path: Path) -> None:
    with make_store(tmp_path / "kv") as store:
        for slot in (0, 1):
            row, header = block(slot)
            store.write(slot, header, tensor_bytes(row))
        store.invalidate(0)
        assert [slot for slot, _ in store.scan()] == [1]
        assert refusal(store, 0, block(0)[1], torch.empty(ROW_SHAPE)) == "magic"
    with make_store(tmp_path / "kv") as again:
        assert [slot for slot, _ in again.scan()] == [1]


def test_a_file_truncated_behind_the_stores_back_reads_as_truncated(store: DiskStore) -> None:
    row, header = block(3)
    store.write(3, header, tensor_bytes(row))
    payload_at = FILE_HEADER_NBYTES + 3 * store.slot_nbytes + store.header_area
    os.truncate(store.path, payload_at + 100)  # the header survives, the payload is cut
    out = torch.zeros(ROW_SHAPE)
    assert refusal(store, 3, header, out) == "truncated"
    os.truncate(store.path, payload_at - store.header_area + 10)  # now the header is cut too
    assert refusal(store, 3, header, out) == "truncated"
    assert store.scan() == []


def test_a_file_cut_short_while_closed_is_extended_and_keeps_its_blocks(tmp_path: Path) -> None:
    with make_store(tmp_path / "kv") as first:
        row, header = block(0)
        first.write(0, header, tensor_bytes(row))
        cut = FILE_HEADER_NBYTES + 2 * first.slot_nbytes
    os.truncate(tmp_path / "kv" / FILE_NAME, cut)
    with make_store(tmp_path / "kv") as second:
        assert os.stat(second.path).st_size == second.file_nbytes
        assert second.scan() == [(0, header)]


def test_without_fallocate_the_file_is_sized_sparse(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with make_store(tmp_path / "kv") as store:
        assert os.stat(store.path).st_size == store.file_nbytes
        row, header = block(1)
        store.write(1, header, tensor_bytes(row))
        assert store.read(1, tensor_bytes(torch.empty(ROW_SHAPE))) == header


def test_a_flipped_payload_byte_on_disk_is_a_checksum_failure(store: DiskStore) -> None:
    row, header = block(2)
    store.write(2, header, tensor_bytes(row))
    flip(store.path, FILE_HEADER_NBYTES + 2 * store.slot_nbytes + store.header_area + 77)
    assert refusal(store, 2, header, torch.empty(ROW_SHAPE)) == "checksum"


def test_a_flipped_header_byte_on_disk_is_refused(store: DiskStore) -> None:
    row, header = block(1)
    store.write(1, header, tensor_bytes(row))
    flip(store.path, FILE_HEADER_NBYTES + store.slot_nbytes + 12)  # in the namespace field
    assert refusal(store, 1, header, torch.empty(ROW_SHAPE)) == "header-checksum"
    assert store.scan() == []


def test_a_write_that_fails_before_its_header_leaves_no_block(
        store: DiskStore, monkeypatch: pytest.MonkeyPatch) -> None:
    old_row, old_header = block(0)
    store.write(0, old_header, tensor_bytes(old_row))
    real_pwrite = os.pwrite

    def failing_header_write(fd: int, data: memoryview, offset: int) -> int:
        if bytes(data[:len(MAGIC)]) == MAGIC:  # the new header: the crash lands right here
            raise OSError(errno.EIO, "injected")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_header_write)
    row, header = block(9)
    with pytest.raises(OSError, match="injected"):
        store.write(0, header, tensor_bytes(row))
    monkeypatch.undo()
    # neither the old block (its bytes are gone) nor the new one (no header) is found
    assert store.scan() == []
    assert refusal(store, 0, old_header, torch.empty(ROW_SHAPE)) == "magic"


def test_a_size_the_filesystem_cannot_hold_is_a_config_error(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    slots = free // (4096 + 2**20) + 1000
    with pytest.raises(ConfigError) as err:
        DiskStore(tmp_path / "kv", slots, 2**20, HEADER_NBYTES)
    message = str(err.value)
    assert str(tmp_path / "kv") in message and "bytes" in message and "free" in message
    assert str(slots * (4096 + 2**20) + FILE_HEADER_NBYTES) in message
    assert "GiB fits there" in message  # the size to ask for instead
    assert os.listdir(tmp_path / "kv") == [OWNER_FILE]  # no half-made file


def test_a_locked_directory_names_the_process_that_holds_it(store: DiskStore) -> None:
    with pytest.raises(ConfigError) as err:
        make_store(store.directory)
    assert f"in use by pid {os.getpid()}" in str(err.value)
    assert "orphan" in str(err.value) and f"kill {os.getpid()}" in str(err.value)


def test_bad_arguments_are_refused(store: DiskStore, tmp_path: Path) -> None:
    row, header = block(0)
    with pytest.raises(ValueError, match=r"slot 4 is outside \[0, 4\)"):
        store.write(4, header, tensor_bytes(row))
    with pytest.raises(ValueError, match="header says"):
        store.write(0, header, tensor_bytes(row)[:-4])
    big = bytes(ROW_NBYTES + 1)
    big_header = BlockHeader(NS, b"k", (1,), len(big), payload_checksum(big))
    with pytest.raises(ValueError, match="a slot holds"):
        store.write(0, big_header, big)
    store.write(0, header, tensor_bytes(row))
    with pytest.raises(CorruptBlock) as err:
        store.read(0, bytearray(ROW_NBYTES - 1))
    assert err.value.reason == "size"
    with pytest.raises(ValueError, match="writable"):
        store.read(0, bytes(ROW_NBYTES))
    with pytest.raises(ConfigError, match="num_slots >= 1"):
        DiskStore(tmp_path / "other", 0, 1, 1)
    with pytest.raises(ConfigError, match="in use by pid"):
        make_store(store.directory)  # one owner per directory
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.read(0, bytearray(ROW_NBYTES))
