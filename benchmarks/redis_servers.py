"""Redis 7 against Valkey 9 for the values a wake fetches: 16 x 6 MiB blocks, pipelined GET
against MGET, one and two I/O threads; GB/s at the client and server CPU seconds per GB.

Why: a Redis wake under vLLM stayed near 2x vLLM's own prefix hit, and the server's CPU was
where the time went. Redis 7 copies every large value into the client's reply buffer; Valkey 9
writes it from the stored object (valkey PR #2078). Both are read the way kvtier reads them:
kvtier's own RESP reader receiving each value straight into its host row.

    python benchmarks/redis_servers.py [--rounds 8] [--blocks 16] [--mib 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from common import write_result
from local_redis import SERVER_MALLOC_CONF, SERVERS, LocalRedis

from kvtier.tier.stores.redis.direct import DirectReader

HEADER_NBYTES = 64  # what precedes a block's payload in its value (kvtier's header is ~50 B)
MODES = ("mget", "get")  # one MGET of every key; one pipelined GET per key


@dataclass(frozen=True)
class Row:
    """One server, I/O thread count and command: rates over the rounds, CPU per GB."""

    server: str
    version: str
    io_threads: int
    mode: str
    gbps_p50: float
    gbps_best: float
    server_cpu_s_per_gb: float
    client_cpu_s_per_gb: float
    exact: bool


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` and all its threads so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_args(server: str, io_threads: int) -> tuple[str, ...]:
    """Options for `io_threads` I/O threads (Redis 7 also needs them told to read)."""
    args: tuple[str, ...] = ("--io-threads", str(io_threads))
    if server == "redis" and io_threads > 1:
        args += ("--io-threads-do-reads", "yes")
    return args


def measure(server: str, io_threads: int, blocks: int, row_nbytes: int, rounds: int,
            malloc_conf: str) -> list[Row] | str:
    """Rows for both modes on one fresh server, or why it could not run."""
    local = LocalRedis(malloc_conf, server=server, args=server_args(server, io_threads))
    if local.server is None:
        return local.reason
    try:
        client = local.server.client(timeout_s=30)
        version = str(client.info("server").get(f"{server}_version")
                      or client.info("server").get("redis_version"))
        keys = [f"kvtier:bench:{i}".encode() for i in range(blocks)]
        values = [bytes([i]) * HEADER_NBYTES + os.urandom(row_nbytes) for i in range(blocks)]
        pipe = client.pipeline(transaction=False)
        for key, value in zip(keys, values):
            pipe.set(key, value)
        pipe.execute()
        client.close()
        reader = DirectReader.for_url(local.url or "", timeout_s=30)
        rows = [memoryview(bytearray(row_nbytes)) for _ in range(blocks)]
        exact = {mode: _fetch(reader, mode, keys, rows) == values for mode in MODES}  # + warm
        samples: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        pid = local.pid
        assert pid is not None
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:  # neither always goes first
                cpu0, own0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
                _fetch(reader, mode, keys, rows)
                wall = time.perf_counter() - t0
                samples[mode].append((wall, cpu_seconds(pid) - cpu0, time.process_time() - own0))
        reader.close()
    finally:
        local.close()
    gb = blocks * (row_nbytes + HEADER_NBYTES) / 1e9
    out = []
    for mode, runs in samples.items():
        rates = [gb / wall for wall, _, _ in runs]
        out.append(Row(server, version, io_threads, mode, statistics.median(rates), max(rates),
                       sum(s for _, s, _ in runs) / (gb * len(runs)),
                       sum(c for _, _, c in runs) / (gb * len(runs)), exact[mode]))
    return out


def _fetch(reader: DirectReader, mode: str, keys: list[bytes], rows: list[memoryview]
           ) -> list[bytes]:
    """Every key's value (its header, then the row it landed in), by `mode`."""
    if mode == "mget":
        got: list[Any] = reader.mget_into(keys, rows, HEADER_NBYTES)
    else:
        got = reader.get_each_into(keys, rows, HEADER_NBYTES)
    return [value.header + bytes(row) for value, row in zip(got, rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="fetches per mode and server")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--mib", type=float, default=6.0, help="MiB per value's payload")
    ap.add_argument("--io-threads", default="1,2")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--redis-malloc-conf", default=SERVER_MALLOC_CONF,
                    help="Redis's allocator setting (docs/host-tier.md; '' for jemalloc's "
                         "defaults)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = [int(t) for t in args.io_threads.split(",")]
    servers = args.servers.split(",")
    for server in servers:
        if server not in SERVERS:
            ap.error(f"--servers: {server!r} is not one of {', '.join(SERVERS)}")
    row_nbytes = int(args.mib * (1 << 20))
    rows: list[Row] = []
    missing: dict[str, str] = {}
    for server in servers:
        for n in threads:
            got = measure(server, n, args.blocks, row_nbytes, args.rounds,
                          args.redis_malloc_conf)
            if isinstance(got, str):
                missing[server] = got
                break
            rows.extend(got)
    print(f"{args.blocks} values of {args.mib:g} MiB, {args.rounds} fetches each; "
          f"{os.cpu_count()} cores shared by client and server")
    print(f"{'server':<8} {'version':<8} {'io thr':>6} {'cmd':<5} {'GB/s p50':>8} "
          f"{'best':>6} {'srv CPU s/GB':>12} {'cli CPU s/GB':>12} exact")
    for r in rows:
        print(f"{r.server:<8} {r.version:<8} {r.io_threads:>6} {r.mode:<5} {r.gbps_p50:>8.2f} "
              f"{r.gbps_best:>6.2f} {r.server_cpu_s_per_gb:>12.3f} "
              f"{r.client_cpu_s_per_gb:>12.3f} {r.exact}")
    for server, reason in missing.items():
        print(f"{server}: not run ({reason})")
    path = write_result("redis_servers", {
        "blocks": args.blocks, "value_mib": args.mib, "rounds": args.rounds,
        "redis_malloc_conf": args.redis_malloc_conf, "rows": [asdict(r) for r in rows],
        "not_run": missing}, args.out)
    print(f"wrote {path}")
    if not all(r.exact for r in rows):
        raise SystemExit("a fetched value differed from what was stored")


if __name__ == "__main__":
    main()
