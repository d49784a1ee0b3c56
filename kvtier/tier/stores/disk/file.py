"""The disk tier's bytes: one preallocated file of fixed-size slots, read and written in place.

One file, allocated up front, means no per-block create/unlink or directory churn, no
fragmentation growing over time, ENOSPC reported at startup rather than mid-serve, and
page-aligned slots that pread/pwrite (GIL released, safe from several threads at distinct
offsets) move in one call. Each slot holds a block_format header, then its payload; the
headers let a restarted process find the blocks again (`scan`).

File: a 4096-byte file header (magic, versions, geometry, checksum), then slot i at
4096 + i * slot_nbytes: header area (header_nbytes rounded up to a page), payload area.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
from collections import Counter
from pathlib import Path
from types import TracebackType

import xxhash

from kvtier.errors import ConfigError
from kvtier.tier.config import GIB
from kvtier.tier.fingerprint import FORMAT_VERSION
from kvtier.tier.io.block_format import (
    MAGIC,
    BlockHeader,
    Buffer,
    CorruptBlock,
    as_bytes,
    decode_header,
    encode_header,
)

FILE_NAME = "kvtier-kv.slots"
PAGE = 4096
FILE_HEADER_NBYTES = PAGE
STORE_VERSION = 1  # bump when the slot file layout changes
_FILE_MAGIC = b"KVTSLOTS"
_FILE_HEADER = struct.Struct("<8sHHQQQQ")  # magic, store/format version, geometry
_CHECKSUM = struct.Struct("<Q")
_EMPTY = bytes(len(MAGIC))  # the magic of a slot never written, or invalidated
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class DiskStore:
    """`num_slots` slots of `payload_nbytes` (+ a `header_nbytes` header) in one file."""

    def __init__(self, directory: str | Path, num_slots: int, payload_nbytes: int,
                 header_nbytes: int) -> None:
        self._fd = self._dir_fd = -1  # set first: close() runs even if __init__ fails
        for name, value in (("num_slots", num_slots), ("payload_nbytes", payload_nbytes),
                            ("header_nbytes", header_nbytes)):
            if value < 1:
                raise ConfigError(f"a disk store needs {name} >= 1, got {value}")
        self.directory = Path(directory)
        self.path = self.directory / FILE_NAME
        self.num_slots = num_slots
        self.payload_nbytes = payload_nbytes
        self.header_nbytes = header_nbytes
        self.header_area = round_up(header_nbytes)
        self.slot_nbytes = self.header_area + round_up(payload_nbytes)
        self.file_nbytes = FILE_HEADER_NBYTES + num_slots * self.slot_nbytes
        self._dir_fd = _open_locked_dir(self.directory)
        try:
            self._fd = self._open_or_create()
        except OSError as e:
            self.close()
            raise ConfigError(f"the disk tier file {self.path} cannot be used: {e}") from e
        except BaseException:
            self.close()
            raise

    # -- opening ---------------------------------------------------------------------------

    def _file_header(self) -> bytes:
        return _file_header(self.slot_nbytes, self.num_slots, self.payload_nbytes,
                            self.header_nbytes)

    def _open_or_create(self) -> int:
        """Keep a file of this geometry; replace any other with an empty one."""
        tmp = self.path.with_name(FILE_NAME + ".new")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a creation a crash interrupted: never renamed, never read
        expected = self._file_header()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return self._create(tmp)
        try:
            if os.pread(fd, len(expected), 0) == expected:
                os.fchmod(fd, 0o600)
                if os.fstat(fd).st_size < self.file_nbytes:  # cut short behind our back
                    self._preallocate(fd, self.path)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        # Another geometry (or a damaged file header): its blocks are useless here. Removing
        # it first means a crash leaves either no file or a complete new one at self.path.
        os.unlink(self.path)
        os.fsync(self._dir_fd)
        return self._create(tmp)

    def _create(self, tmp: Path) -> int:
        """A complete, empty file at `tmp`, then renamed into place (atomic on POSIX)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)  # tmp was unlinked: this file is new, and ours
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask narrowed it to
            self._preallocate(fd, tmp)  # zero-filled: no slot has a header yet
            _pwrite_all(fd, self._file_header(), 0)
            os.fsync(fd)
            os.rename(tmp, self.path)
            os.fsync(self._dir_fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return fd

    def _preallocate(self, fd: int, path: Path) -> None:
        """Reserve file_nbytes on disk now; ConfigError if the filesystem cannot hold them."""
        have = os.fstat(fd).st_blocks * 512
        free = shutil.disk_usage(self.directory).free
        if self.file_nbytes - have > free:
            raise self._too_large(path, free + have)
        try:
            if not hasattr(os, "posix_fallocate"):  # macOS
                raise OSError(errno.ENOTSUP, "posix_fallocate is not available")
            os.posix_fallocate(fd, 0, self.file_nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise self._too_large(path, shutil.disk_usage(self.directory).free + have) from e
            if e.errno not in _NO_FALLOCATE:
                raise
            # This filesystem cannot reserve blocks: the file is sparse, and running out of
            # space later surfaces as OSError(ENOSPC) from write, which the caller misses on.
            os.ftruncate(fd, self.file_nbytes)

    def _too_large(self, path: Path, usable: int) -> ConfigError:
        """`usable`: free bytes plus what the file already holds there."""
        need = self.file_nbytes
        slots = max(usable - FILE_HEADER_NBYTES, 0) // self.slot_nbytes
        fits = (f"disk_kv_size={slots * self.slot_nbytes / GIB - 0.0005:.3f} GiB fits there"
                if slots else "not one block fits there")
        return ConfigError(
            f"the disk tier needs {need} bytes ({need / GIB:.3f} GiB) at {path}, but that "
            f"filesystem has {usable} bytes ({usable / GIB:.3f} GiB) free for it; {fits}: "
            f"lower disk_kv_size or choose another disk_kv_path")

    # -- slots -----------------------------------------------------------------------------

    def _offset(self, slot: int) -> int:
        if self._fd < 0:
            raise ValueError(f"the disk store at {self.path} is closed")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside [0, {self.num_slots})")
        return FILE_HEADER_NBYTES + slot * self.slot_nbytes

    def write(self, slot: int, header: BlockHeader, payload: Buffer) -> None:
        """Store one block in `slot`; OSError on I/O errors (the slot then holds no block)."""
        offset = self._offset(slot)
        data = as_bytes(payload)
        if len(data) != header.payload_nbytes:
            raise ValueError(f"payload is {len(data)} bytes, the header says "
                             f"{header.payload_nbytes}")
        if len(data) > self.payload_nbytes:
            raise ValueError(f"payload is {len(data)} bytes, a slot holds {self.payload_nbytes}")
        encoded = encode_header(header)
        if len(encoded) > self.header_nbytes:
            raise ValueError(f"header is {len(encoded)} bytes, a slot holds "
                             f"{self.header_nbytes} (size it with max_header_nbytes)")
        # Old header gone, then the payload, then the header that describes it: a crash or
        # an error at any point leaves no header, a torn one, or one whose checksum fails.
        _pwrite_all(self._fd, _EMPTY, offset)
        _pwrite_all(self._fd, data, offset + self.header_area)
        _pwrite_all(self._fd, encoded, offset)

    def read(self, slot: int, out: Buffer) -> BlockHeader:
        """Read slot's header and its payload into `out`; CorruptBlock if either is unusable.

        The payload checksum is not verified here: callers run block_format.check.
        """
        offset = self._offset(slot)
        dst = as_bytes(out)
        if dst.readonly:
            raise ValueError("read needs a writable buffer to fill")
        header = decode_header(os.pread(self._fd, self.header_nbytes, offset))
        if header.payload_nbytes != len(dst) or header.payload_nbytes > self.payload_nbytes:
            raise CorruptBlock("size", f"slot {slot} holds a {header.payload_nbytes}-byte "
                                       f"payload; the buffer is {len(dst)} bytes and a slot "
                                       f"{self.payload_nbytes}")
        _pread_all(self._fd, dst, offset + self.header_area)
        return header

    def invalidate(self, slot: int) -> None:
        """Zero the slot's header magic: neither `read` nor a later `scan` finds it."""
        _pwrite_all(self._fd, _EMPTY, self._offset(slot))

    def erase(self, slot: int) -> None:
        """Overwrite the whole slot, header and payload, with zeros: its bytes are gone from
        the file, not only unindexed (a purge; a block that failed verification)."""
        offset = self._offset(slot)
        zeros = bytes(min(self.slot_nbytes, 8 << 20))
        for at in range(0, self.slot_nbytes, len(zeros)):
            _pwrite_all(self._fd, zeros[:self.slot_nbytes - at], offset + at)

    def scan(self, unusable: Counter[str] | None = None) -> list[tuple[int, BlockHeader]]:
        """(slot, header) of every slot whose header decodes, in slot order; the rest are
        skipped, and counted by CorruptBlock reason into `unusable` (empty slots are not)."""
        if self._fd < 0:
            raise ValueError(f"the disk store at {self.path} is closed")
        return _scan(self._fd, self.num_slots, self.slot_nbytes, self.payload_nbytes,
                     self.header_nbytes, unusable)

    def flush(self) -> None:
        """Make every completed write durable (fsync)."""
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file and release the directory lock; idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)  # closing the last descriptor drops the flock
            self._dir_fd = -1

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def read_headers(directory: str | Path, num_slots: int, payload_nbytes: int,
                 header_nbytes: int, unusable: Counter[str] | None = None
                 ) -> list[tuple[int, BlockHeader]]:
    """`DiskStore.scan` of the file a store of this geometry keeps in `directory`, read only
    and without its lock: for a process that keeps the index while another owns the bytes
    (vLLM's scheduler beside its worker). No file, or another geometry: nothing."""
    header_area = round_up(header_nbytes)
    slot_nbytes = header_area + round_up(payload_nbytes)
    try:
        fd = os.open(Path(directory) / FILE_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"the disk tier file in {directory} cannot be read: {e}") from e
    try:
        expected = _file_header(slot_nbytes, num_slots, payload_nbytes, header_nbytes)
        if os.pread(fd, len(expected), 0) != expected:
            return []  # the owner replaces it with an empty file of this geometry
        return _scan(fd, num_slots, slot_nbytes, payload_nbytes, header_nbytes, unusable)
    finally:
        os.close(fd)


def _file_header(slot_nbytes: int, num_slots: int, payload_nbytes: int,
                 header_nbytes: int) -> bytes:
    fields = _FILE_HEADER.pack(_FILE_MAGIC, STORE_VERSION, FORMAT_VERSION, slot_nbytes,
                               num_slots, payload_nbytes, header_nbytes)
    return fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))


