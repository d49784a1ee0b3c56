"""Disk tier layout: one preallocated file of slots (DiskStore: pwrite/pread in place) against
one file per block (create, write, close; open, read, close), in write and read GB/s on the
disk under --dir, at a SmolLM2-135M block (16 tokens fp32: 737,280 B) and at 2 MiB.

Reads go in a shuffled order after the files' pages are flushed and dropped from the page
cache (posix_fadvise DONTNEED); the share still resident is measured (mincore) and printed,
because a page the kernel kept serves the read from RAM. Without --fsync, write GB/s is how
fast the page cache absorbs the writes; with it, each variant fsyncs once after writing.

    python benchmarks/disk_layout.py [--dir DIR] [--total-mib 512] [--fsync] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

from kvtier.tier.io.block_format import (
    BlockHeader,
    check,
    decode_header,
    encode_header,
    max_header_nbytes,
    payload_checksum,
)
from kvtier.tier.stores.disk.file import DiskStore

BLOCK_TOKENS = 16
NAMESPACE = bytes(range(16))
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_fraction(paths: list[Path]) -> float | None:
    """Share of these files' pages in the page cache now (mincore), None where unsupported."""
    if not hasattr(_libc, "mincore"):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # untouched: file pages
        pages = -(-size // page)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mm)
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor  # the mapping cannot close while a ctypes object points into it
        mm.close()
        if rc != 0:
            return None
        resident += sum(v & 1 for v in vec)
        total += pages
    return resident / total if total else 0.0


def drop_cache(paths: list[Path]) -> None:
    """Write back, then ask the kernel to forget, every page of these files."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_all(fd: int, parts: list[Any]) -> None:
    """writev every byte of `parts` (a partial write continues where it stopped)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def bench_slots(root: Path, payload: np.ndarray, headers: list[BlockHeader], order: list[int],
                fsync: bool) -> dict[str, Any]:
    n, nbytes = len(headers), len(payload)
    store = DiskStore(root / "slots", n, nbytes, max_header_nbytes(BLOCK_TOKENS))
    try:
        start = time.perf_counter()
        for slot, header in enumerate(headers):
            store.write(slot, header, payload)
        if fsync:
            store.flush()
        write_s = time.perf_counter() - start
        drop_cache([store.path])
        resident = resident_fraction([store.path])
        out = np.empty(nbytes, dtype=np.uint8)
        start = time.perf_counter()
        for slot in order:
            got = store.read(slot, out)
            assert got.key == headers[slot].key
        read_s = time.perf_counter() - start
        last = headers[order[-1]]
        assert check(got, namespace=NAMESPACE, key=last.key, tokens=last.tokens,
                     payload=out) is None
    finally:
        store.close()
        shutil.rmtree(root / "slots")
    return {"write_s": write_s, "read_s": read_s, "resident_after_drop": resident}


def bench_files(root: Path, payload: np.ndarray, headers: list[BlockHeader], order: list[int],
                fsync: bool) -> dict[str, Any]:
    directory = root / "files"
    directory.mkdir(mode=0o700)
    paths = [directory / f"{h.key.hex()}.kvb" for h in headers]
    encoded = [encode_header(h) for h in headers]
    try:
        start = time.perf_counter()
        for path, head in zip(paths, encoded):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                write_all(fd, [head, payload])
            finally:
                os.close(fd)
        if fsync:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            dir_fd = os.open(directory, os.O_RDONLY)
            os.fsync(dir_fd)  # the new names, too
            os.close(dir_fd)
        write_s = time.perf_counter() - start
        drop_cache(paths)
        resident = resident_fraction(paths)
        out = np.empty(len(payload), dtype=np.uint8)
        head_buf = bytearray(len(encoded[0]))
        start = time.perf_counter()
        for i in order:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                got_bytes = os.readv(fd, [head_buf, out])
            finally:
                os.close(fd)
            got = decode_header(head_buf)
            assert got_bytes == len(head_buf) + got.payload_nbytes and got.key == headers[i].key
        read_s = time.perf_counter() - start
        last = headers[order[-1]]
        assert check(got, namespace=NAMESPACE, key=last.key, tokens=last.tokens,
                     payload=out) is None
    finally:
        shutil.rmtree(directory)
    return {"write_s": write_s, "read_s": read_s, "resident_after_drop": resident}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".", help="the disk to measure: a temp dir is made in it")
    ap.add_argument("--total-mib", type=int, default=512, help="bytes per layout and size")
    ap.add_argument("--block-bytes", default="737280,2097152")
    ap.add_argument("--fsync", action="store_true", help="fsync once at the end of writing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(x) for x in args.block_bytes.split(",")]
    rng = np.random.default_rng(args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvtier-disk-layout-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        for nbytes in sizes:
            n = max(1, args.total_mib * 2**20 // nbytes)
            payload = rng.integers(0, 256, nbytes, dtype=np.uint8)
            checksum = payload_checksum(payload)
            headers = [BlockHeader(NAMESPACE, i.to_bytes(8, "big"),
                                   tuple(range(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)),
                                   nbytes, checksum) for i in range(n)]
            order = list(range(n))
            random.Random(args.seed).shuffle(order)
            for layout, bench in (("slot file", bench_slots), ("file per block", bench_files)):
                r = bench(root, payload, headers, order, args.fsync)
                total = n * nbytes
                rows.append({"layout": layout, "block_bytes": nbytes, "blocks": n,
                             "bytes": total, "fsync": args.fsync, **r,
                             "write_gbps": total / r["write_s"] / 1e9,
                             "read_gbps": total / r["read_s"] / 1e9})
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"disk under {Path(args.dir).resolve()}; fsync={'on' if args.fsync else 'off'}; "
          f"reads shuffled, after dropping the files' pages from the page cache")
    print(f"{'layout':<15} {'block bytes':>11} {'blocks':>6} {'write GB/s':>10} "
          f"{'read GB/s':>9} {'cached':>6}")
    for r in rows:
        cached = r["resident_after_drop"]
        print(f"{r['layout']:<15} {r['block_bytes']:>11,} {r['blocks']:>6} "
              f"{r['write_gbps']:>10.2f} {r['read_gbps']:>9.2f} "
              f"{'n/a' if cached is None else f'{cached:.0%}':>6}")
    print("cached = share of the blocks' pages still in the page cache when reading began "
          "(read from RAM, not disk); n/a: could not be measured, and the page cache may "
          "still serve reads")
    if not args.fsync:
        print("write GB/s without --fsync is the page cache absorbing writes, not the disk")
    path = write_result("disk_layout", {"dir": str(Path(args.dir).resolve()),
                                        "fsync": args.fsync, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
