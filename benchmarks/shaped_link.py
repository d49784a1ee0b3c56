"""Run a benchmark behind a real slow link: a network namespace of its own whose loopback is
shaped by `tc` to a NIC's rate, so Redis/Valkey (and everything else the command starts on
127.0.0.1) is reached at 1, 2.5 or 10 Gbit/s instead of memory speed. Nothing but loopback
exists inside; the namespace is removed when the command ends.

    sudo-less as root:  python benchmarks/shaped_link.py --rate 1gbit -- \\
        .venv/bin/python benchmarks/at_load.py --configs vllm,kvtier-redis,...

Prints the rate it measured through the shaped loopback before the command runs (and puts
it in the environment as KVTIER_SHAPED_LINK for the command's JSON).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

BURST = "256kb"  # tc's bucket: a few packets' worth, so the rate holds over milliseconds
LATENCY = "50ms"  # how long a packet may queue before tc drops it


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def measured_gbps(nbytes: int = 64 << 20) -> float:
    """Bytes through one loopback TCP connection over their seconds, in Gbit/s (run inside)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain() -> None:
        conn, _ = server.accept()
        while conn.recv(1 << 20):
            pass
        conn.close()

    t = threading.Thread(target=drain)
    t.start()
    chunk = b"\0" * (1 << 20)
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(nbytes // len(chunk)):
            c.sendall(chunk)
    t.join()
    server.close()
    return nbytes * 8 / (time.perf_counter() - began) / 1e9


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":  # inside the namespace
        print(f"{measured_gbps():.3f}")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="tc's rate: 1gbit, 2500mbit, 10gbit")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("give the command to run after --")
    if os.geteuid() != 0:
        raise SystemExit("shaping a loopback needs root (ip netns, tc)")
    name = f"kvtier-shaped-{os.getpid()}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
           "rate", args.rate, "burst", BURST, "latency", LATENCY)
        got = subprocess.run(["ip", "netns", "exec", name, sys.executable, __file__,
                              "--measure"], check=True, capture_output=True, text=True)
        gbps = float(got.stdout.strip())
        print(f"shaped link: loopback in netns {name} at tc rate {args.rate}, measured "
              f"{gbps:.2f} Gbit/s ({gbps / 8:.3f} GB/s)", flush=True)
        env = {**os.environ, "KVTIER_SHAPED_LINK": f"{args.rate} ({gbps:.2f} Gbit/s measured)"}
        return subprocess.run(["ip", "netns", "exec", name, *command], env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


if __name__ == "__main__":
    sys.exit(main())
