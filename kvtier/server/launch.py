"""Start `kvtier serve` as a child process on a free loopback port (tests, load benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from kvtier.errors import KvtierError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(*args: str, startup_s: float = 120.0, env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen[str], str]:
    """(process, base url) once /health answers; KvtierError with the server's output if it
    does not come up within `startup_s`. `env`: added to this process's environment."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise KvtierError(f"kvtier serve did not start: {proc.communicate()[0][-2000:]}")
