"""LMCache 0.5.6 as vLLM CPU's host tier, the peer a benchmark runs kvtier beside: its
multi-process server on loopback (`lmcache_driven`: the server copies from vLLM's pool in a
shared-memory segment, LMCache's fastest CPU path) and the `kv_transfer_config` that points
vLLM's `LMCacheMPConnector` at it (../shared/notes/lmcache-on-vllm-cpu.md). Its log is the
proof a run needs: a run whose server retrieved nothing is void, not a result.
Needs bash scripts/lmcache_env.sh."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
QUIET = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
STORED = re.compile(r"Stored (\d+) tokens")
RETRIEVED = re.compile(r"Retrieved (\d+) tokens")
SHM = Path("/dev/shm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LmcacheServer:
    """LMCache's cache server with an L1 of `host_gib` (kvtier's `kv_offloading_size`),
    LRU, chunks of `chunk_tokens` (vLLM's block size: whole chunks only are stored).
    `start()` waits for it; `close()` stops it and removes the shared-memory segments
    vLLM's worker left (a SIGTERM'd `vllm serve` does not unlink its pool's segment)."""

    START_S = 120.0

    def __init__(self, log_path: Path, host_gib: float, chunk_tokens: int = 128) -> None:
        self.port = _free_port()
        self.log_path = log_path
        self.args = [str(LMCACHE_PYTHON), "-m", "lmcache.v1.multiprocess.server",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--chunk-size", str(chunk_tokens), "--l1-size-gb", str(host_gib),
                     "--no-l1-use-lazy", "--eviction-policy", "LRU",
                     "--supported-transfer-mode", "auto",
                     "--prometheus-port", str(_free_port())]
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm_before = self._segments()

    @staticmethod
    def _segments() -> set[str]:
        return {p.name for p in SHM.glob("lmcache_*")} if SHM.is_dir() else set()

    def kv_transfer_config(self) -> dict[str, Any]:
        """What `vllm serve --kv-transfer-config` takes to use this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}

    def start(self) -> LmcacheServer:
        if not LMCACHE_PYTHON.exists():
            raise RuntimeError("no LMCache environment: run bash scripts/lmcache_env.sh")
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **QUIET})
        log.close()
        deadline = time.monotonic() + self.START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            if "cache server is running" in self.log_path.read_text(errors="replace").lower():
                return self
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"LMCache server not running after {self.START_S:.0f} s")

    def tokens(self) -> dict[str, int]:
        """Tokens the server logged stored and retrieved since it started."""
        text = self.log_path.read_text(errors="replace")
        return {"stored": sum(int(n) for n in STORED.findall(text)),
                "retrieved": sum(int(n) for n in RETRIEVED.findall(text))}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        for name in self._segments() - self.shm_before:
            (SHM / name).unlink(missing_ok=True)
