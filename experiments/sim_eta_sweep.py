"""Sweep the staleness bound eta on the simulated cluster and compare systems (§6.2, §6.5).

Example (the paper's §6.5 cluster, a few minutes on two cores)::

    python experiments/sim_eta_sweep.py --preset paper-6.5 --steps 8 --json out.json

Prints one row per (system, eta): throughput, time, staleness histogram, idle ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from staleflow.sim import PRESETS, SYSTEMS, SimCluster, system
from staleflow.sim.presets import Layout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="paper-6.5", choices=sorted(PRESETS))
    p.add_argument("--etas", default="0,1,2,3,5,10", help="comma-separated staleness bounds")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, from {SYSTEMS} or ablations like R1S0M1",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="training steps per run; 0: max(8, 2*eta + 6), so that at least eta + 5 steps "
        "follow the warm-up",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--train-gpus", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--max-response", type=int, default=None, help="paper-6.5 only")
    p.add_argument("--json", type=Path, default=None, help="write every summary here")
    args = p.parse_args(argv)

    etas = [int(e) for e in args.etas.split(",") if e]
    names = [s for s in args.systems.split(",") if s]
    layout: Layout | None = None
    kwargs: dict[str, object] = {"seed": args.seed}
    if args.preset == "paper-6.5":
        default = Layout()
        layout = Layout(
            rollout_gpus=args.rollout_gpus or default.rollout_gpus,
            train_gpus=args.train_gpus or default.train_gpus,
        )
        kwargs["layout"] = layout
        if args.max_response:
            kwargs["max_response"] = args.max_response
    results = []
    header = (
        f"{'system':<10} {'eta':>3} {'tok/s':>9} {'steady':>9} {'steps':>5} {'sim s':>7} {'wall s':>6} "
        f"{'roll idle':>9} {'prefill':>7} {'trn idle':>8} {'preempt':>7}  staleness"
    )
    print(header)
    for name in names:
        for eta in etas:
            if name == "sync" and eta != etas[0]:
                continue  # synchronous RL has no staleness bound to sweep
            steps = args.steps or max(8, 2 * eta + 6)
            preset = PRESETS[args.preset](eta=eta, steps=steps, **kwargs)
            config = system(name, preset, layout)
            started = time.perf_counter()
            s = SimCluster(config).run()
            wall = time.perf_counter() - started
            results.append({**s.as_dict(), "wall_s": wall})
            print(
                f"{name:<10} {s.eta:>3} {s.tokens_per_s:>9.0f} {s.steady_tokens_per_s:>9.0f} "
                f"{s.steps:>5} {s.seconds:>7.0f} "
                f"{wall:>6.1f} {s.rollout_idle_ratio:>9.3f} {s.rollout_prefill_ratio:>7.3f} "
                f"{s.trainer_idle_ratio:>8.3f} {s.preemptions:>7}  {s.staleness}"
                + ("  STALLED" if s.stalled else ""),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
