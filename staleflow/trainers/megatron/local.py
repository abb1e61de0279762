"""Run a function on ``world`` local processes joined in one process group, without Ray.

For tests and benchmarks of Megatron ranks on one machine: each child gets its rank, the
world size and rank 0's rendezvous address (for
:func:`staleflow.trainers.megatron.rank.init_distributed`), and rank 0's return value
comes back. A child that raises has its traceback reported by the parent; a child that
hangs is killed after ``timeout_s``; a child that dies by a signal is named with it.

Each child destroys its process group before it exits: left to interpreter finalization,
gloo's worker threads can release tensors after Python is gone and abort the process
(SIGABRT; pytorch/pytorch#179291 describes it) after its work was done.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

_P = TypeVar("_P")  # the payload, handed to every rank as is
_R = TypeVar("_R")  # rank 0's result


class LocalRunError(RuntimeError):
    """A rank failed or hung; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_local(
    world: int,
    fn: Callable[[int, int, str, _P], _R],
    payload: _P,
    *,
    timeout_s: float = 600.0,
) -> _R:
    """``fn(rank, world, address, payload)`` on ``world`` spawned processes (``fn`` must be
    importable by name); returns rank 0's result."""
    address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="staleflow-ranks-") as tmp:
        out = Path(tmp)
        # not daemonic: Megatron's checkpoint writer starts processes of its own
        procs = [
            ctx.Process(target=_child, args=(fn, rank, world, address, payload, str(out)))
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in hung:
            procs[i].kill()
            procs[i].join(10)
        errors = sorted(out.glob("error-*.txt"))
        if errors:
            raise LocalRunError("\n".join(e.read_text() for e in errors))
        if hung:
            raise LocalRunError(f"ranks {hung} hung for {timeout_s}s and were killed")
        died = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode}
        if died:
            returned = "had" if (out / "result.pkl").exists() else "had not"
            raise LocalRunError(
                ", ".join(f"rank {i} {_ended(code)}" for i, code in died.items())
                + f" without a traceback (rank 0 {returned} returned its result); "
                "its stderr holds the reason"
            )
        with open(out / "result.pkl", "rb") as f:
            return pickle.load(f)


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"died by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"died by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _child(
    fn: Callable[[int, int, str, _P], _R],
    rank: int,
    world: int,
    address: str,
    payload: _P,
    out: str,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # one GPU per rank where there are GPUs (a Ray actor gets this from Ray)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(world)]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
    try:
        result = fn(rank, world, address, payload)
        if rank == 0:
            with open(os.path.join(out, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        _leave_group()


def _leave_group() -> None:
    """Destroy the process group while the interpreter is whole (see the module doc)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
