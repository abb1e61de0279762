"""Training-step time of the embedded trainer and of Megatron-core at TP = 1 and TP = 2,
on the same batch, and the share of the weight Push the trainer waits for.

Every backend trains the same Qwen2 policy (a preset of ``staleflow.models.presets``,
built from code) on the same synthetic batch (``--groups`` x ``--group-size`` responses,
rewards alternating within each group) for ``--steps`` steps after one warm-up step, and
Pushes each new version to a real PS worker (shared memory), as in a run:

* embedded: one process; after each step it waits for the previous Push, copies the
  weights (``export_weights``) and hands them to a background Push, as
  ``staleflow.runtime.workers.training_loop.TrainingLoop`` does. Exposed: the wait plus the copy.
* megatron tp=N: N gloo processes (``run_local``); each rank Pushes its own shards in the
  background right after its step and waits for that Push only before its next update
  (the fence). Exposed: the fence's wait (``train/push_wait_s``).

Figures: median step seconds, response tokens per second (the batch's tokens / step
time), the median background Push seconds, and the exposed share
``sum(exposed) / sum(step time)`` (goal: at most 5 %). One torch thread per process by
default (a shared machine; see experiments/bench_engine.py); the load average is
recorded.

    python experiments/bench_trainer.py --json results/bench_trainer.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parameter_server import BackgroundPusher, Layout
from parameter_server.torch_compat import state_dict_to_numpy
from parameter_server.transport import connect
from parameter_server.worker import PSWorker
from staleflow.config import TrainerConfig
from staleflow.models import build_arithmetic_model, policy_state
from staleflow.models.build import build_model
from staleflow.trainers.embedded import EmbeddedTrainer
from staleflow.trainers.interface import TOKENS_METRIC
from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset (default tiny: 2.9M params)")
    p.add_argument("--groups", type=int, default=32, help="groups per batch (default 32)")
    p.add_argument("--group-size", type=int, default=8, help="responses per group (default 8)")
    p.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (default 12)")
    p.add_argument("--response-len", type=int, default=32, help="longest response (default 32)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per backend (default 5)")
    p.add_argument("--tp", default="1,2", help="Megatron TP sizes to run (default 1,2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def make_batch(args: argparse.Namespace, vocab: int, seed: int = 0) -> TrainingBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(3, vocab, args.prompt_len).astype(np.int32)
        trajs = []
        for i in range(args.group_size):
            n = int(rng.integers(args.response_len // 2, args.response_len + 1))
            trajs.append(
                TrainingTrajectory(
                    traj_id=g * args.group_size + i,
                    v_traj=0,
                    tokens=rng.integers(3, vocab, n).astype(np.int32),
                    logprobs=-rng.uniform(0.1, 3.0, n).astype(np.float32),
                    versions=np.zeros(n, np.int32),
                    reward=float(i % 2),
                    finish_reason="length",
                )
            )
        groups.append(TrainingGroup(g, g, "", prompt, tuple(trajs)))
    return TrainingBatch(tuple(groups))


def _summary(
    name: str, tp: int, steps: list[float], pushes: list[float], exposed: list[float], tokens: float
) -> dict[str, Any]:
    step = statistics.median(steps)
    return {
        "backend": name,
        "tp": tp,
        "step_s": step,
        "tokens_per_s": tokens / step,
        "push_s": statistics.median(pushes) if pushes else float("nan"),
        "push_exposed_s": statistics.median(exposed),
        "push_exposed_share": sum(exposed) / sum(steps),
        "steps": len(steps),
    }


def bench_embedded(args, model, tokenizer, batch, endpoint) -> dict[str, Any]:
    trainer = EmbeddedTrainer(
        model, TrainerConfig(), pad_id=tokenizer.pad_id, num_threads=args.threads
    )
    steps, pushes, exposed, tokens = [], [], [], 0.0
    with connect(endpoint, "shm") as transport, BackgroundPusher(transport) as pusher:
        pending = None
        for i in range(args.steps + 1):
            start = time.perf_counter()
            metrics = trainer.train_step(batch)
            trained = time.perf_counter()
            if pending is not None:
                pending.wait()
                if i > 1:
                    pushes.append(pending.timing.copy_s)
            pending = pusher.push_async(trainer.version, trainer.export_weights())
            done = time.perf_counter()
            if i:  # the first step warms up
                steps.append(done - start)
                exposed.append(done - trained)
                tokens = metrics[TOKENS_METRIC]
        pending.wait()
    return _summary("embedded", 1, steps, pushes, exposed, tokens)


def _megatron_rank(rank: int, world: int, address: str, payload: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(payload["threads"])
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed

    init_distributed(rank, world, address)
    r = MegatronRank(payload["spec"])
    r.load_hf(payload["hf"])
    r.attach_push(payload["endpoint"])
    steps, pushes, exposed, tokens, handle = [], [], [], 0.0, None
    for i in range(payload["steps"] + 1):
        start = time.perf_counter()
        metrics = r.train_step(payload["batch"] if r.is_data_leader else None)
        if handle is not None and i > 1:
            pushes.append(handle.timing.copy_s)  # fenced in this step: done
        handle = r.start_push()
        if i:
            steps.append(time.perf_counter() - start)
            exposed.append(metrics["train/push_wait_s"])
            tokens = metrics[TOKENS_METRIC]
    r.close()
    return {"steps": steps, "pushes": pushes, "exposed": exposed, "tokens": tokens}


def bench_megatron(args, model, tokenizer, batch, endpoint, tp: int) -> dict[str, Any]:
    from staleflow.trainers.megatron.local import run_local
    from staleflow.trainers.megatron.rank import RankSpec

    spec = RankSpec(
        model.config.to_dict(),
        TrainerConfig(backend="megatron", tp=tp, num_threads=args.threads),
        pad_id=tokenizer.pad_id,
    )
    payload = {
        "spec": spec,
        "hf": state_dict_to_numpy(policy_state(model)),
        "batch": batch,
        "endpoint": endpoint,
        "steps": args.steps,
        "threads": args.threads,
    }
    out = run_local(tp, _megatron_rank, payload, timeout_s=1800)
    return _summary("megatron", tp, out["steps"], out["pushes"], out["exposed"], out["tokens"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(args.preset, tokenizer.vocab_size, seed=0)
    batch = make_batch(args, tokenizer.vocab_size)
    weights = state_dict_to_numpy(policy_state(model))
    layout = Layout.from_arrays(weights)
    rows = []
    load_before = os.getloadavg()
    worker = PSWorker.start(layout, 3)
    try:
        with connect(worker.endpoint, "shm") as client:
            client.push(weights, 0)
        rows.append(bench_embedded(args, copy.deepcopy(model), tokenizer, batch, worker.endpoint))
    finally:
        worker.stop()
    for tp in [int(t) for t in args.tp.split(",") if t]:
        worker = PSWorker.start(layout, 3)  # a fresh PS: versions start at 0 again
        try:
            with connect(worker.endpoint, "shm") as client:
                client.push(weights, 0)
            rows.append(bench_megatron(args, model, tokenizer, batch, worker.endpoint, tp))
        finally:
            worker.stop()
    result = {
        "rows": rows,
        "params": int(sum(p.numel() for p in model.parameters())),
        "batch": {"groups": args.groups, "group_size": args.group_size},
        "threads": args.threads,
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "argv": sys.argv[1:] if argv is None else argv,
    }
    print(
        f"{'backend':<10}{'tp':>3}{'step s':>9}{'tokens/s':>10}{'push s':>9}"
        f"{'exposed s':>11}{'exposed':>9}"
    )
    for r in rows:
        print(
            f"{r['backend']:<10}{r['tp']:>3}{r['step_s']:>9.3f}{r['tokens_per_s']:>10.0f}"
            f"{r['push_s']:>9.4f}{r['push_exposed_s']:>11.4f}{r['push_exposed_share']:>8.1%}"
        )
    print(f"load average before/after: {load_before[0]:.1f} / {result['load_avg']['after'][0]:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
