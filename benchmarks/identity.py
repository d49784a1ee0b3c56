"""Start-up cost of identifying a model by every byte of its weights (issue 18): each candidate
hash's GB/s over memory beside the copy peak, then the identity of the embedded model (our
engine's GGUF, and the same model exported for vLLM, through `weights_identity`) and of a
synthetic multi-GB safetensors file, with a cold and a warm digest cache.

"page warm" rows read the file from the page cache (it was just read or written), so they
measure the hash, not the disk; "page cold" rows first drop the file's pages (fsync, then
posix_fadvise DONTNEED) and measure the read from disk too. "cache warm" is the digest
cache serving an unchanged file (a few stat calls and a small JSON read).

    python benchmarks/identity.py [--gib 2] [--buffer-mib 256] [--repeats 3] [--dir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_peak_gbps, write_result

from kvtier.integrations.kit.identity import weights_identity
from kvtier.model import digest
from kvtier.model.loaded import weights_digest
from kvtier.model.loader import default_model_path, load_model

CHUNK = digest.CHUNK
PATTERN_MIB = 64  # the synthetic payload repeats one random block of this size
SPARE_BYTES = 1 << 30  # free space left over after the synthetic file, or the run refuses


def hash_candidates() -> dict[str, Callable[[], Any]]:
    """Each candidate's constructor; BLAKE3 only where its package is installed."""
    out: dict[str, Callable[[], Any]] = {
        "xxh3_128": xxhash.xxh3_128,
        "xxh3_64": xxhash.xxh3_64,
        "blake2b-128": lambda: hashlib.blake2b(digest_size=16),
        "sha256": hashlib.sha256,
    }
    try:
        import blake3  # not a dependency of kvtier: measured when present
    except ImportError:
        return out
    out["blake3"] = blake3.blake3
    out["blake3-threads"] = lambda: blake3.blake3(max_threads=blake3.blake3.AUTO)
    return out


def hash_gbps(make: Callable[[], Any], buf: memoryview, repeats: int) -> float:
    """Best-of-N bytes hashed per second, fed in the reader's chunk size."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        h = make()
        for off in range(0, len(buf), CHUNK):
            h.update(buf[off:off + CHUNK])
        h.digest()
        best = min(best, time.perf_counter() - t)
    return len(buf) / best / 1e9


def drop_pages(files: list[Path]) -> None:
    """Evict these files' clean pages from the page cache (only theirs)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_pages(files: list[Path]) -> None:
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.read(CHUNK):
                pass


def settle(files: list[Path]) -> None:
    """Wait until the files are older than the digest cache's racy window (so it keeps them)."""
    newest = max(max(f.stat().st_mtime_ns, f.stat().st_ctime_ns) for f in files)
    wait_ns = newest + digest.RACY_NS - time.time_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9 + 0.01)


def timed(fn: Callable[[], str], cache_dir: Path) -> tuple[float, str]:
    os.environ["KVTIER_CACHE_DIR"] = str(cache_dir)
    t = time.perf_counter()
    value = fn()
    return time.perf_counter() - t, value


def measure(name: str, fn: Callable[[], str], files: list[Path], scratch: Path,
            repeats: int, page_cold: bool) -> dict[str, Any]:
    """Identity `fn` of `files`: cold cache (page warm; then page cold if asked), warm cache."""
    settle(files)
    warm_pages(files)
    cold = []
    for i in range(repeats):  # a fresh, empty digest cache each time
        seconds, value = timed(fn, scratch / f"{name}-cold-{i}")
        cold.append(seconds)
    cache = scratch / f"{name}-cold-0"
    warm = [timed(fn, cache)[0] for _ in range(repeats)]
    assert timed(fn, cache)[1] == value, "the cache served another identity"
    nbytes = sum(f.stat().st_size for f in files)
    row: dict[str, Any] = {"name": name, "bytes": nbytes, "identity": value,
                           "cold_cache_page_warm_s": statistics.median(cold),
                           "warm_cache_s": statistics.median(warm)}
    if page_cold:
        drop_pages(files)
        row["cold_cache_page_cold_s"] = timed(fn, scratch / f"{name}-page-cold")[0]
    return row


