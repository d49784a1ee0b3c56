"""vLLM imported once, each driver run forked from it: the tests start vLLM ~50 times, and
importing it (~8 s of CPU on a 2-core machine) was a third of each run. Runs in the vLLM
environment; the test session starts it (tests/conftest.py) and `vllm_run.run_vllm` sends it
each run. Serves one run at a time, as the tests run them.

    .venv-vllm/bin/python scripts/vllm_zygote.py SOCKET_PATH

A request is one JSON line on the Unix socket: {"argv": [script, args...], "env": {...},
"cwd": DIR, "stdout": PATH, "stderr": PATH}; the answer, two lines: {"pid": N} once the run is
forked (the client kills its process group on a timeout), then {"rc": N} when it ended.
Nothing but the imports is done before a fork: the child sets its whole environment, so an
environment variable vLLM or kvtier reads at start is read from the run's own. Where a fork
would be unsafe (a thread already running), the zygote refuses to start and the tests start
each run as a process of its own.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import threading
import traceback

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # as the driver sets it


def preload() -> None:
    """What every driver run imports first (import only: no engine, no thread, no pool)."""
    import vllm.v1.engine.core
    import vllm.v1.engine.llm_engine
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401


def run_child(request: dict) -> None:
    """In the forked child: the run's environment, directory and output files, then its
    script as __main__; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills the run and what it spawned
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        # the import path a fresh interpreter would have: the script's folder, then PYTHONPATH
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.path.dirname(os.path.abspath(sys.argv[0])), *extra]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        import atexit

        atexit._run_exitfuncs()  # what a normal exit runs (vLLM shuts its engine down there)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as stream:
            line = stream.readline()
            if not line:
                continue
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                run_child(request)
            try:
                stream.write(json.dumps({"pid": pid}) + "\n")
                stream.flush()
            except OSError:  # the client went away: its run still ends before the next
                pass
            _, status = os.waitpid(pid, 0)
            try:
                stream.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
                stream.flush()
            except OSError:
                pass


def main() -> None:
    preload()
    if threading.active_count() != 1:
        print(f"unsafe to fork: {threading.enumerate()}", file=sys.stderr, flush=True)
        sys.exit(3)
    serve(sys.argv[1])


if __name__ == "__main__":
    main()