def _scan(fd: int, num_slots: int, slot_nbytes: int, payload_nbytes: int,
          header_nbytes: int, unusable: Counter[str] | None) -> list[tuple[int, BlockHeader]]:
    found = []
    for slot in range(num_slots):
        raw = os.pread(fd, header_nbytes, FILE_HEADER_NBYTES + slot * slot_nbytes)
        try:
            header = decode_header(raw)
        except CorruptBlock as e:
            if unusable is not None and raw[:len(MAGIC)] != _EMPTY:  # never written, or wiped
                unusable[e.reason] += 1
            continue
        if header.payload_nbytes <= payload_nbytes:
            found.append((slot, header))
        elif unusable is not None:
            unusable["size"] += 1
    return found


def _open_locked_dir(directory: Path) -> int:
    """Create `directory` (0700) if missing; open and lock it so one process owns the store."""
    try:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(directory, 0o700)  # exactly 0700, whatever the umask narrowed it to
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"the disk tier directory {directory} cannot be used: {e}") from e
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        raise ConfigError(f"the disk tier directory {directory} is in use by "
                          f"{_owner(directory)}; give each process its own disk_kv_path"
                          ) from None
    with contextlib.suppress(OSError):  # the lock holds without it: only a refusal's message
        _write_owner(directory)         # would say less
    return dir_fd


