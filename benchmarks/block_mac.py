"""What authenticating remote blocks costs: each MAC candidate's GB/s on one KV block, and the
remote tier's real fetch path (Redis MGET, unpack, verify, copy into host rows) with and
without a secret.

    .venv/bin/python benchmarks/block_mac.py [--rounds 15] [--blocks 16] [--out DIR]

Block: vLLM's SmolLM2-135M float32 block of 128 tokens (30 layers x 3 KV heads x 128 x 2 x 64
x 4 bytes = 5.9 MB). Candidates, each over that block from memory, median of 7 timings:
xxh3_64 (the payload checksum every block already has), keyed BLAKE3 (one thread and
max_threads=AUTO), HMAC-SHA256, keyed blake2b, AES-GMAC (AES-GCM with the payload as its
associated data; needs the `cryptography` package, and a unique nonce per block).
Verify: `--blocks` packed blocks (16: a 2048-token prefix, 94 MB) unpacked and checked in
memory by `block_format.check` as the I/O thread does, without and with a secret (the MAC
replaces the xxh3 pass): the CPU cost alone.
Fetch path: a redis-server this script starts on a free loopback port; the same blocks
written once through the tier's own worker (build_worker_side), once per instance (without
and with a secret), then fetched `--rounds` times into other host rows by one job, the two
instances alternating round by round so a shared machine's drift hits both: p50 of
submit -> result. The host tensor copy peak of this machine is printed beside it. JSON goes
to benchmarks/results/block_mac-*.json.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from blake3 import blake3

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_peak_gbps, write_result
from local_redis import LocalRedis

from kvtier.tier import GIB, Job, KVLayout, Medium, Result, TierConfig, build_worker_side
from kvtier.tier.io.block_format import BlockHeader, check, pack, payload_checksum, unpack
from kvtier.tier.io.block_mac import BlockMac
from kvtier.tier.worker import TierWorker

LAYERS, HEADS, TOKENS, DIM = 30, 3, 128, 64  # SmolLM2-135M under vLLM, 128-token blocks
BLOCK_NBYTES = LAYERS * HEADS * TOKENS * 2 * DIM * 4
TIMINGS = 7


def median_seconds(fn: Callable[[], object], repeats: int = TIMINGS) -> float:
    fn()  # warm: first-touch, lazy initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def candidates(block: bytes) -> list[dict[str, Any]]:
    """Each MAC candidate's GB/s over `block` (a row without a measure says why)."""
    key = os.urandom(32)
    rows: list[tuple[str, Callable[[], object] | None, str]] = [
        ("xxh3_64 (checksum, no key)", lambda: xxhash.xxh3_64_intdigest(block), ""),
        ("BLAKE3 keyed, 1 thread", lambda: blake3(block, key=key).digest(), ""),
        ("BLAKE3 keyed, max_threads=AUTO",
         lambda: blake3(block, key=key, max_threads=blake3.AUTO).digest(), ""),
        ("HMAC-SHA256", lambda: hmac.digest(key, block, "sha256"), ""),
        ("blake2b keyed", lambda: hashlib.blake2b(block, key=key).digest(), ""),
    ]
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        rows.append(("AES-GMAC (nonce per block)", None, "the cryptography package is not "
                     "installed (pip install cryptography)"))
    else:
        gcm, nonce = AESGCM(key), os.urandom(12)
        rows.append(("AES-GMAC (nonce per block)",
                     lambda: gcm.encrypt(nonce, b"", block), ""))
    out = []
    for name, fn, why in rows:
        if fn is None:
            out.append({"mac": name, "gbps": None, "ms_per_gb": None, "note": why})
            continue
        seconds = median_seconds(fn)
        out.append({"mac": name, "gbps": len(block) / seconds / 1e9,
                    "ms_per_gb": seconds / len(block) * 1e9 * 1e3, "note": why})
    return out


@contextmanager
def redis_server() -> Iterator[str | None]:
    """A redis-server child on a free loopback port, with its allocator's defaults (as the
    docs/host-tier.md's rows were measured); None if none."""
    redis = LocalRedis(malloc_conf="")
    if redis.server is None:
        print(f"fetch rows skipped: {redis.reason}")
    try:
        yield redis.url
    finally:
        redis.close()


def run(w: TierWorker, job: Job) -> Result:
    w.submit(job)
    assert w.io is not None
    while True:
        for r in w.io.wait_any(timeout=5.0):
            if r.job_id == job.id:
                return r


def verify_cost(n: int) -> list[dict[str, Any]]:
    """Seconds to unpack and check `n` packed blocks in memory, without and with a MAC."""
    mac = BlockMac.from_secret(os.urandom(32))
    namespace, payload = os.urandom(16), os.urandom(BLOCK_NBYTES)
    out = []
    for signer in (None, mac):
        blobs = []
        for i in range(n):
            header = BlockHeader(namespace, i.to_bytes(16, "big"), tuple(range(TOKENS)),
                                 BLOCK_NBYTES, payload_checksum(payload))
            blobs.append(pack(header, payload, signer))

        def verify_all(blobs: list[bytes] = blobs, signer: BlockMac | None = signer) -> None:
            for i, blob in enumerate(blobs):
                header, view = unpack(blob)
                assert check(header, namespace=namespace, key=i.to_bytes(16, "big"),
                             tokens=range(TOKENS), payload=view, mac=signer) is None

        seconds = median_seconds(verify_all)
        out.append({"secret": signer is not None, "blocks": n, "bytes": n * BLOCK_NBYTES,
                    "p50_s": seconds, "gbps": n * BLOCK_NBYTES / seconds / 1e9})
    return out


