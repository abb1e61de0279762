"""Warm-up speed against torch threads, side by side under the machine's current load.

The supervised warm-up of the built-in model (``staleflow.models.warmup``) runs in the
launcher before the first training step. On cores shared with other processes, torch
threads beyond the idle cores spin waiting for each other, so the warm-up picks its
thread count from the load average (``idle_cores``). This script times rounds of warm-up
steps (batch 128, the default) at 1 thread, at every core, and at what ``idle_cores``
picks, alternating, and prints seconds per step (median over rounds) with the load seen.

    python experiments/bench_warmup.py --rounds 5 --steps 10 --json results/bench_warmup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from staleflow.data.synthetic import ArithmeticTask
from staleflow.models.build import build_arithmetic_model
from staleflow.models.warmup import DEFAULT_BATCH_SIZE, default_task_config, idle_cores, warmup


def time_steps(
    model: Any, tokenizer: Any, task: ArithmeticTask, threads: int, steps: int, start: int
) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        began = time.perf_counter()
        # seed=start: another slice of the problem stream each round, same cost
        warmup(model, tokenizer, task, steps=steps, seed=start, log_every=0)
        return (time.perf_counter() - began) / steps
    finally:
        torch.set_num_threads(before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="warm-up steps per round")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    picked = idle_cores()
    settings = {"1 thread": 1, f"{cores} threads (every core)": cores}
    settings[f"idle_cores() = {picked}"] = picked
    model, tokenizer = build_arithmetic_model("tiny")
    task = ArithmeticTask(default_task_config())
    time_steps(model, tokenizer, task, 1, 2, 0)  # first-call costs out of the way
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    for r in range(args.rounds):
        for i, (name, threads) in enumerate(settings.items()):
            seconds[name].append(time_steps(model, tokenizer, task, threads, args.steps, r * 3 + i))
    load_after = os.getloadavg()

    print(f"warm-up steps (batch {DEFAULT_BATCH_SIZE}), {args.rounds} rounds of {args.steps}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; {cores} cores")
    print(f"{'setting':<28} {'s/step (median)':>16} {'min':>8} {'max':>8}")
    rows = {}
    for name, values in seconds.items():
        rows[name] = {
            "threads": settings[name],
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
        }
        print(
            f"{name:<28} {rows[name]['median_s']:>16.3f} {rows[name]['min_s']:>8.3f} "
            f"{rows[name]['max_s']:>8.3f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"load_before": load_before, "load_after": load_after, "cores": cores, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
