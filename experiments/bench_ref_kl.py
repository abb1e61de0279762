"""What the reference KL costs a training step: step time with ``trainer.kl_coef`` off and
on, for the embedded trainer and (``--megatron``) one Megatron-core rank at TP = 1.

Both settings train the same Qwen2 policy (a preset of ``staleflow.models.presets``, built
from code) on the same synthetic batch (``--groups`` x ``--group-size`` responses of up
to ``--response-len`` tokens, rewards alternating within each group). With the KL on
(``kl_coef=0.01``, k3) the trainer holds a frozen copy of the initial policy and scores
each batch with it in one no-grad forward pass before the loss
(``staleflow.trainers.rl.with_reference``). The two trainers take their steps in turn
(off, on, off, on, ...), so that a change of load on the shared machine hits both alike;
one warm-up step each, then ``--steps`` timed ones.

Figures: the median step seconds off and on, the overhead ``on / off - 1``, and the
reference's extra memory (its parameters' bytes: no gradient, no optimizer state).
One torch thread per process by default; the load average is recorded.

    python experiments/bench_ref_kl.py --megatron --json results/bench_ref_kl.json
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

import torch

# the same synthetic batch as the trainer benchmark's (this script runs from experiments/)
from bench_trainer import make_batch

from parameter_server.torch_compat import state_dict_to_numpy
from staleflow.config import TrainerConfig
from staleflow.models import build_arithmetic_model, policy_state
from staleflow.models.build import build_model
from staleflow.trainers.embedded import EmbeddedTrainer
from trajectory_server.types import TrainingBatch

KL_ON = {"kl_coef": 0.01, "kl_estimator": "k3"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny", help="model preset (default tiny: 2.9M params)")
    p.add_argument("--groups", type=int, default=16, help="groups per batch (default 16)")
    p.add_argument("--group-size", type=int, default=8, help="responses per group (default 8)")
    p.add_argument("--prompt-len", type=int, default=12, help="prompt tokens (default 12)")
    p.add_argument("--response-len", type=int, default=64, help="longest response (default 64)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting (default 5)")
    p.add_argument("--megatron", action="store_true", help="also one Megatron rank at TP = 1")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def _row(name: str, off: list[float], on: list[float], ref_bytes: int) -> dict[str, Any]:
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {
        "backend": name,
        "step_s_off": off_s,
        "step_s_on": on_s,
        "overhead": on_s / off_s - 1.0,
        "reference_bytes": ref_bytes,
        "steps_off": off,
        "steps_on": on,
    }


def _alternate(step_off: Any, step_on: Any, steps: int) -> tuple[list[float], list[float]]:
    off, on = [], []
    for i in range(steps + 1):
        for fn, out in ((step_off, off), (step_on, on)):
            start = time.perf_counter()
            fn()
            if i:  # the first step of each warms up
                out.append(time.perf_counter() - start)
    return off, on


def bench_embedded(args: argparse.Namespace, model: Any, pad_id: int, batch: TrainingBatch):
    def trainer(**kl: float | str) -> EmbeddedTrainer:
        section = TrainerConfig(num_threads=args.threads, **kl)  # type: ignore[arg-type]
        return EmbeddedTrainer(copy.deepcopy(model), section, pad_id=pad_id)

    off, on = trainer(), trainer(**KL_ON)
    assert on.reference is not None
    ref_bytes = sum(p.numel() * p.element_size() for p in on.reference.parameters())
    times = _alternate(lambda: off.train_step(batch), lambda: on.train_step(batch), args.steps)
    return _row("embedded", *times, ref_bytes)


def _megatron_rank(rank: int, world: int, address: str, payload: dict[str, Any]) -> dict:
    torch.set_num_threads(payload["threads"])
    from staleflow.trainers.megatron.rank import MegatronRank, init_distributed

    init_distributed(rank, world, address)
    ranks = []
    for spec in payload["specs"]:  # two ranks of one process: the parallel state is shared
        r = MegatronRank(spec)
        r.load_hf(payload["hf"])
        ranks.append(r)
    batch = payload["batch"]
    off, on = _alternate(
        lambda: ranks[0].train_step(batch), lambda: ranks[1].train_step(batch), payload["steps"]
    )
    ref = ranks[1].reference_model
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    return {"off": off, "on": on, "ref_bytes": ref_bytes}


def bench_megatron(args: argparse.Namespace, model: Any, pad_id: int, batch: TrainingBatch):
    from staleflow.trainers.megatron.local import run_local
    from staleflow.trainers.megatron.rank import RankSpec

    specs = [
        RankSpec(
            model.config.to_dict(),
            TrainerConfig(backend="megatron", num_threads=args.threads, **kl),  # type: ignore[arg-type]
            pad_id=pad_id,
        )
        for kl in ({}, KL_ON)
    ]
    payload = {
        "specs": specs,
        "hf": state_dict_to_numpy(policy_state(model)),
        "batch": batch,
        "steps": args.steps,
        "threads": args.threads,
    }
    out = run_local(1, _megatron_rank, payload, timeout_s=1800)
    return _row("megatron tp=1", out["off"], out["on"], out["ref_bytes"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _, tokenizer = build_arithmetic_model("micro")
    model = build_model(args.preset, tokenizer.vocab_size, seed=0)
    batch = make_batch(args, tokenizer.vocab_size)
    load_before = os.getloadavg()
    rows = [bench_embedded(args, model, tokenizer.pad_id, batch)]
    if args.megatron:
        rows.append(bench_megatron(args, model, tokenizer.pad_id, batch))
    tokens = sum(len(t.tokens) for g in batch.groups for t in g.trajectories)
    result = {
        "rows": rows,
        "params": int(sum(p.numel() for p in model.parameters())),
        "preset": args.preset,
        "batch": {"groups": args.groups, "group_size": args.group_size, "tokens": tokens},
        "kl": KL_ON,
        "threads": args.threads,
        "load_avg": {"before": load_before, "after": os.getloadavg()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "argv": sys.argv[1:] if argv is None else argv,
    }
    print(f"{'backend':<15}{'KL off s':>10}{'KL on s':>10}{'overhead':>10}{'ref MB':>8}")
    for r in rows:
        print(
            f"{r['backend']:<15}{r['step_s_off']:>10.3f}{r['step_s_on']:>10.3f}"
            f"{r['overhead']:>10.1%}{r['reference_bytes'] / 2**20:>8.1f}"
        )
    print(
        f"{result['params']} parameters, {tokens} response tokens a step; load average "
        f"before/after: {load_before[0]:.1f} / {result['load_avg']['after'][0]:.1f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
