"""How many examples the built-in model's warm-up needs to reach its target accuracy, for
other batch sizes, learning rates and schedules.

Counts examples, not seconds, so a busy machine changes how long the sweep takes but not
its figures (the warm-up is deterministic for a seed and thread count). Each setting
trains a fresh ``tiny`` model on the default task (``staleflow.models.warmup.warmup``),
checks the sampled (T=1) accuracy on the validation problems every ``--check-examples``
examples, and stops at ``--target`` or ``--max-examples``.

    python experiments/warmup_sweep.py 128,2e-3,1200,0 64,2e-3,2400,0 --json results/ws.json

A setting is ``batch,lr,schedule_steps,seed`` (the cosine schedule spans
``schedule_steps``; its linear warm-up is 5% of it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from staleflow.data.synthetic import ArithmeticTask
from staleflow.models.build import build_arithmetic_model
from staleflow.models.sampling import evaluate_accuracy
from staleflow.models.warmup import (
    VALIDATION_PROBLEMS,
    _validation_task,
    default_task_config,
    warmup,
)


def run(
    batch: int, lr: float, schedule: int, seed: int, *, target: float, every: int, most: int
) -> dict[str, Any]:
    config = default_task_config()
    model, tokenizer = build_arithmetic_model("tiny", seed=seed)
    check_every = max(1, every // batch)
    cap = min(schedule, most // batch)
    checks: list[tuple[int, float]] = []

    def stop(step: int) -> bool:
        accuracy = evaluate_accuracy(
            model, tokenizer, _validation_task(config), VALIDATION_PROBLEMS, 1.0, seed=seed
        )
        checks.append((step, round(accuracy, 3)))
        return accuracy >= target or step >= cap

    cpu = time.process_time()
    stats = warmup(
        model,
        tokenizer,
        ArithmeticTask(config),
        steps=schedule,
        batch_size=batch,
        lr=lr,
        seed=seed,
        stop=stop,
        check_every=check_every,
        log_every=0,
    )
    reached = bool(checks) and checks[-1][1] >= target
    return {
        "batch": batch,
        "lr": lr,
        "schedule": schedule,
        "seed": seed,
        "steps": stats.steps,
        "examples": stats.examples,
        "reached": reached,
        "last_checks": checks[-4:],
        "cpu_s": round(time.process_time() - cpu, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", help="batch,lr,schedule_steps,seed")
    parser.add_argument("--target", type=float, default=0.25)
    parser.add_argument("--check-examples", type=int, default=3200)
    parser.add_argument("--max-examples", type=int, default=112_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    header = f"{'batch':>5} {'lr':>7} {'schedule':>8} {'seed':>4} {'examples':>9} {'reached':>7}"
    print(header + "  last checks (step, accuracy)")
    for setting in args.settings:
        batch, lr, schedule, seed = setting.split(",")
        row = run(
            int(batch),
            float(lr),
            int(schedule),
            int(seed),
            target=args.target,
            every=args.check_examples,
            most=args.max_examples,
        )
        rows.append(row)
        print(
            f"{row['batch']:>5} {row['lr']:>7g} {row['schedule']:>8} {row['seed']:>4} "
            f"{row['examples']:>9} {row['reached']!s:>7}  {row['last_checks']}",
            flush=True,
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
