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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class FreeCores:
    """The cores other processes leave to this one over the time since the last call:
    every CPU's busy time (/proc/stat) less this process's own CPU time, so a process
    that keeps both cores busy itself still counts them as free. Called again and again,
    it follows other jobs as they come and go; no sleep. None off Linux."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, float] | None:
        times = _cpu_times()
        if times is None:
            return None
        return times[0], times[1], time.process_time(), time.monotonic()

    def __call__(self) -> int | None:
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1] or now[3] <= last[3]:
            return None
        cpus = os.cpu_count() or 1
        busy = (1.0 - (now[0] - last[0]) / (now[1] - last[1])) * cpus
        own = (now[2] - last[2]) / (now[3] - last[3])
        free = cpus - max(0.0, busy - own)
        return max(1, min(_cores(), int(free + 0.5)))


def idle_cores(sample_s: float = 0.25) -> int:
    """Cores of this process that are idle now (at least 1, at most those it may run on):
    :class:`FreeCores` over ``sample_s`` seconds (Linux), else the 1-minute load average.
    The load average lags by minutes: right after an install it still counts the
    install, and a whole core would go unused."""
    share = FreeCores()
    time.sleep(sample_s)
    free = share()
    if free is not None:
        return free
    try:
        return max(1, min(_cores(), int(_cores() - os.getloadavg()[0] + 0.5)))
    except OSError:
        return _cores()


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
