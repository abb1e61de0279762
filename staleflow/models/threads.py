"""How many torch threads the driver's own model work (warm-up, scoring) should use.

On cores shared with other processes, torch threads beyond the idle cores mostly spin
waiting for each other: at a load average of 12 on 2 cores, a warm-up step took 7.0 s
with 2 threads and 0.8 s with 1 (``experiments/bench_warmup.py``). So the driver counts
the cores idle right now instead of taking every core.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch


def _cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of every CPU since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    # user nice system idle iowait irq softirq steal: idle and iowait are free time
    return fields[3] + fields[4], sum(fields)


def idle_cores(sample_s: float = 0.25) -> int:
    """Cores of this process that are idle now (at least 1, at most those it may run on):
    the idle share of every CPU over ``sample_s`` seconds (Linux), else the 1-minute load
    average. The load average lags by minutes: right after an install it still counts
    the install, and a whole core would go unused."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    before = _cpu_times()
    if before is not None:
        time.sleep(sample_s)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            share = (after[0] - before[0]) / (after[1] - before[1])
            free = share * (os.cpu_count() or cores)
            return max(1, min(cores, int(free + 0.5)))
    try:
        free = cores - os.getloadavg()[0]
    except OSError:
        return cores
    return max(1, min(cores, int(free + 0.5)))


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
