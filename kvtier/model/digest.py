"""A full-content digest of a file, computed once per version of the file and cached on disk.

Primitives: `file_digest(path) -> FileDigest` (xxh3-128 of every byte, and whether the cache
served it), `combined_digest(paths) -> str` (a digest over the files' digests in order: a
copy of the files elsewhere has the same one), `cache_path() -> Path | None`, and `stamp`,
`racy` for callers that memoise by a file's stat as the cache does.

Why xxh3-128: the goal is change detection, not collision resistance against an adversary
(whoever can rewrite the weights controls the output anyway), so the fastest hash that reads
every byte wins. benchmarks/identity.py measured 7.3-8.3 GB/s on one core, beside BLAKE3's
4.2 (an extra dependency, for nothing it adds here: its threads gained nothing on 2 cores)
and blake2b's 0.5-0.6; a cold digest costs 0.25 s/GB from the page cache, 0.85 s/GB from
this machine's disk, and a cached one 0.3 ms whatever the size.

The cache is one small JSON file (`$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else
`~/.cache/kvtier`), keyed by the resolved path and the file's (size, mtime_ns, ctime_ns,
inode, device): a rewrite in place that restores the mtime still moves the ctime, which no one
can set back. What the stamp cannot see, and what is done about it:
- A writer through a shared mmap moves the mtime only when it dirties a clean page: a second
  write to a page still dirty moves nothing. So the file is synced (fsync) before it is
  stamped: its pages are clean and write-protected, and any later write faults and moves the
  stamp (a change while it is hashed then fails the before/after comparison).
- A file changed within the kernel's dirty-writeback window (vm.dirty_expire_centisecs +
  vm.dirty_writeback_centisecs, 35 s by default; at least 2 s, and for ever when periodic
  writeback is off) before its hash began is hashed but not cached: a writer may still hold
  dirty pages that the sync could not reach (another host), and a later change in the same
  timestamp tick could leave the stamp unmoved (git's racy-clean problem).
- Not covered: a network filesystem whose attribute cache serves another client's old stamp
  (NFS's acregmax, 60 s by default), and a writer on another host through a shared mmap.
  Pin the identity (the connector's model_identity) where weights change that way.
The cache is replaced atomically (temp file + os.replace), so processes hashing at once never
leave half of one; a corrupt, unreadable or unwritable cache is ignored (debug log).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # one reused read buffer: large reads, no per-chunk allocation
MIN_RACY_NS = 2_000_000_000  # covers coarse kernel clocks and 1-2 s filesystem timestamps
DEFAULT_WRITEBACK_NS = 35_000_000_000  # the kernel's defaults, where /proc cannot be read
RACY_NS: int | None = None  # None: the kernel's dirty-writeback window (tests set 0)
MAX_ENTRIES = 256  # the oldest entries leave first: the file stays small
CACHE_NAME = "digests.json"
FORMAT = "kvtier-file-digests/1 xxh3-128"
_HEX = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class FileDigest:
    """A file's digest, and whether the cache served it (nothing of the file was read)."""

    hex: str
    cached: bool


def cache_path() -> Path | None:
    """Where the digests are cached; None when no home directory can be found."""
    if base := os.environ.get("KVTIER_CACHE_DIR"):
        return Path(base) / CACHE_NAME
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "kvtier" / CACHE_NAME
    try:
        return Path.home() / ".cache" / "kvtier" / CACHE_NAME
    except RuntimeError:  # no $HOME and no passwd entry
        return None


def file_digest(path: str | Path) -> FileDigest:
    """xxh3-128 hex of every byte of `path`, from the cache while the file is unchanged."""
    resolved = Path(path).resolve()
    key = str(resolved)
    cache = cache_path()
    with open(resolved, "rb", buffering=0) as f:  # unbuffered: readinto lands in our buffer
        with contextlib.suppress(OSError):  # a read-only or special filesystem: nothing dirty
            os.fsync(f.fileno())  # clean pages: a later mmap write moves the stamp
        before = stamp(os.fstat(f.fileno()))
        if (hit := _lookup(cache, key, before)) is not None:
            return FileDigest(hit, cached=True)
        began = time.time_ns()
        digest = _hash(f)
        after = stamp(os.fstat(f.fileno()))
    if after == before and not racy(before, began):
        _store(cache, key, before, digest)
    return FileDigest(digest, cached=False)


def combined_digest(paths: Sequence[str | Path]) -> str:
    """xxh3-128 over the files' content digests in order; names and paths are not part of it."""
    h = xxhash.xxh3_128()
    for p in paths:
        h.update(file_digest(p).hex.encode())
    return h.hexdigest()


def stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes whenever a file's bytes do: (size, mtime_ns, ctime_ns, inode, device)."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def racy(file_stamp: tuple[int, ...], now_ns: int) -> bool:
    """Changed within the racy window before `now_ns`: a change to come (or one still in a
    writer's dirty pages) may not move the stamp."""
    window = racy_window_ns() if RACY_NS is None else RACY_NS
    return now_ns - max(file_stamp[1], file_stamp[2]) < window


def racy_window_ns() -> float:
    """The kernel's dirty-writeback window (see the module doc), at least MIN_RACY_NS;
    infinite when periodic writeback is off (dirty pages may stay dirty for ever)."""
    try:
        expire = int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text())
        period = int(Path("/proc/sys/vm/dirty_writeback_centisecs").read_text())
    except (OSError, ValueError):
        return DEFAULT_WRITEBACK_NS
    if period <= 0:
        return math.inf
    return max(MIN_RACY_NS, (expire + period) * 10_000_000)


def _hash(f: BinaryIO, chunk: int = CHUNK) -> str:
    h = xxhash.xxh3_128()
    view = memoryview(bytearray(chunk))
    while n := f.readinto(view):
        h.update(view[:n])
    return h.hexdigest()


def _lookup(cache: Path | None, key: str, file_stamp: tuple[int, ...]) -> str | None:
    entry = _read(cache).get(key)
    if isinstance(entry, dict) and entry.get("stat") == list(file_stamp):
        digest = entry.get("xxh3_128")
        if isinstance(digest, str) and _HEX.fullmatch(digest):
            return digest
    return None


def _read(cache: Path | None) -> dict[str, Any]:
    """The cached entries; {} when there is no usable cache (never an error)."""
    if cache is None:
        return {}
    try:
        doc = json.loads(cache.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        log.debug("kvtier: ignoring the digest cache %s: %s", cache, e)
        return {}
    files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(files, dict):
        log.debug("kvtier: ignoring the digest cache %s: not a %s file", cache, FORMAT)
        return {}
    return files


def _store(cache: Path | None, key: str, file_stamp: tuple[int, ...], digest: str) -> None:
    """Add one entry, re-reading the cache first (another process may have added its own)."""
    if cache is None:
        return
    files = _read(cache)
    files.pop(key, None)
    files[key] = {"stat": list(file_stamp), "xxh3_128": digest}
    for old in list(files)[:-MAX_ENTRIES]:
        del files[old]
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{CACHE_NAME}.", suffix=".tmp", dir=cache.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"format": FORMAT, "files": files}, out)
        os.replace(tmp, cache)
    except OSError as e:
        log.debug("kvtier: cannot write the digest cache %s: %s", cache, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
