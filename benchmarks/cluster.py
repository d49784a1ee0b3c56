"""The remote tier on one redis-server against a Redis Cluster: fetch throughput, a failover
drill, and what a lost shard without replicas leaves of each prefix.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/cluster.py [--batches 40] [--out DIR]

Servers are started on loopback by this script (Debian's redis-server; `bash scripts/redis.sh
ensure` installs it), so every hop is a local TCP socket and the client, in one Python
process, is the bottleneck on 2 cores: the rows compare kvtier's client paths, not the
servers. Sections:

  fetch     64 blocks of SmolLM2-135M's size (737,280 B: 16 tokens x 30 layers x K,V x 3 heads
            x 64 x fp32) written once, then `--batches` batches of 16 random ones read back:
            GB/s (bytes over the calls' time), p50/p99 per batch, client CPU seconds per GB
            (of the calls; the check of every value after each call is left out). Rows:
            one server (RedisStore), 3 masters (ClusterStore), 3 masters + 3 replicas with
            replica reads; each as bytes (`get_many`, redis-py) and into host rows
            (`get_many_into`, each value a 140-byte header + the block, the block received
            straight into a preallocated row: what a fetch below host does).
  failover  3 masters + 3 replicas, 600 blocks of 16 KiB written and replicated; a reader
            fetches batches of 32 random keys back to back; one master is SIGKILLed. Blocks
            missed (answered unavailable), the window (kill -> last batch with a miss), blocks
            lost (absent after the promotion), longest batch (the stall), wrong bytes served
            (must be 0), and the promotion time; once without and once with replica reads.
  shard     3 masters, no replicas: 300 prefixes of 16 chained blocks, one master killed, the
            served prefix = the leading run of blocks still present (what kvtier serves), mean
            against the prediction sum_{k=1..16} (2/3)^k; and the same with hash tags per
            segment of 4 blocks (computed from the live slot map), against 4 x sum_{k=1..4}
            (2/3)^k.
JSON goes to benchmarks/results/cluster-*.json.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import write_result

from kvtier.tier.stores.redis.cluster_store import ClusterStore
from kvtier.tier.stores.redis.kv import Landed
from kvtier.tier.stores.redis.store import RedisStore
from kvtier.tier.stores.redis.unavailable import RemoteUnavailable

NS = b"b" * 16
BLOCK_BYTES = 737_280
HEADER_BYTES = 140  # a stored block's header for 16 tokens (block_format.py), about
FETCH_BLOCKS, FETCH_BATCH = 64, 16
DRILL_BLOCKS, DRILL_BYTES, DRILL_BATCH = 600, 16 << 10, 32
PREFIXES, PREFIX_BLOCKS, SEGMENT = 300, 16, 4


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fetch_row(name: str, store: Any, batches: int, into: bool) -> dict[str, Any]:
    items = [(os.urandom(16), os.urandom(HEADER_BYTES + BLOCK_BYTES))
             for _ in range(FETCH_BLOCKS)]
    assert all(e is None for e in store.put_many(items))
    want = dict(items)
    keys = list(want)
    rows = [memoryview(bytearray(BLOCK_BYTES)) for _ in range(FETCH_BATCH)]  # faulted in
    warm = keys[:FETCH_BATCH]  # warm-up: connections, first large replies
    store.get_many_into(warm, rows, HEADER_BYTES) if into else store.get_many(warm)
    rng = random.Random(0)
    lat: list[float] = []
    wrong, cpu = 0, 0.0
    for _ in range(batches):
        batch = rng.sample(keys, FETCH_BATCH)
        c, t = time.process_time(), time.perf_counter()
        got = store.get_many_into(batch, rows, HEADER_BYTES) if into else store.get_many(batch)
        lat.append(time.perf_counter() - t)
        cpu += time.process_time() - c
        if into:
            assert all(isinstance(v, Landed) for v in got), "a value did not land in its row"
            got = [v.header + bytes(row) for v, row in zip(got, rows)]  # checked, not timed
        wrong += sum(v != want[k] for k, v in zip(batch, got))
    gb = batches * FETCH_BATCH * BLOCK_BYTES / 1e9  # the checks after each call not timed
    return {"row": name, "gbps": gb / sum(lat), "p50_ms": percentile(lat, 0.5) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3, "cpu_s_per_gb": cpu / gb,
            "wrong_blocks": wrong}


def failover_drill(factory: Any, read_replicas: bool) -> dict[str, Any]:
    cluster = factory(masters=3, replicas=1)
    store = ClusterStore(cluster.url, NS, read_replicas=read_replicas)
    try:
        items = [(os.urandom(16), os.urandom(DRILL_BYTES)) for _ in range(DRILL_BLOCKS)]
        store.put_many(items)
        cluster.wait_ready()  # replicated
        cluster.wait_replicas_listed()
        store.check()
        want = dict(items)
        keys = list(want)
        dead = cluster.masters()[0]
        heir = cluster.replica_of(dead)
        stop = threading.Event()
        log: list[tuple[float, float, int, int]] = []  # start, seconds, unavailable, wrong

        def read() -> None:
            rng = random.Random(1)
            while not stop.is_set():
                batch = rng.sample(keys, DRILL_BATCH)
                t = time.monotonic()
                got = store.get_many(batch)
                log.append((t, time.monotonic() - t,
                            sum(isinstance(v, RemoteUnavailable) for v in got),
                            sum(isinstance(v, bytes) and v != want[k]
                                for k, v in zip(batch, got))))

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.5)
        killed = time.monotonic()
        cluster.kill(dead)
        promoted_s = cluster.wait_promoted(heir) if heir is not None else None
        time.sleep(2.0)
        stop.set()
        reader.join()
        after = store.get_many(keys)
    finally:
        store.close()
        cluster.close()
    during = [e for e in log if e[0] >= killed]
    missed = [e for e in during if e[2]]
    return {"row": "3+3, replica reads" if read_replicas else "3+3",
            "batches": len(during), "blocks_missed": sum(e[2] for e in during),
            "window_s": (missed[-1][0] + missed[-1][1] - killed) if missed else 0.0,
            "blocks_lost": sum(v is None or isinstance(v, RemoteUnavailable) for v in after),
            "longest_batch_s": max(e[1] for e in during),
            "wrong_blocks": sum(e[3] for e in log), "promoted_s": promoted_s}


def shard_loss(factory: Any) -> dict[str, Any]:
    cluster = factory(masters=3)
    store = ClusterStore(cluster.url, NS)
    try:
        prefixes = [[os.urandom(16) for _ in range(PREFIX_BLOCKS)] for _ in range(PREFIXES)]
        store.put_many([(k, b"x" * 64) for p in prefixes for k in p])
        dead = cluster.masters()[0]
        alive = 1 - sum(hi - lo + 1 for lo, hi in cluster.slot_ranges(dead)) / 16384
        # Tagged variant: every block of a segment carries its first block's key as hash tag,
        # so the segment lives (or dies) with that key's slot.
        segment_alive = [[cluster.owner(b"{" + store.key(p[j]) + b"}") is not dead
                          for j in range(0, PREFIX_BLOCKS, SEGMENT)] for p in prefixes]
        cluster.kill(dead)
        served = [leading(store.exists_many(p)) for p in prefixes]
    finally:
        store.close()
        cluster.close()
    tagged = [min(PREFIX_BLOCKS, SEGMENT * leading(a)) for a in segment_alive]
    return {"alive_fraction": alive,
            "mean_served": statistics.mean(served),
            "predicted": sum(alive**k for k in range(1, PREFIX_BLOCKS + 1)),
            "mean_served_tagged": statistics.mean(tagged),
            "predicted_tagged": SEGMENT * sum(alive**k
                                              for k in range(1, PREFIX_BLOCKS // SEGMENT + 1)),
            "whole_prefixes": sum(r == PREFIX_BLOCKS for r in served) / len(served)}


def leading(flags: list[Any]) -> int:
    run = 0
    while run < len(flags) and flags[run]:
        run += 1
    return run


INTO = {False: ", bytes", True: ", into rows"}


def fetch_rows(factory: Any, server_factory: Any, batches: int) -> list[dict[str, Any]]:
    rows = []
    server = server_factory()
    try:
        store = RedisStore(server.url, NS)
        for into in (False, True):
            rows.append(fetch_row("one redis-server" + INTO[into], store, batches, into))
        store.close()
    finally:
        server.close()
    for masters, replicas in ((3, 0), (3, 1)):
        cluster = factory(masters=masters, replicas=replicas)
        try:
            if replicas:  # replicas serve reads once they hold data and are listed
                seed = ClusterStore(cluster.url, NS)
                seed.put_many([(os.urandom(16), b"x") for _ in range(64)])
                seed.close()
                cluster.wait_ready()
                cluster.wait_replicas_listed()
            store = ClusterStore(cluster.url, NS, read_replicas=bool(replicas))
            name = f"cluster {masters}" + (f"+{masters}, replica reads" if replicas else "")
            for into in (False, True):
                rows.append(fetch_row(name + INTO[into], store, batches, into))
            store.close()
        finally:
            cluster.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40, help="fetch batches per row")
    ap.add_argument("--out", default=None, help="directory of the JSON result")
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH: `bash scripts/redis.sh ensure` installs it")
    from redis_cluster import LocalCluster
    from redis_server import RedisServer

    def factory(**kw: Any) -> LocalCluster:
        cluster = LocalCluster(binary, **kw)
        cluster.start()
        return cluster

    def server_factory() -> RedisServer:
        server = RedisServer(binary)
        server.start()
        return server

    rows = fetch_rows(factory, server_factory, args.batches)
    print(f"fetch ({FETCH_BATCH} blocks of {BLOCK_BYTES:,} B a batch, {args.batches} batches; "
          "client-bound: one Python process, 2 cores)")
    print(f"{'store':<44}{'GB/s':>7}{'p50 ms':>9}{'p99 ms':>9}{'CPU s/GB':>10}{'wrong':>7}")
    for r in rows:
        print(f"{r['row']:<44}{r['gbps']:>7.2f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
              f"{r['cpu_s_per_gb']:>10.2f}{r['wrong_blocks']:>7}")
    drills = [failover_drill(factory, False), failover_drill(factory, True)]
    print(f"\nfailover drill ({DRILL_BLOCKS} blocks of {DRILL_BYTES >> 10} KiB, batches of "
          f"{DRILL_BATCH}, one master SIGKILLed)")
    print(f"{'cluster':<22}{'batches':>8}{'missed':>8}{'window s':>10}{'lost':>6}"
          f"{'longest s':>11}{'wrong':>7}{'promoted s':>12}")
    for d in drills:
        print(f"{d['row']:<22}{d['batches']:>8}{d['blocks_missed']:>8}{d['window_s']:>10.2f}"
              f"{d['blocks_lost']:>6}{d['longest_batch_s']:>11.3f}{d['wrong_blocks']:>7}"
              f"{d['promoted_s'] or 0:>12.2f}")
    shard = shard_loss(factory)
    print(f"\nshard lost, no replica ({PREFIXES} prefixes of {PREFIX_BLOCKS} blocks, "
          f"{shard['alive_fraction']:.3f} of the slots alive)")
    print(f"  per-block keys:             mean served {shard['mean_served']:.2f} blocks "
          f"(predicted {shard['predicted']:.2f}); whole prefixes "
          f"{shard['whole_prefixes']:.1%}")
    print(f"  hash tag per {SEGMENT} blocks:     mean served {shard['mean_served_tagged']:.2f} "
          f"blocks (predicted {shard['predicted_tagged']:.2f})")
    path = write_result("cluster", {"fetch": rows, "failover": drills, "shard_loss": shard,
                                    "block_bytes": BLOCK_BYTES}, args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
