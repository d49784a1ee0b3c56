"""Loopback ports for the servers tests start (Redis, Valkey, vLLM): picked where no client
socket can take one between the pick and the server's bind."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
_handed: set[int] = set()  # this process's picks: a stopped server may start on it again


def ephemeral_low() -> int:
    """Where the kernel's range for clients' source ports starts (Linux's default where
    unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nobody listens on, picked below the ephemeral range: one picked by
    bind(0) lies inside it, where any client connection may take it as its source port
    before the server binds it (seen: a cluster node's bus port taken by a sibling's link)."""
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(1000 if low > LOWEST_PORT + 1000 else 0):
        port = rng.randrange(LOWEST_PORT, low)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
