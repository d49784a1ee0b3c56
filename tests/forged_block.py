"""What whoever can write a shared Redis can do without kvtier's secret: rewrite a stored
block with its payload rescaled and every checksum recomputed (block_format's own functions),
so only a MAC can tell. Shared by the MAC tests (unit, Redis, real vLLM)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import redis

from kvtier.tier.io.block_format import pack, payload_checksum, unpack


def forge(blob: bytes, scale: float = 1.5, keep_mac: bool = True) -> bytes:
    """`blob` with its float32 payload times `scale`, the payload and header checksums
    recomputed; its MAC left as it was (`keep_mac`) or dropped (no secret to make one)."""
    header, payload = unpack(blob)
    data = (np.frombuffer(payload, dtype=np.float32) * np.float32(scale)).tobytes()
    assert data != bytes(payload), "a rescale that changes nothing forges nothing"
    forged = replace(header, checksum=payload_checksum(data),
                     mac=header.mac if keep_mac else b"")
    return pack(forged, data)


def forge_all(client: redis.Redis, pattern: bytes = b"kvtier:*", scale: float = 1.5) -> int:
    """Forge every kvtier block value on the server; how many were rewritten."""
    count = 0
    for name in client.scan_iter(match=pattern):
        blob = client.get(name)
        assert blob is not None
        client.set(name, forge(blob, scale))
        count += 1
    return count