OWNER_FILE = "kvtier-kv.owner"


def _write_owner(directory: Path) -> None:
    """Who holds the lock (pid, command), for the message another process gets."""
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    tmp = directory / f".{OWNER_FILE}.{os.getpid()}"
    tmp.write_text(f"{os.getpid()}\n{command[:300]}\n")
    os.replace(tmp, directory / OWNER_FILE)


def _owner(directory: Path) -> str:
    """The lock holder in words: its pid and command (as it runs now, where /proc says)."""
    try:
        pid_text, _, command = (directory / OWNER_FILE).read_text().partition("\n")
        pid = int(pid_text)
    except (OSError, ValueError):
        return "another process (it left no pid)"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"another process (pid {pid} left the lock file, and has exited)"
    except PermissionError:
        pass
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace")
    command = command.strip()[:120]
    return (f"pid {pid}" + (f" ({command})" if command else "") + "; a vLLM engine or "
            "worker lives on after the process that launched it is killed, so this may be "
            f"an orphan: stop it (kill {pid}) if nothing should be serving from there")


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    mv = as_bytes(data)
    while mv:
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def _pread_all(fd: int, out: memoryview, offset: int) -> None:
    """Fill `out` from `offset`; CorruptBlock("truncated") if the file ends first."""
    want = len(out)
    while out:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [out], offset)  # straight into the caller's buffer
        else:
            chunk = os.pread(fd, len(out), offset)
            n = len(chunk)
            out[:n] = chunk
        if n == 0:
            raise CorruptBlock("truncated", f"the file ends {want - len(out)} bytes into a "
                                            f"{want}-byte payload at offset {offset}")
        out, offset = out[n:], offset + n
