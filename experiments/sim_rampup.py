"""Where the first eta + 1 steps go: the measurements behind the diagnosis of the review's
finding 3 (experiments/log/simulator-2026-11-22-before-the-rules.md, "Finding 3").

For each system, on one workload of the matrix at one eta, it records per run:

- the trainer's wait before each step (the time its buffer took to become Ready after
  the previous step ended), so the warm-up's share of the run is visible, and when each
  step started and how many tokens its batch held (which groups the first buffers got);
- ``withheld``: initial trajectories the staleness manager admitted at version 0 that
  stayed in the TS while some instance still had KV to spare, summed over the cycles
  before the first step (instance-seconds of admissible work left unrouted);
- ``v0_last_start``: when the last version-0 trajectory was first routed;
- ``pull_interrupted``: running or queued trajectories interrupted because their
  instance Pulled, before the warm-up ended and in all;
- rollout idle share, prefill share and the throughput.

    python experiments/sim_rampup.py --workload hetero-0.2 --rollout-gpus 64 \\
        --systems staleflow-paper,staleflow,vanilla,sticky --seeds 0,1 --jobs 2

Writes rampup.{csv,json} into --out (default results/sim_rampup/). ``--small`` runs the
workload's shape on the ``tiny`` preset's scale: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

from coordinator import Interrupt, Pull
from staleflow.sim import SimCluster, system
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.report import (
    add_seed_options,
    print_table,
    progress,
    results_dir,
    run_each,
    seed_list,
    write_rows,
)

SCRIPT = "sim_rampup"


class Run(NamedTuple):
    system: str
    workload: str
    eta: int
    seed: int
    steps: int
    rollout_gpus: int | None
    small: bool = False


def simulate(run: Run) -> dict[str, Any]:
    base = WORKLOADS[run.workload].config(
        run.eta, steps=run.steps, seed=run.seed, rollout_gpus=run.rollout_gpus, small=run.small
    )
    cluster = SimCluster(system(run.system, base))
    trainer = cluster.trainer
    probe = {"withheld": 0, "pull_interrupted": 0, "pull_interrupted_warmup": 0}
    v0_start: dict[int, float] = {}
    issue = cluster.executor.issue

    def issuing(commands: Any) -> None:
        pulled = {c.inst for c in commands if isinstance(c, Pull)}
        for c in commands:
            if isinstance(c, Interrupt) and c.inst in pulled:
                probe["pull_interrupted"] += len(c.trajs)
                if trainer.steps <= run.eta:
                    probe["pull_interrupted_warmup"] += len(c.trajs)
        issue(commands)

    cluster.executor.issue = issuing  # type: ignore[method-assign]

    def observe(c: SimCluster) -> None:
        for inst in c.instances.values():
            for t in inst.running.values():
                if t.v_traj == 0:
                    v0_start.setdefault(t.traj_id, c.now)
        if trainer.steps == 0:
            room = any(
                i.kv < 0.9 * i.cost.kv_budget and not i.waiting for i in c.instances.values()
            )
            if room:
                probe["withheld"] += sum(
                    1
                    for t in c.ts.routing_view()
                    if t.v_traj is None and c.manager.verify(0, t.group_id)
                )

    cluster.observers.append(observe)
    s = cluster.run()
    starts, ends = trainer.step_starts, trainer.step_ends
    waits = [starts[0], *(b - a for a, b in zip(ends, starts[1:], strict=False))]
    warm = run.eta + 1
    return {
        "system": run.system,
        "seed": run.seed,
        "tokens_per_s": s.tokens_per_s,
        "steady_tokens_per_s": s.steady_tokens_per_s,
        "seconds": s.elapsed_s,
        "rampup_s": s.rampup_s,
        "warmup_waits_s": sum(waits[:warm]),
        "steady_waits_s": sum(waits[warm:]),
        "waits_s": [round(w) for w in waits],
        "starts_s": [round(t) for t in starts],
        "batch_tokens": list(trainer.step_tokens),
        "withheld": probe["withheld"],
        "v0_last_start_s": max(v0_start.values(), default=0.0),
        "pull_interrupted_warmup": probe["pull_interrupted_warmup"],
        "pull_interrupted": probe["pull_interrupted"],
        "rollout_idle": s.rollout_idle_ratio,
        "prefill_share": s.rollout_prefill_ratio,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"{SCRIPT}.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--workload", default="hetero-0.2", choices=sorted(WORKLOADS))
    p.add_argument("--rollout-gpus", type=int, default=None)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="0: eta + 8")
    p.add_argument("--systems", default="staleflow-paper,staleflow,vanilla,sticky")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--small", action="store_true", help="tiny-scale smoke run (no measurement)")
    add_seed_options(p)
    args = p.parse_args(argv)
    try:
        seeds = seed_list(args.seeds, args.seed)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    steps = args.steps or args.eta + 8
    tasks = [
        Run(name, args.workload, args.eta, seed, steps, args.rollout_gpus, args.small)
        for seed in seeds
        for name in args.systems.split(",")
        if name
    ]
    rows = []
    with progress(len(tasks), "ramp-up") as advance:
        for _, row in run_each(
            args.jobs, simulate, tasks, advance, lambda r: f"{r.system} {r.seed}"
        ):
            rows.append(row)
    cols = [
        "system", "seed", "tokens_per_s", "rampup_s", "warmup_waits_s", "steady_waits_s",
        "withheld", "v0_last_start_s", "pull_interrupted_warmup", "pull_interrupted",
        "rollout_idle", "prefill_share",
    ]  # fmt: skip
    where = f"{args.workload}, eta={args.eta}, rollout GPUs {args.rollout_gpus or 'half'}"
    print_table(f"The warm-up ({where})", rows, cols)
    for r in rows:
        print(f"{r['system']} seed={r['seed']}: waits before each step {r['waits_s']}")
        print(f"{r['system']} seed={r['seed']}: steps start at {r['starts_s']}")
        batches = ", ".join(f"{n / 1e6:.1f}" for n in r["batch_tokens"])
        print(f"{r['system']} seed={r['seed']}: batches (M tokens) [{batches}]")
    paths = write_rows(results_dir(args.out, SCRIPT), "rampup", rows)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
