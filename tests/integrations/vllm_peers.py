"""Two (or more) vLLM engines running at once, each answering requests sent to it
(`scripts/vllm_peer.py`): the prefill/decode tests start them side by side and send each
request where a router would."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from vllm_run import KV_BYTES_PER_BLOCK, ONE_PROCESS, ROOT

PEER = ROOT / "scripts" / "vllm_peer.py"
MARK, READY = "KVTIER_RESULT ", "KVTIER_READY"
START_S = 300.0
ANSWER_S = 300.0


class Peer:
    """One engine; `send` queues a request, `result` waits for the next answer."""

    def __init__(self, python: Path, model: Path, spec: dict[str, Any], log: Path) -> None:
        spec = {"blocks": 24, "kv_bytes_per_block": KV_BYTES_PER_BLOCK, **spec}
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [str(python), str(PEER), str(model), json.dumps(spec)], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env={**os.environ, **ONE_PROCESS}, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith((MARK, READY)):
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # it ended

    def _next(self, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"peer silent for {timeout_s} s; log: {self.tail()}") from None
        if line is None:
            raise AssertionError(f"peer exited {self.proc.wait()}; log: {self.tail()}")
        return line

    def ready(self) -> None:
        assert self._next(START_S) == READY

    def send(self, prompt: list[int], max_tokens: int = 8, kv_params: dict | None = None,
             salt: str | None = None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                          "kv_params": kv_params, "salt": salt}) + "\n")
        self.proc.stdin.flush()

    def result(self) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self._next(ANSWER_S)[len(MARK):])
        assert "error" not in answer, answer
        return answer

    def ask(self, prompt: list[int], **kwargs: Any) -> dict[str, Any]:
        self.send(prompt, **kwargs)
        return self.result()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing it had on its way lands after this."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def tail(self) -> str:
        self._log.flush()
        return self.log.read_text(errors="replace")[-3000:]


def started(*peers: Peer) -> tuple[Peer, ...]:
    """Each peer up (they start side by side), or all closed and the first failure raised."""
    try:
        for peer in peers:
            peer.ready()
    except BaseException:
        for peer in peers:
            if peer.proc.poll() is None:
                peer.kill()
            peer.close()
        raise
    return peers


def until(check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
