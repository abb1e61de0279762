"""Runs real Megatron-core ranks in child processes (gloo, one process per rank) for the
equivalence tests: nothing is faked. Each child builds a :class:`MegatronRank` from HF
weights and follows a short script; rank 0 returns what it saw."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staleflow.trainers.megatron.local import run_local


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
    # hold each background Push until the next step's update waits for it (or, with no
    # fence, has changed the weights): the Push overlaps the next step for certain
    hold_push: bool = False
    # more models built in the same ranks: (RankSpec, HF weights) -> their logits_of
    others: list[tuple[Any, dict[str, np.ndarray]]] = field(default_factory=list)
    # trainer.stream: before each step, these parts (group indexes of ``batch``) are
    # streamed one after the other; the step gets the groups left
    stream_parts: tuple[tuple[int, ...], ...] = ()
    # greedy tokens the final weights generate after these prompt ids (1-D), decoded by
    # argmax over the gathered logits: what an HF export must generate too
    greedy_from: np.ndarray | None = None
    greedy_tokens: int = 8


def run(script: Script, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run ``script`` on ``spec.world`` child processes; rank 0's result."""
    return run_local(script.spec.world, _script, script, timeout_s=timeout_s)


def _script(rank: int, world: int, address: str, script: Script) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.checkpoint import load_checkpoint, save_checkpoint
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch
    from trajectory_server.types import TrainingBatch

    init_distributed(rank, world, address)
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
        if script.hold_push:
            _hold_pushes(r, last=script.steps)
    dp = script.spec.section.dp
    for _ in range(script.steps):
        rest = script.batch
        for ids in script.stream_parts:
            groups = tuple(script.batch.groups[i] for i in ids)
            streamed = TrainingBatch(groups, (), script.batch.temperature)
            r.stream(split_batch(streamed, dp)[r.dp_rank] if r.is_data_leader else None)
        if script.stream_parts:
            done = {i for ids in script.stream_parts for i in ids}
            left = tuple(g for i, g in enumerate(script.batch.groups) if i not in done)
            rest = TrainingBatch(left, (), script.batch.temperature)
        part = split_batch(rest, dp)[r.dp_rank] if r.is_data_leader else None
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
    if script.greedy_from is not None:
        result["greedy"] = _greedy(r, script.greedy_from, script.greedy_tokens)
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


def _greedy(r: Any, prompt: np.ndarray, n: int) -> list[int]:
    ids = np.asarray(prompt, dtype=np.int64)[None]
    for _ in range(n):
        nxt = int(np.argmax(_gathered_logits(r, ids)[0, -1]))
        ids = np.concatenate([ids, [[nxt]]], axis=1)
    return ids[0, prompt.shape[0] :].tolist()


def _hold_pushes(r: Any, last: int) -> None:
    """Hold each background Push (but the ``last`` version's: no step follows it) until
    the next step's update either waits for it (the fence) or has changed the weights
    (no fence): the Push then certainly overlaps the next step's forward and backward
    passes, and a missing fence would Push the changed weights. Conditions, no sleeps."""
    import threading

    state = {"waited": 0, "stepped": 0}
    changed = threading.Condition()
    client, pusher, optimizer = r._client, r._pusher, r.update.optimizer
    push, push_async, step = client.push, pusher.push_async, optimizer.step

    def mark(key: str) -> None:
        with changed:
            state[key] += 1
            changed.notify_all()

    def held_push(weights: Any, version: int | None = None) -> Any:
        if version is not None and version < last:
            with changed:
                seen = dict(state)
                if not changed.wait_for(lambda: state != seen, timeout=120):
                    raise TimeoutError("the next step neither waited for the Push nor updated")
        return push(weights, version)

    def watched_push_async(version: Any, weights: Any) -> Any:
        handle = push_async(version, weights)
        wait = handle.wait

        def watched_wait(timeout: float | None = None) -> Any:
            mark("waited")
            return wait(timeout)

        handle.wait = watched_wait
        return handle

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        mark("stepped")
        return out

    client.push = held_push
    pusher.push_async = watched_push_async
    optimizer.step = watched_step


def group_at_exit(rank: int, world: int, address: str, path: str) -> int:
    """Join a gloo group and leave it to ``run_local``: at exit, write whether the group
    was still up (an atexit handler runs before the interpreter is torn down)."""
    import atexit

    import torch.distributed as dist

    from staleflow.trainers.megatron.rank import init_distributed

    init_distributed(rank, world, address)

    def record() -> None:
        with open(f"{path}-{rank}", "w") as f:
            f.write(str(dist.is_initialized()))

    atexit.register(record)
    return dist.get_world_size()


