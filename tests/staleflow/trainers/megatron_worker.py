"""Runs real Megatron-core ranks in child processes (gloo, one process per rank) for the
equivalence tests: nothing is faked. Each child builds a :class:`MegatronRank` from HF
weights, follows a short script, and rank 0 writes what it saw to ``out/result.pkl``."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Script:
    """What every rank does: load ``hf`` (HF-named arrays), train ``steps`` steps on
    ``batch`` (split over DP ranks), optionally save or first load a distributed
    checkpoint, and gather the HF weights at the end."""

    spec: Any  # RankSpec
    hf: dict[str, np.ndarray]
    batch: Any = None  # TrainingBatch
    steps: int = 1
    save: str = ""
    load: str = ""
    push_endpoint: Any = None
    logits_of: np.ndarray | None = None  # also report the gathered logits of these ids
    # more models built in the same ranks: (RankSpec, HF weights) -> their logits_of
    others: list[tuple[Any, dict[str, np.ndarray]]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(script: Script, out: Path, timeout_s: float = 240.0) -> dict[str, Any]:
    """Run ``script`` on ``spec.world`` child processes; rank 0's result."""
    world = script.spec.world
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(rank, world, port, script, str(out)))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = sorted(out.glob("error-*.txt"))
    if errors:
        raise AssertionError("\n".join(e.read_text() for e in errors))
    if alive or any(p.exitcode for p in procs):
        raise AssertionError(f"ranks exited with {[p.exitcode for p in procs]}")
    with open(out / "result.pkl", "rb") as f:
        return pickle.load(f)


def _child(rank: int, world: int, port: int, script: Script, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        result = _script(rank, world, port, script)
        if rank == 0:
            with open(os.path.join(out, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _script(rank: int, world: int, port: int, script: Script) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.checkpoint import load_checkpoint, save_checkpoint
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch

    init_distributed(rank, world, f"127.0.0.1:{port}")
    r = MegatronRank(script.spec)
    result: dict[str, Any] = {"names": sorted(r.local_weights()), "metrics": []}
    if script.load:
        load_checkpoint(r, script.load)
    else:
        r.load_hf(script.hf)
    result["loaded"] = r.gather_hf()
    if script.logits_of is not None:
        result["logits"] = _gathered_logits(r, script.logits_of)
        result["other_logits"] = []
        for spec, hf in script.others:
            other = MegatronRank(spec)
            other.load_hf(hf)
            result["other_logits"].append(_gathered_logits(other, script.logits_of))
    if script.push_endpoint is not None:
        result["push_bytes"] = r.attach_push(script.push_endpoint)
    for _ in range(script.steps):
        part = None
        if r.is_data_leader:
            part = split_batch(script.batch, script.spec.section.dp)[r.dp_rank]
        result["metrics"].append(r.train_step(part))
        if script.push_endpoint is not None:
            r.start_push()
        result.setdefault("after", []).append(r.gather_hf())
    if script.push_endpoint is not None:
        result["pushed"] = r.wait_push(timeout=120)
        r.close()
    if script.save:
        save_checkpoint(r, script.save)
    result["final"] = result["after"][-1] if script.steps else r.gather_hf()
    result["version"] = r.version
    return result


def _gathered_logits(r: Any, ids: np.ndarray) -> np.ndarray:
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        local = r.backend.logits(torch.from_numpy(ids))
    parts = [torch.empty_like(local) for _ in range(r.spec.section.tp)]
    dist.all_gather(parts, local, group=r._ps.get_tensor_model_parallel_group())
    return torch.cat(parts, -1).numpy()
