"""The shared filesystem's bytes: a block is one file, `<dir>/<namespace>/<key[:2]>/<key>`,
written whole to a temporary name and renamed, so a reader sees a whole block or none.

A file's bytes are the same as a Redis value's (header, then payload; the header signed
under the deployment's secret): the payload is read straight into its host row. Nothing here
evicts: the directory's owner bounds it (a quota, a cron job, the filesystem's own policy);
a write that finds it full fails alone and is counted.

Whoever else can write the directory (the MAC stops forged blocks, not files) must not steer
the serving user's I/O. Writes go through directories opened without following a link, to a
random temporary name created exclusively (`O_EXCL | O_NOFOLLOW`), renamed within the same
directory: no planted link sends a write outside the store. A read opens without following
a link and without blocking (a FIFO answers at once) and takes only a regular file of a
block's size, header and one row; anything else is a `size` miss, read no further (a 1 GiB
file costs a `stat`), and removed like any bad block.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.tier.io.block_format import (
    MAX_TOKENS,
    BlockHeader,
    Buffer,
    CorruptBlock,
    decode_whole_header,
    max_header_nbytes,
    pack,
)
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.io.store import DeadlineReads, StoreMiss
from kvtier.tier.jobs import Reason
from kvtier.tier.keys import BlockKey, Medium

HEADER_LIMIT = max_header_nbytes(MAX_TOKENS)  # a file at most this much longer lands in its row
DIR_MODE = 0o700  # the serving user's, as the disk tier's; widen with the directory's setgid


class BlockFiles:
    """Where each block's file is: one directory per namespace, 256 subdirectories."""

    def __init__(self, root: Path, namespace: bytes) -> None:
        self.root = root
        self.dir = root / namespace.hex()

    def path(self, key: BlockKey) -> Path:
        name = key.hex()
        return self.dir / name[:2] / name

    def exists_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]


class FsBlocks:
    """A shared directory's block files; every block signed with `mac` under a secret."""

    parallel_reads = True  # each read is its own file

    def __init__(self, files: BlockFiles, medium: Medium, mac: BlockMac | None,
                 fsync: bool = False) -> None:
        self.files, self.medium, self.mac, self.fsync = files, medium, mac, fsync
        self._lock = threading.Lock()
        self.errors = 0  # writes and reads that failed with an OSError other than "absent"
        self.last_error = ""

    def write(self, slots: Sequence[int], headers: Sequence[BlockHeader],
              payloads: Sequence[memoryview], keep_until: Sequence[float] = ()
              ) -> list[OSError | StoreMiss | None]:
        # keep_until: a shared directory expires nothing by itself
        errors: list[OSError | StoreMiss | None] = []
        for header, payload in zip(headers, payloads):
            try:
                self._write(self.files.path(header.key), pack(header, payload, self.mac))
            except OSError as e:
                self.note_error(e)
                errors.append(e)
                continue
            errors.append(None)
        return errors

    def renew(self, keys: Sequence[BlockKey], keep_until: Sequence[float]
              ) -> list[OSError | StoreMiss | None]:
        return [None] * len(keys)  # a shared directory expires nothing by itself

    def reads(self, keys: Sequence[BlockKey], rows: Sequence[memoryview],
              deadline: float | None = None) -> DeadlineReads:
        return DeadlineReads(self._counted_read, deadline)

    def _counted_read(self, key: BlockKey, slot: int, out: memoryview
                      ) -> tuple[BlockHeader, Buffer]:
        """`read`, its OSError counted (a shared directory has no slots)."""
        try:
            return self.read(key, out)
        except OSError as e:
            self.note_error(e)
            raise

    def read(self, key: BlockKey, out: memoryview) -> tuple[BlockHeader, Buffer]:
        """The block's header, and its payload read into `out`."""
        try:
            fd = os.open(self.files.path(key),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise StoreMiss(Reason.MISSING, "absent") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptBlock(Reason.SIZE, "a symbolic link where a block file "
                                                "belongs") from None
            raise
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            extra = st.st_size - len(out)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptBlock(Reason.SIZE, f"not a regular file (mode "
                                                f"{stat.filemode(st.st_mode)})")
            if not 0 < extra <= HEADER_LIMIT:
                raise CorruptBlock(Reason.SIZE, f"a {st.st_size}-byte file where a block is "
                                                f"{len(out)} bytes and a header")
            header = _read_exactly(f, memoryview(bytearray(extra)))
            _read_exactly(f, out)
            return decode_whole_header(header), out

    def discard(self, key: BlockKey, slot: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.files.path(key).unlink()

    def flush(self) -> None:
        """Nothing to sync: each write was renamed into place whole (and synced if asked)."""

    def close(self) -> None:
        """No handle stays open between reads."""

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.files.dir), "errors": self.errors,
                "last_error": self.last_error}

    def _write(self, path: Path, blob: bytes) -> None:
        """`blob` under a new random name in `path`'s directory, then renamed over `path`."""
        directory = self._open_dir(path.parent)
        tmp = f".{path.name}.{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY
                         | os.O_CLOEXEC, 0o600, dir_fd=directory)
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=directory)
            raise
        finally:
            os.close(directory)

    def _open_dir(self, directory: Path) -> int:
        """A descriptor of `directory` (below the store's root, made where absent), each step
        below the root opened without following a link: a link planted there is an error."""
        self.files.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        fd = os.open(self.files.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in directory.relative_to(self.files.root).parts:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = below
        except BaseException:
            os.close(fd)
            raise
        return fd

    def note_error(self, e: OSError) -> None:
        """Count a failed read or write (its reason is the job's to report)."""
        with self._lock:
            self.errors += 1
            self.last_error = e.strerror or type(e).__name__


def _read_exactly(f: Any, out: memoryview) -> memoryview:
    """Fill `out` from `f` (CorruptBlock if the file ends first: it was cut short)."""
    got = 0
    while got < len(out):
        n = f.readinto(out[got:])
        if not n:
            raise CorruptBlock(Reason.TRUNCATED, f"the block file ended after {got} of "
                                                 f"{len(out)} bytes")
        got += n
    return out