def abort(rank: int, world: int, address: str, payload: object) -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGABRT)


def fresh_steps(rank: int, world: int, address: str, payload: Any) -> list[Any]:
    """``payload = (spec, hf, batches)``: for each batch, a new rank loaded from ``hf``
    (its own optimizer: no state carried from one batch to the next) takes one step;
    rank 0 returns each step's metrics and the HF weights after it."""
    import torch

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch

    spec, hf, batches = payload
    init_distributed(rank, world, address)
    out = []
    for batch in batches:
        r = MegatronRank(spec)
        r.load_hf(hf)
        part = split_batch(batch, spec.section.dp)[r.dp_rank] if r.is_data_leader else None
        metrics = r.train_step(part)
        out.append((metrics, r.gather_hf()))
    return out


def consecutive_steps(rank: int, world: int, address: str, payload: Any) -> list[Any]:
    """``payload = (spec, hf, batches)``: one rank loaded from ``hf`` takes a step on each
    batch in turn (its optimizer state and reference carried along); rank 0 returns each
    step's metrics and the HF weights after the last."""
    import torch

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch

    spec, hf, batches = payload
    init_distributed(rank, world, address)
    r = MegatronRank(spec)
    r.load_hf(hf)
    metrics = []
    for batch in batches:
        part = split_batch(batch, spec.section.dp)[r.dp_rank] if r.is_data_leader else None
        metrics.append(r.train_step(part))
    return [metrics, r.gather_hf()]


def resumed_reference(rank: int, world: int, address: str, payload: Any) -> dict[str, Any]:
    """``payload = (spec, hf, batch, folder)``: a rank loaded from ``hf`` takes a step on
    ``batch``, writes a distributed checkpoint to ``folder`` and takes a second step; a
    second rank (a resumed run) loads the checkpoint and takes that second step. Rank 0
    returns both second steps' metrics and whether the resumed ranks' reference holds
    ``hf`` (the initial policy) while their policy does not, on every rank."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.checkpoint import load_checkpoint, save_checkpoint
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch

    spec, hf, batch, folder = payload
    init_distributed(rank, world, address)
    r = MegatronRank(spec)
    r.load_hf(hf)
    initial = {n: p.detach().clone() for n, p in r.model.named_parameters()}
    part = split_batch(batch, spec.section.dp)[r.dp_rank] if r.is_data_leader else None
    r.train_step(part)
    save_checkpoint(r, folder)
    straight = r.train_step(part)

    resumed = MegatronRank(spec)
    load_checkpoint(resumed, folder)
    ref = dict(resumed.reference_model.named_parameters()) if resumed.reference_model else {}
    mine = (  # this rank's shard
        bool(ref) and all(torch.equal(ref[n], p) for n, p in initial.items()),
        any(not torch.equal(q, initial[n]) for n, q in resumed.model.named_parameters()),
    )
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "straight": straight,
        "resumed": resumed.train_step(part),
        "reference_is_initial": all(r for r, _ in every),  # on every rank
        "policy_moved": all(m for _, m in every),
    }


def train_and_export(rank: int, world: int, address: str, payload: Any) -> list[int] | None:
    """``payload = (spec, hf, batch, folder, prompt, n)``: a rank loaded from ``hf`` takes
    a step on ``batch`` and writes the pool's checkpoint of it to ``folder`` (the code of
    ``RankActor.save_checkpoint``: the distributed checkpoint, the RNG states and the HF
    folder a run's ``checkpoint`` is); rank 0 returns the ``n`` tokens the trained model
    decodes greedily after ``prompt`` (argmax of Megatron's own logits)."""
    import torch

    torch.set_num_threads(1)
    from staleflow.trainers.megatron.pool import RankActor
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed
    from staleflow.trainers.megatron.split import split_batch

    spec, hf, batch, folder, prompt, n = payload
    init_distributed(rank, world, address)
    r = MegatronRank(spec)
    r.load_hf(hf)
    r.train_step(split_batch(batch, spec.section.dp)[r.dp_rank] if r.is_data_leader else None)
    actor = RankActor(spec, rank)
    actor._rank = r  # what RankActor.start builds; its save_checkpoint is the pool's
    actor.save_checkpoint(folder)
    tokens = _greedy(r, np.asarray(prompt), n)
    return tokens if rank == 0 else None