def synthetic_model(directory: Path, gib: float) -> list[Path]:
    """config.json and one safetensors file of `gib` GiB of float32 (a header, then payload)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    total = int(gib * (1 << 30)) // (PATTERN_MIB << 20) * (PATTERN_MIB << 20)
    tensors, offset, i = {}, 0, 0
    while offset < total:  # 1 GiB tensors, as a large model's shard holds a few
        n = min(1 << 30, total - offset)
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = {
            "dtype": "F32", "shape": [n // 4 // 4096, 4096], "data_offsets": [offset, offset + n]}
        offset, i = offset + n, i + 1
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    pattern = os.urandom(PATTERN_MIB << 20)
    file = directory / "model.safetensors"
    with file.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for _ in range(total // len(pattern)):
            f.write(pattern)
    return [directory / "config.json", file]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="size of the synthetic safetensors")
    ap.add_argument("--buffer-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the synthetic model is written")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    parent = Path(args.dir or tempfile.gettempdir())
    free = shutil.disk_usage(parent).free
    need = int(args.gib * (1 << 30)) + SPARE_BYTES
    if free < need:
        print(f"refusing: the synthetic model needs {need / 2**30:.1f} GiB free under {parent} "
              f"(with 1 GiB to spare) and {free / 2**30:.1f} GiB are; pass --gib "
              f"{max(0.0, (free - SPARE_BYTES) / 2**30):.1f} or --dir elsewhere",
              file=sys.stderr)
        return 2

    buf = memoryview(os.urandom(args.buffer_mib << 20))
    copy_peak = copy_peak_gbps()
    hashes = {name: hash_gbps(make, buf, args.repeats) for name, make in hash_candidates().items()}

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-identity-", dir=parent) as tmp:
        scratch = Path(tmp)
        gguf = default_model_path()
        rows.append(measure("gguf (engine)", lambda: weights_digest([gguf]), [gguf],
                            scratch / "c", args.repeats, page_cold=True))
        from kvtier.model.export import export_hf

        hf = export_hf(load_model(None), scratch / "smollm2-hf")  # `kvtier export-hf`: bf16
        files = [hf / "config.json", *sorted(hf.glob("*.safetensors"))]
        rows.append(measure("hf bf16 (vLLM)", lambda: weights_identity(str(hf)), files,
                            scratch / "c", args.repeats, page_cold=True))
        synth = synthetic_model(scratch / "synthetic", args.gib)
        rows.append(measure(f"synthetic {args.gib:g} GiB", lambda: weights_identity(
            str(synth[0].parent)), synth, scratch / "c", max(1, args.repeats - 1),
            page_cold=True))

    print(f"hash GB/s over {args.buffer_mib} MiB in memory, {CHUNK >> 20} MiB updates, best of "
          f"{args.repeats} (memory copy peak {copy_peak:.1f} GB/s):")
    for name, gbps in sorted(hashes.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<15} {gbps:>6.2f} GB/s")
    if "blake3" not in hashes:
        print("  blake3          not installed (pip install blake3 to compare)")
    print(f"{'identity of':<20} {'GB':>6} {'cache cold':>11} {'(page cold)':>11} "
          f"{'cache warm':>11} {'s/GB cold':>9} {'GB/s':>6}")
    for r in rows:
        gb = r["bytes"] / 1e9
        cold, warm = r["cold_cache_page_warm_s"], r["warm_cache_s"]
        page_cold = r.get("cold_cache_page_cold_s")
        r["cold_s_per_gb"] = cold / gb
        r["cold_page_cold_s_per_gb"] = page_cold / gb if page_cold else None
        print(f"{r['name']:<20} {gb:>6.3f} {cold * 1e3:>9.1f}ms "
              f"{'' if page_cold is None else f'{page_cold * 1e3:.1f}ms':>11} "
              f"{warm * 1e3:>9.2f}ms {cold / gb:>9.3f} {gb / cold:>6.2f}")
    synth_row = rows[-1]
    print(f"per GB (synthetic): {synth_row['cold_s_per_gb']:.3f} s cold cache, page warm; "
          f"{synth_row['cold_page_cold_s_per_gb']:.3f} s from disk; warm cache "
          f"{synth_row['warm_cache_s'] * 1e3:.2f} ms whatever the size")
    path = write_result("identity", {"copy_peak_gbps": copy_peak, "hash_gbps": hashes,
                                     "chunk_bytes": CHUNK, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
