"""One OpenMP thread for a kvtier thread's torch ops, so its copies and checksums never start an
OpenMP team of their own beside the engine's compute (which oversubscribes the cores: every
engine step ~20% slower on 2 cores, measured).

torch's own C function is called: vLLM's CPU worker replaces `torch.set_num_threads` with a
no-op once it has bound its threads, so the plain call did nothing under vLLM and every kvtier
thread (the link, its copy team, the I/O thread) ran its copies on a team as wide as the
machine.
"""

from __future__ import annotations

import torch


def use_one_thread() -> None:
    """The calling thread's torch ops run on one OpenMP thread."""
    torch._C.set_num_threads(1)
