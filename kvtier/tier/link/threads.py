"""How a kvtier thread (the link, its copy team, the I/O thread) runs beside an engine's
compute: its torch ops on one OpenMP thread, and free to run on any of the process's CPUs.

One OpenMP thread: a thread's parallel op otherwise starts an OpenMP team of its own beside
the engine's, which oversubscribes the cores (every engine step ~20% slower on 2 cores,
measured). torch's own C function is called: vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op once it has bound its threads, so under vLLM the plain
call did nothing (a no-hit run 15% slower than plain vLLM; 5% with this).

Any CPU: vLLM's CPU worker pins its main thread to one core for its OpenMP team, and a thread
started from it inherits that one core, so every kvtier thread shared core 0 with the forward
pass's master thread (a 94 MB load took 15-19 ms with two copy threads on that one core).
"""

from __future__ import annotations

import contextlib
import os

import torch


def use_one_thread() -> None:
    """The calling thread: torch ops on one OpenMP thread, scheduled on any CPU."""
    torch._C.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        # 0: the calling thread; CPUs outside the process's cpuset are dropped, and where a
        # sandbox forbids the call the thread stays where it was put
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
