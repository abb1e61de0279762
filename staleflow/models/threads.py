"""How many torch threads the driver's own model work (warm-up, scoring) should use.

On cores shared with other processes, torch threads beyond the idle cores mostly spin
waiting for each other: at a load average of 12 on 2 cores, a warm-up step took 7.0 s
with 2 threads and 0.8 s with 1 (``experiments/bench_warmup.py``). So the driver asks the
load average instead of taking every core.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def idle_cores() -> int:
    """Cores of this process not busy with other work, from the 1-minute load average
    (at least 1, at most the cores this process may run on)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, int(cores - load + 0.5)))


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """``num_threads`` torch threads inside the block (None: leave them as they are)."""
    if num_threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