class Instance:
    """One tier worker over Redis (with or without a secret) holding `n` written blocks."""

    def __init__(self, url: str, n: int, secret: str | None) -> None:
        config = TierConfig.of(kv_offloading_size=2 * n * BLOCK_NBYTES / GIB, remote_kv_url=url,
                            remote_kv_secret=secret, remote_kv_read_gbps=1.0)
        config.validate()
        # kv: [num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]
        layout = KVLayout.from_contiguous(torch.zeros(1, LAYERS, TOKENS, 2, HEADS, DIM))
        self.n, self.secret = n, secret is not None
        self.w = build_worker_side(config, layout, os.urandom(16), TOKENS)
        self.keys = tuple(os.urandom(16) for _ in range(n))
        self.tokens = tuple(tuple(range(i * TOKENS, (i + 1) * TOKENS)) for i in range(n))
        self.walls: list[float] = []
        self.io: list[float] = []
        self._ids = 0
        self.w.host.tensor[:n].normal_()
        wrote = self._run(Medium.HOST, Medium.REDIS, range(n))
        assert wrote.success, wrote.reasons

    def _run(self, src: Medium, dst: Medium, slots: range) -> Result:
        self._ids += 1
        job = Job(self._ids, src, dst, tuple(slots), keys=self.keys, tokens=self.tokens,
                  media=(Medium.REDIS,) * self.n, below_slots=(-1,) * self.n)
        self.w.submit(job)
        assert self.w.io is not None
        while True:
            for r in self.w.io.wait_any(timeout=5.0):
                if r.job_id == job.id:
                    return r

    def fetch(self, record: bool = True) -> None:
        """One fetch of every block into the other half of the host rows, verified."""
        start = time.perf_counter()
        got = self._run(Medium.REDIS, Medium.HOST, range(self.n, 2 * self.n))
        wall = time.perf_counter() - start
        assert got.success, got.reasons
        if record:
            self.walls.append(wall)
            self.io.append(got.seconds)

    def summary(self) -> dict[str, Any]:
        assert torch.equal(self.w.host.tensor[self.n:], self.w.host.tensor[:self.n])
        nbytes = self.n * BLOCK_NBYTES
        wall = statistics.median(self.walls)
        return {"secret": self.secret, "blocks": self.n, "bytes": nbytes,
                "rounds": len(self.walls), "p50_s": wall, "p50_io_s": statistics.median(self.io),
                "gbps": nbytes / wall / 1e9, "samples_s": self.walls}

    def close(self) -> None:
        self.w.close()


def fetch_path(url: str, n: int, rounds: int) -> list[dict[str, Any]]:
    """p50 of one job fetching `n` blocks from Redis, without then with a secret."""
    instances = [Instance(url, n, None), Instance(url, n, os.urandom(24).hex())]
    try:
        for inst in instances:
            inst.fetch(record=False)  # warm: connections, page faults
        for _ in range(rounds):
            for inst in instances:
                inst.fetch()
        return [inst.summary() for inst in instances]
    finally:
        for inst in instances:
            inst.close()


def report(macs: list[dict[str, Any]], verify: list[dict[str, Any]],
           fetch: list[dict[str, Any]], peak: float) -> None:
    print(f"one block = {BLOCK_NBYTES / 1e6:.2f} MB; host tensor copy peak {peak:.1f} GB/s")
    print(f"{'candidate':34s} {'GB/s':>7s} {'ms/GB':>7s}")
    for row in macs:
        if row["gbps"] is None:
            print(f"{row['mac']:34s} {'-':>7s} {'-':>7s}  {row['note']}")
        else:
            print(f"{row['mac']:34s} {row['gbps']:7.2f} {row['ms_per_gb']:7.1f}")
    print()
    print(f"{'verify in memory (unpack + check)':34s} {'p50 ms':>7s} {'GB/s':>7s}")
    for row in verify:
        print(f"{label(row):34s} {row['p50_s'] * 1e3:7.1f} {row['gbps']:7.2f}")
    print(f"MAC cost of verifying: {difference(verify)}")
    if not fetch:
        return
    print()
    print(f"{'Redis fetch + verify':34s} {'p50 ms':>7s} {'GB/s':>7s} {'io ms':>7s}")
    for row in fetch:
        print(f"{label(row):34s} {row['p50_s'] * 1e3:7.1f} {row['gbps']:7.2f} "
              f"{row['p50_io_s'] * 1e3:7.1f}")
    print(f"MAC cost on the fetch path: {difference(fetch)}")


def label(row: dict[str, Any]) -> str:
    return (f"{row['blocks']} blocks ({row['bytes'] / 1e6:.1f} MB), "
            f"{'secret' if row['secret'] else 'no secret'}")


def difference(rows: list[dict[str, Any]]) -> str:
    base, mac = rows
    return (f"{(mac['p50_s'] - base['p50_s']) * 1e3:+.1f} ms "
            f"({mac['p50_s'] / base['p50_s'] - 1:+.0%}) for {base['bytes'] / 1e6:.1f} MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per fetch (16 = 2048 tokens)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.blocks < 1:
        ap.error("--rounds and --blocks must be >= 1")
    macs = candidates(os.urandom(BLOCK_NBYTES))
    peak = copy_peak_gbps()
    verify = verify_cost(args.blocks)
    fetch: list[dict[str, Any]] = []
    with redis_server() as url:
        if url is not None:
            fetch = fetch_path(url, args.blocks, args.rounds)
    report(macs, verify, fetch, peak)
    path = write_result("block_mac", {"block_nbytes": BLOCK_NBYTES, "candidates": macs,
                                      "verify": verify, "fetch": fetch, "host_copy_gbps": peak,
                                      "torch_threads": torch.get_num_threads()}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
